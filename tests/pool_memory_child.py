"""Second process for tests/test_pool_memory.py: maps a pool from a PoolHandle, checks
what the parent wrote, writes its own mark, and prints "ok".

    python tests/pool_memory_child.py <PoolHandle as hex> <expected value> <value to write>
"""

import sys

import torch

from pagedkv.cache.v1 import cache_pb2
from pagedkv.pool_memory import map_pool


def main(handle_hex: str, expected: str, to_write: str) -> int:
    handle = cache_pb2.PoolHandle.FromString(bytes.fromhex(handle_hex))
    pool = map_pool(handle)
    if tuple(pool.shape) != tuple(handle.shape):
        print(f"shape {tuple(pool.shape)} != {tuple(handle.shape)}")
        return 1
    if not torch.all(pool[0, 0] == float(expected)):
        print(f"pool[0, 0] is not {expected}")
        return 1
    pool[-1, 1, -1] = float(to_write)
    if pool.is_cuda:
        torch.cuda.synchronize()
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
