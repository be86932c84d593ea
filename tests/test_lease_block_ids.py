"""Block ids from the cache service index the pool in the C and Triton kernels: an answer
with one outside the pool is refused as a lost lease (the engine re-attaches), never
passed on. Plain code over CacheClient with the gRPC stub replaced by a canned answer.
"""

from __future__ import annotations

import pytest
import torch

from model_service.cache.client import CacheClient
from model_service.sched.lease_ops import LeaseLost
from pagedkv.cache.v1 import cache_pb2
from pagedkv.kv_geometry import KvGeometry


class CannedStub:
    def __init__(self, num_blocks: int, results: list[cache_pb2.LeaseResult]) -> None:
        self.num_blocks = num_blocks
        self.results = results

    def Attach(self, request, **_):  # noqa: N802 - gRPC's method name
        response = cache_pb2.AttachResponse()
        response.sizing.num_blocks = self.num_blocks
        return response

    def Lease(self, request, **_):  # noqa: N802
        return cache_pb2.LeaseResponse(results=self.results, blocks_available=0)


def client_answering(results: list[cache_pb2.LeaseResult]) -> CacheClient:
    """A client attached (through the stub) to a pool of 8 blocks."""
    client = CacheClient("127.0.0.1:9")  # never connects: the stub answers
    client.stub = CannedStub(8, results)
    client.attach("test", KvGeometry(1, 1, 8, torch.float32, "cpu"), workspace_bytes=0, max_model_len=16)
    return client


OK = cache_pb2.LEASE_STATUS_OK


@pytest.mark.parametrize("result", [
    cache_pb2.LeaseResult(status=OK, sequence_id=1, block_ids=[0, 8]),
    cache_pb2.LeaseResult(status=OK, sequence_id=1, block_ids=[3], copy=cache_pb2.BlockCopy(src_block=2,
                                                                                            dst_block=1 << 20)),
], ids=["leased", "copy"])
def test_a_block_id_outside_the_pool_is_a_lost_lease(result):
    client = client_answering([result])
    try:
        with pytest.raises(LeaseLost, match="outside its pool of 8 blocks"):
            client._lease_blocking(cache_pb2.LeaseRequest(session_id="s"))
    finally:
        client.close()


def test_block_ids_inside_the_pool_pass():
    client = client_answering([cache_pb2.LeaseResult(status=OK, sequence_id=1, block_ids=[0, 7])])
    try:
        outcomes, _ = client._lease_blocking(cache_pb2.LeaseRequest(session_id="s"))
        assert outcomes[0].block_ids == (0, 7)
    finally:
        client.close()
