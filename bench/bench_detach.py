"""How long detaching a session of the largest allowed size holds up the event loop.

    PYTHONPATH=. python bench/bench_detach.py

A session of 16,384 sequences (the default --max-session-sequences) forked from one
parent of 256 blocks holds 4,194,304 block-table entries (the default
--max-session-blocks). While KvPool.detach releases it, a ticker coroutine measures the
longest gap between its turns: the most any other RPC waits behind the detach.
"""

from __future__ import annotations

import asyncio
import tempfile
import time

import torch

from cache_service.core.pool import KvPool, PoolSettings
from pagedkv.kv_geometry import KvGeometry

GEOMETRY = KvGeometry(num_layers=1, num_kv_heads=1, head_dim=4, dtype=torch.float32, device="cpu")


async def main() -> None:
    with tempfile.TemporaryDirectory() as shm_dir:
        pool = KvPool(PoolSettings(block_size=16, kv_cache_bytes=64 << 20, max_blocks=4096, shm_dir=shm_dir))
        session = pool.attach("huge", GEOMETRY, 0, 0).session
        parent = pool.ledger.allocate(session.owner, 256 * 16)
        for _ in range(16383):
            pool.ledger.fork(session.owner, parent.sequence_id)
        gaps: list[float] = []
        done = asyncio.Event()

        async def ticker() -> None:
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0)
                now = time.perf_counter()
                gaps.append(now - last)
                last = now

        task = asyncio.create_task(ticker())
        await asyncio.sleep(0)
        started = time.perf_counter()
        released = await pool.detach(session.session_id)
        total = time.perf_counter() - started
        done.set()
        await task
        pool.close()
        print(f"released {released:,} block references in {total * 1000:.0f} ms; "
              f"longest event-loop stall {max(gaps) * 1000:.2f} ms over {len(gaps)} turns")


if __name__ == "__main__":
    asyncio.run(main())
