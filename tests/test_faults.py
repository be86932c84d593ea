"""Faults: real processes killed (-9), terminated (SIGTERM) and abandoned by their clients.

Every test starts the cache and model services as real processes, puts streams in
flight, breaks something, and then checks what the contract promises: streams end with
a status instead of hanging, health says what is true, and GetStats shows no block that
no live sequence holds. Waits poll (wait_for) with generous deadlines (GENEROUS_S): on a
loaded machine things take longer, and a test fails only if they never happen, never for
taking a second too long. Nothing sleeps and hopes; no assertion is about elapsed time.
"""

from __future__ import annotations

import functools
import signal
import sys
import time

import grpc
import pytest
from generate_stream import GenerateStream
from grpc_generate import deadline_after_first_token, greedy

from harness.cache_helpers import cache_stub, stats, wait_for
from harness.processes import (DEFAULT_TIMEOUT_S, ServiceProcess, _test_env, free_port, start_cache_service,
                               start_model_service)
from pagedkv.cache.v1 import cache_pb2
from pagedkv.health_probe import check as health_check
from pagedkv.model.v1 import model_pb2, model_pb2_grpc

POOL_ARGS = ("--kv-cache-bytes", "16MiB")  # ~1900 blocks of the tiny model: nothing is preempted here
# A TTL far beyond every wait here: leases that come back came back because the dead
# holder's connection closed (HoldSession) or it detached, never by expiry; and no live
# service on a loaded machine misses it.
LEASE_TTL_MS = 600_000
RECLAIM_GRACE_MS = 500
# How long a wait may take before the test calls it a hang; far beyond any healthy run.
GENEROUS_S = 60
# Long enough that no stream finishes before the fault: the tiny model's max_model_len is 2048.
LONG = 1900

# Each test starts two or three services (each pays torch's import); a hang still fails.
pytestmark = pytest.mark.timeout(300)


def prompt(seed: int, length: int) -> list[int]:
    return [4 + (seed * 31 + i * 7) % 250 for i in range(length)]


def request(tokens: list[int], max_new_tokens: int) -> model_pb2.GenerateRequest:
    return model_pb2.GenerateRequest(
        prompt_token_ids=tokens,
        sampling=model_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True),
    )


# One Generate stream on its own thread, long enough by default that no stream ends before the fault.
Stream = functools.partial(GenerateStream, max_new_tokens=LONG, timeout_s=3 * GENEROUS_S)


def start_streams(stub, count: int, request_ids: str = "", **kwargs) -> list[Stream]:
    """request_ids: a format string for each stream's request id (given its index), or none."""
    streams = [Stream(stub, prompt(seed, 8 + seed % 24), request_id=request_ids.format(seed), **kwargs)
               for seed in range(count)]
    deadline = time.monotonic() + GENEROUS_S
    for stream in streams:
        assert stream.started.wait(max(0.0, deadline - time.monotonic())), f"a stream got no token in {GENEROUS_S} s"
    assert not any(s.done.is_set() for s in streams), [(s.code, s.details) for s in streams if s.done.is_set()]
    return streams


def wait_ended(streams: list[Stream], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for stream in streams:
        assert stream.done.wait(max(0.0, deadline - time.monotonic())), "a stream hung after the fault"


def model_stub(address: str) -> model_pb2_grpc.ModelServiceStub:
    return model_pb2_grpc.ModelServiceStub(grpc.insecure_channel(address))


def health(address: str) -> str:
    with grpc.insecure_channel(address) as channel:
        return health_check(channel)


def generate(stub, tokens: list[int], max_new_tokens: int) -> model_pb2.GenerateResponse:
    return greedy(stub, tokens, max_new_tokens, timeout=GENEROUS_S)[1]


def start_both(tmp_path, cache_args, model_args=()):
    """Starts the cache and model services at once, so that their torch imports overlap.

    Both are spawned from this thread: PR_SET_PDEATHSIG (see processes.py) signals a child
    when the *thread* that forked it exits, so spawning from a pool thread would SIGTERM
    the service as soon as that thread finished.
    """
    cache_port = free_port()
    cache = ServiceProcess("cache", [sys.executable, "-m", "cache_service", *map(str, cache_args),
                                     "--port", str(cache_port)], tmp_path, _test_env(None))
    model = ServiceProcess("model", [sys.executable, "-m", "model_service", "--model", "tiny",
                                     "--cache-service", f"127.0.0.1:{cache_port}", *map(str, model_args)],
                           tmp_path, _test_env(None))
    try:
        cache.wait_started(DEFAULT_TIMEOUT_S)
    finally:
        if cache.returncode is not None:
            model.kill()
    return cache, model.wait_started(DEFAULT_TIMEOUT_S)


def pool_files(directory) -> list[str]:
    return sorted(path.name for path in directory.glob("pagedkv-*.kv"))


def test_kill9_model_service_reclaims_leases_and_a_restart_keeps_the_prefix_cache(tmp_path):
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    cache, model = start_both(tmp_path, (*POOL_ARGS, "--lease-ttl-ms", LEASE_TTL_MS,
                                         "--reclaim-grace-ms", RECLAIM_GRACE_MS, "--shm-dir", shm_dir))
    with cache:
        cache_rpc = cache_stub(cache.address)
        stub = model_stub(model.address)
        info_before = stub.GetModelInfo(model_pb2.GetModelInfoRequest())
        sizing_before = cache_rpc.GetSizing(cache_pb2.GetSizingRequest(), timeout=10)
        cached_prompt = prompt(99, 40)  # two full blocks of 16 tokens outlive the request as prefix cache
        assert generate(stub, cached_prompt, 4).usage.cached_tokens == 0
        [pool_file] = pool_files(shm_dir)

        streams = start_streams(stub, 16)
        assert stats(cache_rpc).blocks_leased > 0
        model.kill()

        # No Detach ever came and the TTL is far off: the cache service learns of the death
        # from the session's hold, whose connection closed with the process.
        wait_for(lambda: (lambda s: s.blocks_leased == 0 and s.sessions == 0)(stats(cache_rpc)),
                 timeout_s=GENEROUS_S, what="the dead model service's leases to be reclaimed")
        wait_ended(streams, GENEROUS_S)
        assert {s.code for s in streams} == {grpc.StatusCode.UNAVAILABLE}, {(s.code, s.details) for s in streams}
        assert stats(cache_rpc).blocks_cached >= 2

        with start_model_service(tmp_path, cache.address) as restarted:
            stub = model_stub(restarted.address)
            # Same pool: same file, same sizing, and the prefix cached before the kill hits.
            assert pool_files(shm_dir) == [pool_file]
            assert stub.GetModelInfo(model_pb2.GetModelInfoRequest()).max_total_tokens == info_before.max_total_tokens
            assert cache_rpc.GetSizing(cache_pb2.GetSizingRequest(), timeout=10) == sizing_before
            last = generate(stub, cached_prompt, 4)
            assert last.finish_reason == model_pb2.FINISH_REASON_LENGTH
            assert last.usage.cached_tokens >= 16, last.usage
            wait_for(lambda: stats(cache_rpc).blocks_leased == 0, GENEROUS_S,
                     "the restarted service's blocks to be released")
        assert restarted.returncode == 0


def test_kill9_cache_service_fails_streams_then_the_model_service_reattaches(tmp_path):
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    cache_args = (*POOL_ARGS, "--lease-ttl-ms", LEASE_TTL_MS, "--shm-dir", shm_dir)
    cache, model = start_both(tmp_path, cache_args)
    with model:
        stub = model_stub(model.address)
        # Deadlines far beyond the waits below: a stream that ends ended by the fault.
        streams = start_streams(stub, 16, timeout_s=3 * GENEROUS_S)
        [dead_pool_file] = pool_files(shm_dir)
        cache.kill()

        # Every stream ends with UNAVAILABLE (not DEADLINE_EXCEEDED: none hung to its deadline).
        wait_ended(streams, GENEROUS_S)
        assert {s.code for s in streams} == {grpc.StatusCode.UNAVAILABLE}, {(s.code, s.details) for s in streams}
        wait_for(lambda: health(model.address) == "NOT_SERVING", GENEROUS_S, "the model service to report NOT_SERVING")
        try:
            generate(stub, prompt(1, 8), 4)
            raise AssertionError("Generate succeeded with no cache service")
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE, error
        assert pool_files(shm_dir) == [dead_pool_file], "kill -9 should leave the pool file behind"

        # A new cache service on the same port: the stale pool file goes at its start, and the
        # model service re-attaches by itself (a new pool, made by the new process).
        with start_cache_service(tmp_path, *cache_args, "--port", cache.port) as cache_again:
            assert dead_pool_file not in pool_files(shm_dir), "the dead cache service's pool file survived"
            # The channel's reconnect backoff is capped at 1 s (cache_client.RECONNECT_OPTIONS),
            # so re-attach follows within seconds, not gRPC's default of up to 120 s (this
            # wait is shorter than that, so a lost cap still fails here).
            wait_for(lambda: health(model.address) == "SERVING", GENEROUS_S, "the model service to re-attach",
                     poll_s=0.1)
            [new_pool_file] = pool_files(shm_dir)
            assert f"pagedkv-{cache_again.pid}-" in new_pool_file
            last = generate(stub, prompt(2, 20), 8)
            assert last.finish_reason == model_pb2.FINISH_REASON_LENGTH and last.usage.completion_tokens == 8
            cache_rpc = cache_stub(cache_again.address)
            wait_for(lambda: stats(cache_rpc).blocks_leased == 0, GENEROUS_S, "every block to be released")
            assert stats(cache_rpc).sessions == 1
    assert model.returncode == 0


def test_cancel_disconnect_and_deadline_release_blocks_at_once(tmp_path):
    cache, model = start_both(tmp_path, POOL_ARGS)
    with cache, model:
        cache_rpc = cache_stub(cache.address)
        stub = model_stub(model.address)
        background = start_streams(stub, 3, request_ids="background-{}")

        def running_background() -> int:  # on a fast machine one may finish during the test
            return sum(not s.done.is_set() for s in background)

        def sequences_are(victims: int):
            return lambda: stats(cache_rpc).sequences == victims + running_background()

        cancelled = stub.Generate(request(prompt(10, 40), LONG), timeout=3 * GENEROUS_S)
        own_channel = grpc.insecure_channel(model.address)
        disconnected = model_pb2_grpc.ModelServiceStub(own_channel).Generate(
            request(prompt(11, 40), LONG), timeout=3 * GENEROUS_S)
        for call in (cancelled, disconnected):
            for _, _ in zip(range(3), call):
                pass
        wait_for(sequences_are(2), GENEROUS_S, "the background sequences and the two victims")
        cancelled.cancel()
        own_channel.close()
        wait_for(sequences_are(0), GENEROUS_S, "the cancelled and disconnected requests' blocks")

        deadline_after_first_token(stub, request(prompt(12, 40), LONG), lambda: wait_for(
            sequences_are(0), GENEROUS_S, "the blocks of the request past its deadline"))

        # The others kept streaming, undisturbed, until they were aborted (or, on a fast
        # machine, finished): waiting for LONG tokens each would only measure the machine.
        counts = [len(s.tokens) for s in background]
        wait_for(lambda: all(s.done.is_set() or len(s.tokens) > n + 16 for s, n in zip(background, counts)),
                 GENEROUS_S, "the background streams to keep streaming")
        stub.Abort(model_pb2.AbortRequest(request_ids=[f"background-{i}" for i in range(3)]), timeout=GENEROUS_S)
        wait_ended(background, GENEROUS_S)
        for stream in background:
            assert stream.code == grpc.StatusCode.OK, (stream.code, stream.details)
            assert (stream.last.finish_reason == model_pb2.FINISH_REASON_ABORT
                    or stream.last.finish_reason == model_pb2.FINISH_REASON_LENGTH and len(stream.tokens) == LONG)
        wait_for(lambda: (lambda s: s.blocks_leased == 0 and s.sequences == 0)(stats(cache_rpc)), GENEROUS_S,
                 "every block to be released")


def test_sigterm_ends_streams_releases_leases_and_exits_zero(tmp_path):
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    cache_args = (*POOL_ARGS, "--lease-ttl-ms", LEASE_TTL_MS, "--shm-dir", shm_dir)
    cache, model = start_both(tmp_path, cache_args, ("--grace-s", "1"))
    with cache:
        cache_rpc = cache_stub(cache.address)
        streams = start_streams(model_stub(model.address), 8)
        # Exit 0 (not a SIGKILL after the timeout): it stopped by itself, after its 1 s grace.
        assert model.stop(signal.SIGTERM, timeout=GENEROUS_S) == 0
        wait_ended(streams, GENEROUS_S)
        for stream in streams:
            assert stream.code in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE), (stream.code, stream.details)
        cache_stats = stats(cache_rpc)
        assert (cache_stats.blocks_leased, cache_stats.sequences, cache_stats.sessions) == (0, 0, 0)

        # Now SIGTERM the cache service under a model service with streams in flight.
        with start_model_service(tmp_path, cache.address) as model:
            streams = start_streams(model_stub(model.address), 8, timeout_s=3 * GENEROUS_S)
            assert len(pool_files(shm_dir)) == 1
            assert cache.stop(signal.SIGTERM, timeout=GENEROUS_S) == 0
            assert pool_files(shm_dir) == [], "SIGTERM left the pool file behind"
            wait_ended(streams, GENEROUS_S)
            assert {s.code for s in streams} == {grpc.StatusCode.UNAVAILABLE}, {(s.code, s.details) for s in streams}
            wait_for(lambda: health(model.address) == "NOT_SERVING", GENEROUS_S,
                     "the model service to report NOT_SERVING")
            # And a model service with no cache service still stops by itself, cleanly.
            assert model.stop(signal.SIGTERM, timeout=GENEROUS_S) == 0


def test_a_model_service_that_cannot_map_the_pool_detaches_and_exits(tmp_path):
    # What a model container sees after the cache container restarts: Attach succeeds, but
    # the new pool file is in a /dev/shm it does not share. Here the file is unlinked after
    # a first model service made the cache service create it.
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    cache, first = start_both(tmp_path, (*POOL_ARGS, "--shm-dir", shm_dir))
    with cache:
        assert first.stop() == 0, first.logs()
        [pool_file] = pool_files(shm_dir)
        (shm_dir / pool_file).unlink()
        model = start_model_service(tmp_path, cache.address, wait_serving=False)
        try:
            code = model.process.wait(timeout=DEFAULT_TIMEOUT_S)
        finally:
            model.kill()
        assert code == 1, model.logs()
        events = {event["event"]: event for event in model.log_events()}
        assert "does not exist here" in events["pool_unmappable_detached"]["error"], model.logs()
        cache_rpc = cache_stub(cache.address)
        assert stats(cache_rpc).sessions == 0, "the session was left to expire at its TTL"
    assert cache.returncode == 0, cache.logs()


def test_a_request_past_the_session_block_quota_ends_alone(tmp_path):
    """--max-session-blocks is the session's quota, not a lost lease: the request that alone
    needs more ends with RESOURCE_EXHAUSTED naming the limit, a bystander finishes, and the
    engine stays attached (the same session serves the next request)."""
    cache, model = start_both(tmp_path, (*POOL_ARGS, "--block-size", "16", "--max-session-blocks", "8"),
                              ("--lease-ahead-blocks", "0"))
    with cache, model:
        cache_rpc = cache_stub(cache.address)
        stub = model_stub(model.address)
        sessions_before = stats(cache_rpc).sessions
        greedy = Stream(stub, prompt(20, 100), max_new_tokens=100)  # 200 tokens: 13 blocks, past 8
        bystander = Stream(stub, prompt(21, 20), max_new_tokens=30)  # 50 tokens: 4 blocks
        wait_ended([greedy, bystander], GENEROUS_S)
        assert greedy.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "LIMIT_EXCEEDED" in greedy.details, (
            greedy.code, greedy.details)
        assert bystander.code == grpc.StatusCode.OK and len(bystander.tokens) == 30, (bystander.code, bystander.details)
        last = generate(stub, prompt(22, 10), 4)
        assert last.usage.completion_tokens == 4
        wait_for(lambda: stats(cache_rpc).blocks_leased == 0, GENEROUS_S, "every block back")
        assert stats(cache_rpc).sessions == sessions_before == 1  # never detached and re-attached
