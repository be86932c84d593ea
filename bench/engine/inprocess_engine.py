"""The engine in this process, against a real cache service process, driven as a client
drives the model service: submit requests, collect their tokens, wait for every one to
end. For benchmarks that leave the gRPC server and its streams out (bench/serve/bench_vs_vllm.py
--pagedkv-path engine, engine_breakdown.py).
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from pathlib import Path

import torch
from harness.processes import start_cache_service
from prometheus_client import REGISTRY

from model_service.cache.client import CacheClient
from model_service.engine.loop import Engine
from model_service.engine.settings import EngineSettings
from model_service.loading.loader import load_model
from model_service.sample.params import SamplingOptions
from model_service.worker.torch_threads import run_in_passing_thread

LEASE_WAIT, ENGINE_STEP = "pagedkv_model_lease_wait_seconds_total", "pagedkv_model_engine_step_seconds_total"


def load_in_passing_thread(model_dir: Path, dtype: torch.dtype, weights: str = "dequantize"):
    """As the model service loads: no OpenMP pool left behind in this thread (torch_threads.py).
    `weights`: load_model's (a GGUF file's linears dequantized, or held in their blocks)."""
    return run_in_passing_thread(lambda: load_model(str(model_dir), dtype, "cpu", weights=weights))


@contextlib.contextmanager
def engine_in_process(loaded, dtype: torch.dtype, tmp: Path, max_model_len: int = 1024, **settings):
    """Yields run(requests, concurrency=None) -> {"tokens", "seconds", "outputs",
    "lease_wait_share", "times"}, each request a (prompt token ids, max_new_tokens) pair,
    greedy with eos ignored; all submitted at once, or `concurrency` at a time (the next
    when one ends, as `vllm bench serve --max-concurrency` sends them). times: for each
    request its submit time, then when each of its deltas came (perf_counter seconds).
    `settings`: EngineSettings fields beyond the defaults."""
    with start_cache_service(tmp, "--kv-cache-bytes", "2GiB") as cache:
        settings = EngineSettings(**{"max_model_len": max_model_len, "max_batch_tokens": 2048, "max_num_seqs": 64,
                                     **settings})
        engine = Engine(loaded, settings, CacheClient(cache.address), torch.device("cpu"), dtype)
        engine.start()
        if not engine.connected.wait(30):
            raise SystemExit("the engine did not attach to the cache service")
        request_ids = itertools.count()

        def run(requests, concurrency: int | None = None) -> dict:
            finished = threading.Semaphore(0)
            outputs: list[list[int]] = [[] for _ in requests]
            times: list[list[float]] = [[] for _ in requests]

            def sink_for(tokens: list[int], stamps: list[float]):
                def sink(delta) -> None:
                    if delta.token_ids:
                        stamps.append(time.perf_counter())
                    tokens.extend(delta.token_ids)
                    if delta.finish is not None or delta.error is not None:
                        finished.release()
                return sink

            def submit(index: int) -> None:
                prompt, max_new = requests[index]
                times[index].append(time.perf_counter())
                engine.submit(f"bench-{next(request_ids)}", prompt,
                              SamplingOptions(max_new_tokens=max_new, ignore_eos=True, detokenize=False),
                              sink_for(outputs[index], times[index]))

            wait_before, step_before = REGISTRY.get_sample_value(LEASE_WAIT), REGISTRY.get_sample_value(ENGINE_STEP)
            started = time.perf_counter()
            first = len(requests) if concurrency is None else min(concurrency, len(requests))
            for index in range(first):
                submit(index)
            for index in range(len(requests)):
                finished.acquire()
                if first + index < len(requests):
                    submit(first + index)
            seconds = time.perf_counter() - started
            step = REGISTRY.get_sample_value(ENGINE_STEP) - step_before
            wait = REGISTRY.get_sample_value(LEASE_WAIT) - wait_before
            return {"tokens": sum(len(t) for t in outputs), "seconds": seconds, "outputs": outputs,
                    "lease_wait_share": wait / step if step else 0.0, "times": times}

        run.engine = engine  # for a bench that changes the scheduler between runs (engine_itl.py)
        try:
            yield run
        finally:
            engine.stop(5)
