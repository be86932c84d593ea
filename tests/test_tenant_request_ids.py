"""Request ids belong to their tenant: with --api-keys, one tenant's Abort cannot end
another's request of the same id, and one tenant's live id does not refuse another's,
on the gRPC door and the OpenAI HTTP door alike (real services, two tenants).

Each test holds a long request of tenant a open (read past its first message) and ends
it with a's own Abort at the end: that Abort finding it (aborted == 1) shows it was live
through everything tenant b did in between, whatever the machine's speed.
"""

from __future__ import annotations

import json

import grpc
import openai
import pytest

from harness.processes import SHARED_LEASE_TTL, start_cache_service, start_model_service
from pagedkv.model.v1 import model_pb2, model_pb2_grpc
from pagedkv.serving import bearer_metadata

KEY_A, KEY_B = "sk-ids-tenant-a", "sk-ids-tenant-b"
LONG = 1500  # new tokens: far more than the few calls made while it runs need


@pytest.fixture(scope="module")
def services(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tenant-ids")
    keys = tmp / "keys.json"
    keys.write_text(json.dumps({KEY_A: {"tenant": "a"}, KEY_B: {"tenant": "b"}}))
    with start_cache_service(tmp, *SHARED_LEASE_TTL, "--kv-cache-bytes", "16MiB") as cache, \
            start_model_service(tmp, cache.address, "--api-keys", str(keys), "--max-model-len", "2048") as model:
        channel = grpc.insecure_channel(model.address)
        yield model, model_pb2_grpc.ModelServiceStub(channel)
        channel.close()


def hold(stub, key: str, request_id: str):
    """A long stream of `key`'s tenant under `request_id`, read past its first message."""
    call = stub.Generate(model_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=[5, 6, 7],
        sampling=model_pb2.SamplingParams(max_new_tokens=LONG, ignore_eos=True, temperature=0)),
        timeout=300, metadata=bearer_metadata(key))
    first = next(call)
    assert first.request_id == request_id and first.token_ids
    return call


def abort(stub, key: str, *request_ids: str) -> int:
    return stub.Abort(model_pb2.AbortRequest(request_ids=list(request_ids)), timeout=30,
                      metadata=bearer_metadata(key)).aborted


def last(call) -> model_pb2.GenerateResponse:
    return list(call)[-1]


def test_a_tenant_aborts_only_its_own_request_of_an_id(services):
    _, stub = services
    held = hold(stub, KEY_A, "job-1")
    assert abort(stub, KEY_B, "job-1") == 0  # b has no job-1: a's runs on
    assert abort(stub, KEY_A, "job-1") == 1  # still live: b's Abort did not end it
    assert last(held).finish_reason == model_pb2.FINISH_REASON_ABORT


def test_a_tenant_may_use_an_id_another_holds_on_both_doors_but_not_its_own_twice(services):
    model, stub = services
    held = hold(stub, KEY_A, "job-2")
    short = model_pb2.GenerateRequest(request_id="job-2", prompt_token_ids=[9, 10],
                                      sampling=model_pb2.SamplingParams(max_new_tokens=2, ignore_eos=True))
    done = list(stub.Generate(short, timeout=120, metadata=bearer_metadata(KEY_B)))
    assert done[-1].finish_reason == model_pb2.FINISH_REASON_LENGTH and done[-1].request_id == "job-2"
    client_b = openai.OpenAI(base_url=model.http_url, api_key=KEY_B, max_retries=0, timeout=120)
    completion = client_b.completions.create(model="tiny", prompt="hi", max_tokens=2,
                                             extra_body={"request_id": "job-2", "ignore_eos": True})
    assert completion.choices[0].finish_reason == "length"
    with pytest.raises(grpc.RpcError) as error:  # a's own id, live: refused
        list(stub.Generate(short, timeout=120, metadata=bearer_metadata(KEY_A)))
    assert error.value.code() == grpc.StatusCode.ALREADY_EXISTS
    client_a = openai.OpenAI(base_url=model.http_url, api_key=KEY_A, max_retries=0, timeout=120)
    with pytest.raises(openai.BadRequestError):
        client_a.completions.create(model="tiny", prompt="hi", max_tokens=2, extra_body={"request_id": "job-2"})
    assert abort(stub, KEY_A, "job-2") == 1  # a's held it throughout
    assert last(held).finish_reason == model_pb2.FINISH_REASON_ABORT
