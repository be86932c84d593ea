"""The physical KV pool: one tensor that the cache service allocates and the model service maps.

CPU: a file in /dev/shm (shm_file.py). CUDA: a CUDA IPC handle (cuda_ipc.py). Either
travels to the model service as a PoolHandle in AttachResponse (handles.py). The cache
service calls `create_shared_pool` / `export_cuda_pool` and `handle_to_proto`; the model
service calls `map_pool`.
"""

from pagedkv.pool_memory.cuda_ipc import CudaIpcInfo, export_cuda_pool, import_cuda_pool
from pagedkv.pool_memory.errors import PoolMappingError
from pagedkv.pool_memory.handles import (
    cuda_handle_to_proto,
    cuda_info_from_proto,
    handle_to_proto,
    map_pool,
    shared_handle_to_proto,
)
from pagedkv.pool_memory.shm_file import (
    DEFAULT_SHM_DIRECTORY,
    SharedPool,
    SharedPoolHandle,
    cleanup_stale_pools,
    create_shared_pool,
)

__all__ = [
    "DEFAULT_SHM_DIRECTORY", "CudaIpcInfo", "PoolMappingError", "SharedPool", "SharedPoolHandle",
    "cleanup_stale_pools", "create_shared_pool", "cuda_handle_to_proto", "cuda_info_from_proto",
    "export_cuda_pool", "handle_to_proto", "import_cuda_pool", "map_pool", "shared_handle_to_proto",
]
