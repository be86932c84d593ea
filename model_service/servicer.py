"""ModelService over gRPC: the gRPC front door of model_service.generation.

It only translates: calls go to the GenerationService, a GenerateError becomes the call's
status. Validation and the engine live behind GenerationService, shared with the HTTP door.
"""

from __future__ import annotations

from model_service.generation import GenerateError, GenerationService
from pagedkv.model.v1 import model_pb2_grpc


class ModelServicer(model_pb2_grpc.ModelServiceServicer):
    def __init__(self, generation: GenerationService) -> None:
        self.generation = generation

    async def GetModelInfo(self, request, context):
        return self.generation.model_info()

    async def Generate(self, request, context):
        responses = self.generation.generate(request)
        try:
            async for response in responses:
                yield response
        except GenerateError as error:
            await context.abort(error.code, error.message)
        finally:
            await responses.aclose()  # its own finally cancels the request, if it still runs
