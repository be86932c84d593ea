"""The CUDA tiers' block copies, in order, in one thread of their own; Lease calls await them.

Every copy between the device pool and host memory (a demotion's, a promotion's) runs
here, one after another in the order submitted: a promotion reading a host slot is
done before a later demotion, which may have pushed that slot's entry out, overwrites
it. A Lease call replies only after the promotions submitted so far are done
(``settled``), so the model service never reads a block before its bytes are in; as
copies finish in order, waiting for the last promotion covers every earlier one,
including another call's promotion of a block this call hit in the pool meanwhile. No
Lease call waits for a demotion. The event loop never waits on the device: it awaits
the copy's future.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch


class CopyQueue:
    def __init__(self, device: torch.device) -> None:
        # The current CUDA device is per thread: the copy thread's is the pool's (cuda:N too).
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tiers-copy",
                                          initializer=torch.cuda.set_device, initargs=(device,))
        self._promotion: Future | None = None  # the last promotion submitted

    def submit(self, copy: Callable, *args) -> Future:
        """A demotion's copy, after every copy submitted before it."""
        return self._thread.submit(copy, *args)

    def promote(self, copy: Callable, *args) -> None:
        """A promotion's copy, which Lease calls wait for (``settled``)."""
        self._promotion = self._thread.submit(copy, *args)

    async def settled(self) -> None:
        """Returns once every promotion submitted so far is done; at once (no await) if they are."""
        last = self._promotion
        if last is None:
            return
        if not last.done():
            await asyncio.wrap_future(last)  # a failed copy fails the calls waiting on it
        elif last.exception() is not None:
            self._promotion = None  # one call reports it; later ones wait for later copies
            last.result()

    def settle(self) -> None:
        """``settled`` for a caller without an event loop (it blocks)."""
        last, self._promotion = self._promotion, None
        if last is not None:
            last.result()

    def close(self) -> None:
        """Waits for the copies in flight (their memory must stay pinned until then)."""
        self._thread.shutdown(wait=True, cancel_futures=False)
