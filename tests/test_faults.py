"""Faults: real processes killed (-9), terminated (SIGTERM) and abandoned by their clients.

Every test starts the cache and model services as real processes, puts streams in
flight, breaks something, and then checks what the contract promises: streams end with
a status instead of hanging, health says what is true, and GetStats shows no block that
no live sequence holds. Waits poll (wait_for); nothing sleeps and hopes.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

import grpc
import pytest
from cache_helpers import cache_stub, stats, wait_for
from processes import (DEFAULT_TIMEOUT_S, ServiceProcess, _test_env, free_port, start_cache_service,
                       start_model_service)

from pagedkv.cache.v1 import cache_pb2
from pagedkv.health_probe import check as health_check
from pagedkv.model.v1 import model_pb2, model_pb2_grpc

POOL_ARGS = ("--kv-cache-bytes", "16MiB")  # ~1900 blocks of the tiny model: nothing is preempted here
LEASE_TTL_MS = 1000
# Long enough that no stream finishes before the fault: the tiny model's max_model_len is 2048.
LONG = 1900

# Each test starts two or three services (~5 s of torch import each); a hang fails fast.
pytestmark = pytest.mark.timeout(120)


def prompt(seed: int, length: int) -> list[int]:
    return [4 + (seed * 31 + i * 7) % 250 for i in range(length)]


def request(tokens: list[int], max_new_tokens: int) -> model_pb2.GenerateRequest:
    return model_pb2.GenerateRequest(
        prompt_token_ids=tokens,
        sampling=model_pb2.SamplingParams(max_new_tokens=max_new_tokens, temperature=0, ignore_eos=True),
    )


class Stream:
    """One Generate stream read on its own thread; records tokens, the last message and the status."""

    def __init__(self, stub, tokens: list[int], max_new_tokens: int = LONG, timeout_s: float = 60.0) -> None:
        self.tokens: list[int] = []
        self.last: model_pb2.GenerateResponse | None = None
        self.code: grpc.StatusCode | None = None  # OK once the stream finished normally
        self.details = ""
        self.first_token = threading.Event()
        self.done = threading.Event()
        self.started = threading.Event()  # a first token, or the end
        self.ended_at = 0.0
        self.call = stub.Generate(request(tokens, max_new_tokens), timeout=timeout_s)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for response in self.call:
                self.tokens.extend(response.token_ids)
                self.last = response
                self.first_token.set()
                self.started.set()
            self.code = grpc.StatusCode.OK
        except grpc.RpcError as error:
            self.code, self.details = error.code(), error.details()
        finally:
            self.ended_at = time.monotonic()
            self.done.set()
            self.started.set()


def start_streams(stub, count: int, **kwargs) -> list[Stream]:
    streams = [Stream(stub, prompt(seed, 8 + seed % 24), **kwargs) for seed in range(count)]
    deadline = time.monotonic() + 30
    for stream in streams:
        assert stream.started.wait(max(0.0, deadline - time.monotonic())), "a stream got no token within 30 s"
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
    last = None
    for response in stub.Generate(request(tokens, max_new_tokens), timeout=30):
        last = response
    return last


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
    cache, model = start_both(tmp_path, (*POOL_ARGS, "--lease-ttl-ms", LEASE_TTL_MS, "--shm-dir", shm_dir))
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
        killed_at = time.monotonic()

        # The cache service learns of the death only from the missing heartbeats: within a
        # TTL plus one reaper interval (TTL / 4), every lease of the dead session is back.
        wait_for(lambda: (lambda s: s.blocks_leased == 0 and s.sessions == 0)(stats(cache_rpc)),
                 timeout_s=10, what="the dead model service's leases to be reclaimed", poll_s=0.02)
        reclaimed_after = time.monotonic() - killed_at
        assert reclaimed_after < (LEASE_TTL_MS * 1.25 + 750) / 1000, f"leases came back after {reclaimed_after:.2f} s"
        wait_ended(streams, 10)
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
            wait_for(lambda: stats(cache_rpc).blocks_leased == 0, 5, "the restarted service's blocks to be released")
        assert restarted.returncode == 0


def test_kill9_cache_service_fails_streams_then_the_model_service_reattaches(tmp_path):
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    cache_args = (*POOL_ARGS, "--lease-ttl-ms", LEASE_TTL_MS, "--shm-dir", shm_dir)
    cache, model = start_both(tmp_path, cache_args)
    with model:
        stub = model_stub(model.address)
        streams = start_streams(stub, 16, timeout_s=30)
        [dead_pool_file] = pool_files(shm_dir)
        cache.kill()
        killed_at = time.monotonic()

        # Every stream ends with UNAVAILABLE, long before its 30 s deadline.
        wait_ended(streams, 10)
        assert {s.code for s in streams} == {grpc.StatusCode.UNAVAILABLE}, {(s.code, s.details) for s in streams}
        assert max(s.ended_at for s in streams) - killed_at < 5
        wait_for(lambda: health(model.address) == "NOT_SERVING", 5, "the model service to report NOT_SERVING")
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
            # so re-attach follows within seconds, not gRPC's default of up to 120 s.
            wait_for(lambda: health(model.address) == "SERVING", 5, "the model service to re-attach", poll_s=0.1)
            [new_pool_file] = pool_files(shm_dir)
            assert f"pagedkv-{cache_again.pid}-" in new_pool_file
            last = generate(stub, prompt(2, 20), 8)
            assert last.finish_reason == model_pb2.FINISH_REASON_LENGTH and last.usage.completion_tokens == 8
            cache_rpc = cache_stub(cache_again.address)
            wait_for(lambda: stats(cache_rpc).blocks_leased == 0, 5, "every block to be released")
            assert stats(cache_rpc).sessions == 1
    assert model.returncode == 0


def test_cancel_disconnect_and_deadline_release_blocks_at_once(tmp_path):
    cache, model = start_both(tmp_path, POOL_ARGS)
    with cache, model:
        cache_rpc = cache_stub(cache.address)
        stub = model_stub(model.address)
        background = start_streams(stub, 3)

        cancelled = stub.Generate(request(prompt(10, 40), LONG), timeout=60)
        own_channel = grpc.insecure_channel(model.address)
        disconnected = model_pb2_grpc.ModelServiceStub(own_channel).Generate(request(prompt(11, 40), LONG), timeout=60)
        for call in (cancelled, disconnected):
            for _, _ in zip(range(3), call):
                pass
        past_deadline = Stream(stub, prompt(12, 40), timeout_s=2)
        assert past_deadline.first_token.wait(2), (past_deadline.code, past_deadline.details)

        def running_background() -> int:  # on a fast machine one may finish during the test
            return sum(not s.done.is_set() for s in background)

        def sequences_are(victims: int):
            return lambda: stats(cache_rpc).sequences == victims + running_background()

        wait_for(sequences_are(3), 2, "six sequences: three background, three victims")
        cancelled.cancel()
        own_channel.close()
        wait_for(sequences_are(1), 2, "the cancelled and disconnected requests' blocks")
        assert past_deadline.done.wait(10)
        assert past_deadline.code == grpc.StatusCode.DEADLINE_EXCEEDED, (past_deadline.code, past_deadline.details)
        wait_for(sequences_are(0), 2, "the blocks of the request past its deadline")

        # The others kept streaming, undisturbed, to their full length.
        counts = [len(s.tokens) for s in background]
        wait_for(lambda: all(s.done.is_set() or len(s.tokens) > n for s, n in zip(background, counts)), 5,
                 "the background streams to keep streaming")
        wait_ended(background, 60)
        assert all(s.code == grpc.StatusCode.OK and len(s.tokens) == LONG for s in background)
        wait_for(lambda: (lambda s: s.blocks_leased == 0 and s.sequences == 0)(stats(cache_rpc)), 5,
                 "every block to be released")


def test_sigterm_ends_streams_releases_leases_and_exits_zero(tmp_path):
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    # A TTL far beyond the test: leases that come back came back by Detach, not by expiry.
    cache_args = (*POOL_ARGS, "--lease-ttl-ms", 600_000, "--shm-dir", shm_dir)
    cache, model = start_both(tmp_path, cache_args, ("--grace-s", "1"))
    with cache:
        cache_rpc = cache_stub(cache.address)
        streams = start_streams(model_stub(model.address), 8)
        stopping_at = time.monotonic()
        assert model.stop(signal.SIGTERM, timeout=15) == 0
        assert time.monotonic() - stopping_at < 15
        wait_ended(streams, 1)
        for stream in streams:
            assert stream.code in (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE), (stream.code, stream.details)
        cache_stats = stats(cache_rpc)
        assert (cache_stats.blocks_leased, cache_stats.sequences, cache_stats.sessions) == (0, 0, 0)

        # Now SIGTERM the cache service under a model service with streams in flight.
        with start_model_service(tmp_path, cache.address) as model:
            streams = start_streams(model_stub(model.address), 8, timeout_s=30)
            assert len(pool_files(shm_dir)) == 1
            stopping_at = time.monotonic()
            assert cache.stop(signal.SIGTERM, timeout=15) == 0
            assert time.monotonic() - stopping_at < 15
            assert pool_files(shm_dir) == [], "SIGTERM left the pool file behind"
            wait_ended(streams, 10)
            assert {s.code for s in streams} == {grpc.StatusCode.UNAVAILABLE}, {(s.code, s.details) for s in streams}
            wait_for(lambda: health(model.address) == "NOT_SERVING", 5, "the model service to report NOT_SERVING")
            # And a model service with no cache service still stops promptly and cleanly.
            stopping_at = time.monotonic()
            assert model.stop(signal.SIGTERM, timeout=15) == 0
            assert time.monotonic() - stopping_at < 15


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
