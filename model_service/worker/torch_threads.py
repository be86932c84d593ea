"""One OpenMP thread pool in the model service, the engine thread's, not one per thread;
and every thread that launches device work on the model's CUDA device.

libgomp (torch's OpenMP, which the C kernels share) keeps a pool of worker threads for
every thread that has started a parallel region, for as long as that thread lives. Once
the workers of all pools outnumber the CPUs, it switches every pool to "throttled"
waiting: between parallel regions a worker spins about 100 times, then sleeps on a futex
until the next region wakes it. Loading the model and measuring the warmup in the main
thread, then stepping in the engine thread, made two pools of 2 on 2 cores, and a decode
step (about 500 regions: every linear and every kernel call) paid a sleep and a wake-up
for each: many times the voluntary context switches of one pool in a W48 run of SmolLM2,
and the engine short of its 2 threads' CPU (docs/benchmark-log.md, "One OpenMP pool").

So the start-up work that runs parallel torch ops goes through `run_in_passing_thread`:
a thread that exits when the work is done, taking its pool with it; the engine thread's
pool is then the only one.

The current CUDA device is per thread too (torch.cuda.set_device sets the calling
thread's), and Triton launches, torch.cuda.current_stream() and graph capture use the
current device, not their tensors': a thread left on cuda:0 while the model is on cuda:1
launches kernels on cuda:0 with pointers into cuda:1. So every thread that touches the
device calls `use_device` first; `run_in_passing_thread` passes on its caller's.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import torch

T = TypeVar("T")


def use_device(device: torch.device | int | None) -> None:
    """Makes `device` the calling thread's current CUDA device (a CUDA device or index;
    nothing for CPU or None)."""
    if isinstance(device, int) or (device is not None and device.type == "cuda"):
        torch.cuda.set_device(device)


def current_cuda_device() -> int | None:
    """The calling thread's current CUDA device, or None when CUDA was never started in
    this process (then no thread has a device to pass on)."""
    return torch.cuda.current_device() if torch.cuda.is_initialized() else None


def run_in_passing_thread(work: Callable[[], T]) -> T:
    """work() in a new thread that ends afterwards (its OpenMP pool ends with it), at the
    calling thread's torch thread count and CUDA device; returns its result or raises
    its exception."""
    threads = torch.get_num_threads()
    device = current_cuda_device()

    def run() -> T:
        torch.set_num_threads(threads)
        use_device(device)
        return work()

    # Leaving the `with` joins the executor's one thread, so it has exited on return.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="startup-compute") as executor:
        return executor.submit(run).result()
