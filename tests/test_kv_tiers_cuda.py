"""The KV tiers over a CUDA pool: through tests/cuda_tier_fakes.py here, for real where a GPU is.

What the fakes show: a disk tier without a host tier stages a CUDA pool's blocks in
host memory (the disk writer can encode them), a bounded number of them, each whole
before the demotion's check of its registration; a step of the tiers' task that raises
is logged and counted and the task goes on; the host tier pins exactly its slots; a
batch of blocks crosses between the device and the host in one copy; and while a
promotion's copy runs, the cache service's event loop answers other calls.
"""

from __future__ import annotations

import asyncio
import threading
import time

import grpc
import pytest
import torch
from cuda_tier_fakes import FakeCuda, FakeCudaTensor, on_fake_cuda
from test_kv_tiers import BS, BYTES_PER_BLOCK, Stack, tokens_of

from harness.cache_helpers import allocate, attach, cache_stub, lease, release, stats, wait_for
from cache_service.tiers import demotion, device_copies
from cache_service.tiers.settings import TierSettings
from pagedkv.cache.v1 import cache_pb2

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: a real pool on the GPU")


@pytest.fixture
def fake_cuda(monkeypatch):
    return FakeCuda(monkeypatch)


def disk_only(tmp_path) -> TierSettings:
    return TierSettings(disk_cache_dir=str(tmp_path), disk_cache_bytes=1 << 20)


async def until(predicate, what: str, timeout_s: float = 30) -> None:
    """Yields to the event loop until ``predicate()``; fails only on a hang."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


async def run_task_until(tiers, predicate, what: str) -> None:
    """Runs the tiers' background task until ``predicate()``; the task must still be running then."""
    task = asyncio.create_task(tiers.run())
    try:
        await until(lambda: predicate() or task.done(), what)
        assert not task.done(), f"the tiers' task ended: {task.exception()!r}"
        assert predicate()
    finally:
        task.cancel()


# -- a disk tier without a host tier, on CUDA ------------------------------------------------


def test_a_disk_tier_alone_writes_a_cuda_pools_blocks_through_host_memory(tmp_path, fake_cuda, monkeypatch):
    stack = Stack(disk_only(tmp_path), device=on_fake_cuda)
    tiers = stack.tiers
    written_types = []
    write = tiers.disk.write
    monkeypatch.setattr(tiers.disk, "write", lambda record, payload: written_types.append(type(payload))
                        or write(record, payload))
    tokens = tokens_of(21)
    stack.run(tokens)
    asyncio.run(run_task_until(tiers, lambda: tiers.counters["disk"].demotions == 3, "three blocks on disk"))
    assert written_types == [torch.Tensor] * 3, "the disk writer was handed device tensors"
    stack.evict_everything()
    again = stack.run(tokens)  # checks the promoted bytes
    assert (again.cached_tokens, again.cached_tokens_disk) == (12, 12)
    assert tiers.counters["disk"].errors == 0 and not tiers.demotions.disk_queue
    tiers.close()
    assert sorted(fake_cuda.unregistered) == sorted(fake_cuda.registered), "pinned staging left registered"


def test_a_demotion_waits_for_its_device_copy_before_checking_the_registration(tmp_path, fake_cuda, monkeypatch):
    stack = Stack(disk_only(tmp_path), device=on_fake_cuda)
    tiers = stack.tiers
    finish = tiers.demotions._finish_demotion
    monkeypatch.setattr(tiers.demotions, "_finish_demotion", lambda batch: fake_cuda.log.append("check") or finish(batch))
    stack.run(tokens_of(22))
    stack.demote_all()
    assert fake_cuda.log == ["sync", "check"]
    assert len(tiers.demotions.disk_queue) == 3


def test_a_block_taken_while_its_device_copy_is_held_is_not_staged(tmp_path, fake_cuda):
    stack = Stack(disk_only(tmp_path), device=on_fake_cuda)
    tiers = stack.tiers
    tokens = tokens_of(23)
    stack.run(tokens)

    async def scenario() -> int:
        fake_cuda.hold.set()
        demotion = asyncio.create_task(tiers.demotions.demote_some_async(16))
        await until(fake_cuda.holding.is_set, "the copy to be held")
        stack.evict_everything()  # a Lease call takes the blocks while they are copied
        fake_cuda.release()
        return await demotion

    assert asyncio.run(scenario()) == 0
    assert tiers.demotions.missed_demotions == 3 and not tiers.demotions.disk_queue
    stack.ledger.check_invariants()


def test_the_blocks_staged_for_disk_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(demotion, "MAX_STAGED_BLOCKS", 2)
    stack = Stack(disk_only(tmp_path))
    tiers = stack.tiers
    go = threading.Event()
    write = tiers.disk.write

    def slow_write(record, payload):
        assert go.wait(30)
        return write(record, payload)

    monkeypatch.setattr(tiers.disk, "write", slow_write)
    staged_at_demotion = []
    demote = tiers.demotions.demote_some_async

    async def recording_demote(limit):
        staged_at_demotion.append(len(tiers.demotions.disk_queue))
        return await demote(limit)

    monkeypatch.setattr(tiers.demotions, "demote_some_async", recording_demote)

    async def scenario() -> None:
        stack.run(tokens_of(24))
        task = asyncio.create_task(tiers.run())
        try:
            await until(lambda: tiers.demotions.writing == 1, "the first write")
            stack.run(tokens_of(25))  # three more blocks queued while two wait for the disk
            go.set()
            await until(lambda: tiers.counters["disk"].demotions == 6 or task.done(), "six blocks on disk")
            assert not task.done()
        finally:
            task.cancel()

    asyncio.run(scenario())
    assert staged_at_demotion and max(staged_at_demotion) < 2, staged_at_demotion


# -- a step of the tiers' task that raises ----------------------------------------------------


def test_a_write_that_raises_is_logged_and_counted_and_the_next_blocks_are_written(tmp_path, monkeypatch, capsys):
    stack = Stack(disk_only(tmp_path))
    tiers = stack.tiers
    write = tiers.disk.write
    calls = []

    def failing_once(record, payload):
        calls.append(record.digest)
        if len(calls) == 1:
            raise TypeError("can't convert cuda:0 device type tensor to numpy")
        return write(record, payload)

    monkeypatch.setattr(tiers.disk, "write", failing_once)
    stack.run(tokens_of(26))
    asyncio.run(run_task_until(tiers, lambda: len(calls) == 3 and not tiers.demotions.writing, "three writes"))
    assert tiers.counters["disk"].errors == 1 and tiers.counters["disk"].demotions == 2
    assert "disk_cache_write_failed" in capsys.readouterr().out
    stack.ledger.check_invariants()


def test_a_demotion_that_raises_is_logged_and_counted_and_frees_its_slots(monkeypatch, capsys):
    stack = Stack(TierSettings(host_cache_bytes=4 * BYTES_PER_BLOCK))
    tiers = stack.tiers
    copy = tiers.demotions._copy
    calls = []

    def failing_once(batch):
        calls.append(len(batch.blocks))
        if len(calls) == 1:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        return copy(batch)

    monkeypatch.setattr(tiers.demotions, "_copy", failing_once)
    first, second = tokens_of(27), tokens_of(28)
    stack.run(first)

    async def scenario() -> None:
        task = asyncio.create_task(tiers.run())
        try:
            await until(lambda: tiers.counters["host"].errors == 1 or task.done(), "the failed step")
            stack.run(second)
            await until(lambda: tiers.counters["host"].demotions == 3 or task.done(), "the next demotion")
            assert not task.done(), f"the tiers' task ended: {task.exception()!r}"
        finally:
            task.cancel()

    asyncio.run(scenario())
    assert tiers.counters["host"].errors == tiers.demotions.failed_steps == 1 and tiers.demotions.missed_demotions == 3
    assert "kv_tier_step_failed" in capsys.readouterr().out
    tiers.check_invariants()  # the failed demotion's slots are free again
    stack.evict_everything()
    assert stack.run(second).cached_tokens_host == 12 and stack.run(first).cached_tokens == 0


# -- the host tier's memory and copies on CUDA -------------------------------------------------


def test_the_host_tier_pins_exactly_its_slots(fake_cuda):
    stack = Stack(TierSettings(host_cache_bytes=5 * BYTES_PER_BLOCK), device=on_fake_cuda)
    host = stack.tiers.host
    assert fake_cuda.registered[host.tensor.data_ptr()] == 5 * BYTES_PER_BLOCK  # not rounded to 8 blocks' worth
    staging = stack.tiers.mover.host_stage
    assert fake_cuda.registered[staging.data_ptr()] == device_copies.STAGE_BLOCKS * BYTES_PER_BLOCK
    assert len(fake_cuda.registered) == 2
    stack.tiers.close()
    assert sorted(fake_cuda.unregistered) == sorted(fake_cuda.registered)


def test_a_batch_of_blocks_crosses_to_and_from_the_device_in_one_copy(fake_cuda, monkeypatch):
    monkeypatch.setattr(device_copies, "STAGE_BLOCKS", 3)
    stack = Stack(TierSettings(host_cache_bytes=8 * BYTES_PER_BLOCK), device=on_fake_cuda)
    tokens = tokens_of(29, length=7 * BS + 1)  # 7 full blocks: 3 batches of at most 3
    stack.run(tokens)
    FakeCudaTensor.ops.clear()
    stack.demote_all()
    assert FakeCudaTensor.ops == ["index_select", "copy_"] * 3  # one gather and one DMA a batch
    stack.evict_everything()
    FakeCudaTensor.ops.clear()
    allocation = stack.ledger.allocate("owner", len(tokens), tokens, ("model-1", ""))
    stack.tiers.promotions.settle()
    assert FakeCudaTensor.ops == ["copy_", "index_copy_"] * 3  # one DMA and one scatter a batch
    assert allocation.cached_tokens_host == 7 * BS
    assert [name.startswith("kv-tiers-copy") for name, _ in fake_cuda.devices_set] == [True], \
        "the copy thread did not make the pool's device its own"
    for index, block_id in enumerate(allocation.block_ids[:7]):
        assert torch.equal(stack.pool_tensor[:, :, block_id], stack.expected(tokens, index))


def test_the_cache_service_answers_while_a_promotion_is_copying(tmp_path, fake_cuda, monkeypatch):
    from cache_service.core import pool as pool_module
    from cache_service.core.pool import KvPool, PoolSettings
    from cache_service.api.servicer import CacheServicer
    from pagedkv.cache.v1 import cache_pb2_grpc

    real_tiers = pool_module.KvTiers
    monkeypatch.setattr(pool_module, "KvTiers", lambda pool, tensor, *args, **kwargs: real_tiers(
        pool, on_fake_cuda(tensor), *args, **kwargs))
    block_bytes = 2 * 2 * 16 * 2 * 16 * 4  # cache_helpers.TINY_GEOMETRY, 16-token blocks
    kv_pool = KvPool(PoolSettings(kv_cache_bytes=1 << 20, max_blocks=8, shm_dir=str(tmp_path),
                                  tiers=TierSettings(host_cache_bytes=8 * block_bytes)))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="cache-service-loop", daemon=True)
    thread.start()

    async def start():
        server = grpc.aio.server()
        cache_pb2_grpc.add_CacheServiceServicer_to_server(CacheServicer(kv_pool), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, port

    server, port = asyncio.run_coroutine_threadsafe(start(), loop).result(30)
    try:
        stub = cache_stub(f"127.0.0.1:{port}")
        session = attach(stub).session_id
        tokens = tokens_of(30, length=33)  # two full blocks
        first = lease(stub, session, allocate(len(tokens), tokens)).results[0]
        pool_tensor = kv_pool._memory.tensor
        for index, block_id in enumerate(first.block_ids[:2]):
            pool_tensor[:, :, block_id] = float(index + 1)  # the K/V a model service would write
        lease(stub, session, release(first.sequence_id, cache_prefix=True, token_ids=tokens))
        wait_for(lambda: next(t for t in stats(stub).tiers if t.tier == "host").blocks_cached == 2, 30,
                 "two blocks demoted to the host tier")
        whole_pool = lease(stub, session, allocate(8 * 16)).results[0]
        lease(stub, session, release(whole_pool.sequence_id))

        fake_cuda.hold.set()
        promotion = stub.Lease.future(cache_pb2.LeaseRequest(session_id=session, ops=[allocate(len(tokens), tokens)]),
                                      timeout=30)
        assert fake_cuda.holding.wait(30), "the promotion's copy never started"
        stub.Heartbeat(cache_pb2.HeartbeatRequest(session_id=session), timeout=10)
        assert stats(stub).blocks_leased > 0  # answered while the copy is held
        assert not promotion.done(), "the Lease call replied before its promoted blocks were copied"
        fake_cuda.release()
        again = promotion.result(30).results[0]
        assert (again.cached_tokens, again.cached_tokens_host) == (32, 32)
        for index, block_id in enumerate(again.block_ids[:2]):
            assert torch.equal(pool_tensor[:, :, block_id], torch.full_like(pool_tensor[:, :, block_id], index + 1.0))
    finally:
        fake_cuda.release()
        asyncio.run_coroutine_threadsafe(server.stop(None), loop).result(30)
        loop.call_soon_threadsafe(kv_pool.close)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)


# -- on a GPU -------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.parametrize("host_slots", [0, 8], ids=["disk-only", "host-and-disk"])
def test_tiers_on_a_cuda_pool_move_exact_bytes(tmp_path, host_slots):  # pragma: no cover - GPU only
    settings = TierSettings(host_cache_bytes=host_slots * BYTES_PER_BLOCK, disk_cache_dir=str(tmp_path),
                            disk_cache_bytes=1 << 20)
    stack = Stack(settings, device=lambda tensor: tensor.cuda())
    tiers = stack.tiers
    if host_slots:
        assert tiers.host.tensor.is_pinned() and tiers.host.tensor.nbytes == host_slots * BYTES_PER_BLOCK
    tokens = tokens_of(31, length=7 * BS + 1)
    stack.run(tokens)
    tier = "host" if host_slots else "disk"
    asyncio.run(run_task_until(tiers, lambda: tiers.counters[tier].demotions == 7, f"seven blocks in the {tier} tier"))
    stack.evict_everything()
    again = stack.run(tokens)  # compares every promoted block with what was written
    assert again.cached_tokens == 7 * BS and tiers.counters["disk"].errors == 0
    tiers.close()
