"""ModelService over gRPC: the gRPC front door of model_service.api.generation.

It only translates: calls go to the GenerationService (after admit.py's checks, as the
HTTP door's), a GenerateError becomes the call's status. Validation and the engine live
behind GenerationService, shared with the HTTP door.
"""

from __future__ import annotations

import time

import grpc

from model_service.api.admit import admit
from model_service.api.generation import GenerateError, GenerationService
from model_service.api.lora_admin import LoraAdmin
from model_service.api.request_rate import throttled
from model_service.api.tenants import SINGLE, ApiKeys, Tenant
from pagedkv.bearer import presented_token
from pagedkv.model.v1 import model_pb2, model_pb2_grpc


class ModelServicer(model_pb2_grpc.ModelServiceServicer):
    def __init__(self, generation: GenerationService, api_keys: ApiKeys | None = None,
                 lora_admin: LoraAdmin | None = None) -> None:
        self.generation = generation
        self.api_keys = api_keys
        self.lora_admin = lora_admin or LoraAdmin(generation.loras, None)

    def _tenant(self, context) -> Tenant:
        # The auth interceptor has let only known keys through: this finds whose it is.
        if self.api_keys is None:
            return SINGLE
        metadata = dict(context.invocation_metadata() or ())
        return self.api_keys.tenant_of(presented_token(metadata.get("authorization"))) or SINGLE

    async def GetModelInfo(self, request, context):
        return self.generation.model_info()

    async def Generate(self, request, context):
        # The call's deadline holds inside the engine too (DEADLINE_EXCEEDED, blocks freed).
        remaining_s = context.time_remaining()
        deadline = time.monotonic() + remaining_s if remaining_s is not None else None
        tenant = self._tenant(context)
        refused = await throttled(tenant)
        if refused is not None:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, refused)
        try:
            await admit(self.generation, [request], tenant, self.api_keys)
        except GenerateError as error:
            await context.abort(error.code, error.message)
        responses = self.generation.generate(request, deadline=deadline, tenant=tenant)
        try:
            async for response in responses:
                yield response
        except GenerateError as error:
            await context.abort(error.code, error.message)
        finally:
            await responses.aclose()  # its own finally cancels the request, if it still runs

    async def Abort(self, request, context):
        return model_pb2.AbortResponse(aborted=self.generation.abort(list(request.request_ids),
                                                                     self._tenant(context)))

    async def LoadLoraAdapter(self, request, context):
        try:
            message = await self.lora_admin.load(request.lora_name, request.lora_path, self._tenant(context))
        except GenerateError as error:
            await context.abort(error.code, error.message)
        return model_pb2.LoadLoraAdapterResponse(message=message)

    async def UnloadLoraAdapter(self, request, context):
        try:
            message = self.lora_admin.unload(request.lora_name, self._tenant(context))
        except GenerateError as error:
            await context.abort(error.code, error.message)
        return model_pb2.UnloadLoraAdapterResponse(message=message)
