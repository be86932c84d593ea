"""Block ids from the cache service index the pool in the C and Triton kernels: an answer
with one outside the pool is refused as a lost lease (the engine re-attaches), never
passed on; so is an answer that cannot be the call's (another count of results, a result
about another sequence, an outcome of another kind). Plain code over CacheClient with
the gRPC stub replaced by a canned answer.
"""

from __future__ import annotations

import pytest
import torch

from model_service.cache.client import CacheClient, to_proto_ops
from model_service.sample.params import SamplingOptions
from model_service.sched.lease_ops import (
    Allocated, Extended, ForkRequest, LeaseAnswer, LeaseLost, LeaseOps, Refused, Released,
)
from model_service.sched.sequence import Sequence
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


def sequence(lease_id: int | None = None) -> Sequence:
    return Sequence(request_id="r", token_ids=[1, 2, 3], prompt_len=3, options=SamplingOptions(max_new_tokens=4), arrival=0,
                    lease_id=lease_id)


def lease(client: CacheClient, ops: LeaseOps) -> LeaseAnswer:
    """The client's Lease call of `ops`, answered by its stub."""
    return client._lease_blocking(cache_pb2.LeaseRequest(session_id="s", ops=to_proto_ops(ops)), ops)


ALLOCATE = LeaseOps(allocations=[sequence()])
FORK = LeaseOps(forks=[ForkRequest(parent_lease_id=1, parent_tokens=3, child=sequence())])


@pytest.mark.parametrize("ops, result", [
    (ALLOCATE, cache_pb2.LeaseResult(status=OK, sequence_id=1, block_ids=[0, 8])),
    (FORK, cache_pb2.LeaseResult(status=OK, sequence_id=2, block_ids=[3],
                                 copy=cache_pb2.BlockCopy(src_block=2, dst_block=1 << 20))),
], ids=["leased", "copy"])
def test_a_block_id_outside_the_pool_is_a_lost_lease(ops, result):
    client = client_answering([result])
    try:
        with pytest.raises(LeaseLost, match="outside its pool of 8 blocks"):
            lease(client, ops)
    finally:
        client.close()


def test_block_ids_inside_the_pool_pass():
    client = client_answering([cache_pb2.LeaseResult(status=OK, sequence_id=1, block_ids=[0, 7])])
    try:
        answer = lease(client, ALLOCATE)
        assert answer.allocations == (Allocated(1, (0, 7)),)
    finally:
        client.close()


def test_each_kind_gets_its_own_outcome():
    seq = sequence(lease_id=4)
    ops = LeaseOps(releases=[], extends=[(seq, 8)], allocations=[sequence()], top_ups=[(seq, 12)])
    client = client_answering([
        cache_pb2.LeaseResult(status=OK, sequence_id=4, block_ids=[5]),
        cache_pb2.LeaseResult(status=cache_pb2.LEASE_STATUS_NO_FREE_BLOCKS, message="full"),
        cache_pb2.LeaseResult(status=cache_pb2.LEASE_STATUS_NO_FREE_BLOCKS, sequence_id=4, message="full"),
    ])
    try:
        answer = lease(client, ops)
        assert (answer.extends, answer.allocations, answer.top_ups) == \
            ((Extended((5,)),), (Refused("NO_FREE_BLOCKS", "full"),), (Refused("NO_FREE_BLOCKS", "full"),))
    finally:
        client.close()


@pytest.mark.parametrize("results, error", [
    ([], "answered 0 ops of 1"),
    ([cache_pb2.LeaseResult(status=OK, sequence_id=7, block_ids=[1])], "the extend of lease 4 about lease 7"),
    ([cache_pb2.LeaseResult(status=cache_pb2.LEASE_STATUS_NOT_FOUND, sequence_id=0)], "extend of lease 4 about lease 0"),
], ids=["count", "another-sequence", "refused-about-none"])
def test_an_answer_that_is_not_the_calls_is_a_lost_lease(results, error):
    client = client_answering(results)
    try:
        with pytest.raises(LeaseLost, match=error):
            lease(client, LeaseOps(extends=[(sequence(lease_id=4), 8)]))
    finally:
        client.close()


def test_an_outcome_of_another_kind_cannot_be_applied():
    """A typed mismatch (an allocation's outcome where an extend's belongs) is refused
    before the scheduler reads it, whatever its position."""
    ops = LeaseOps(extends=[(sequence(lease_id=4), 8)], allocations=[sequence()])
    with pytest.raises(LeaseLost, match="extends ops was answered with Allocated, not Extended or Refused"):
        LeaseAnswer.of(ops, [Allocated(5, (1,)), Extended((2,))], 0)
    with pytest.raises(LeaseLost, match="answered 1 extends ops of 0"):
        LeaseAnswer(extends=(Released(),)).check(LeaseOps())
    assert LeaseAnswer.of(ops, [Extended((2,)), Allocated(5, (1,))], 3).allocations == (Allocated(5, (1,)),)
