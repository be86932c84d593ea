"""The physical pool: a /dev/shm file shared with a second process, and CUDA IPC field mapping."""

import errno
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import structlog
import structlog.testing
import torch
import torch.multiprocessing.reductions as reductions

from pagedkv import pool_memory
from pagedkv.cache.v1 import cache_pb2
from pagedkv.pool_memory import (
    CudaIpcInfo,
    PoolMappingError,
    SharedPoolHandle,
    cleanup_stale_pools,
    create_shared_pool,
    export_cuda_pool,
    cuda_info_from_proto,
    handle_to_proto,
    import_cuda_pool,
    map_pool,
)

REPO = Path(__file__).resolve().parents[1]
CHILD = REPO / "tests" / "pool_memory_child.py"
SHAPE = (2, 2, 3, 4, 2, 8)  # [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]


@pytest.fixture
def shm_dir():
    """A private folder in /dev/shm (tmpfs, as in production), or a temp dir where there is none."""
    parent = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    directory = tempfile.mkdtemp(prefix="pagedkv-test-", dir=parent)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


def test_create_shared_pool(shm_dir):
    with create_shared_pool(SHAPE, torch.bfloat16, directory=shm_dir) as pool:
        handle = pool.handle
        name = os.path.basename(handle.path)
        assert name.startswith(f"pagedkv-{os.getpid()}-") and name.endswith(".kv")
        assert os.path.dirname(handle.path) == shm_dir
        assert stat.S_IMODE(os.stat(handle.path).st_mode) == 0o600
        numel = 2 * 2 * 3 * 4 * 2 * 8
        assert handle.size_bytes == numel * 2 == os.path.getsize(handle.path)
        assert (handle.shape, handle.dtype, handle.device) == (SHAPE, torch.bfloat16, "cpu")
        assert pool.tensor.shape == SHAPE and pool.tensor.dtype == torch.bfloat16
        assert torch.count_nonzero(pool.tensor) == 0
    assert pool.closed and not os.path.exists(handle.path)


def test_close_unlinks_once_and_the_mapping_survives(shm_dir):
    pool = create_shared_pool(SHAPE, torch.float32, directory=shm_dir)
    pool.tensor.fill_(3.0)
    pool.close()
    assert not os.path.exists(pool.handle.path)
    pool.close()  # idempotent
    assert torch.all(pool.tensor == 3.0)


def test_a_second_process_maps_the_pool(shm_dir):
    pool = create_shared_pool(SHAPE, torch.float32, directory=shm_dir)
    try:
        pool.tensor.fill_(1.5)
        handle = handle_to_proto(pool.handle)
        assert handle.WhichOneof("memory") == "shared_memory"
        assert list(handle.shape) == list(SHAPE) and handle.dtype == cache_pb2.DTYPE_FLOAT32
        child = subprocess.run(
            [sys.executable, str(CHILD), handle.SerializeToString().hex(), "1.5", "7.0"],
            capture_output=True, text=True, timeout=120, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        assert child.returncode == 0 and child.stdout.strip() == "ok", child.stdout + child.stderr
        assert torch.all(pool.tensor[-1, 1, -1] == 7.0)
        assert torch.all(pool.tensor[0] == 1.5)
    finally:
        pool.close()


def test_map_pool_in_process_shares_memory(shm_dir):
    with create_shared_pool(SHAPE, torch.float16, directory=shm_dir) as pool:
        mapped = map_pool(handle_to_proto(pool.handle))
        assert mapped.shape == SHAPE and mapped.dtype == torch.float16
        mapped[1, 0, 2] = 5.0
        assert torch.all(pool.tensor[1, 0, 2] == 5.0)


def test_a_cuda_ipc_handle_survives_the_proto():
    # Field by field, without a GPU: what the cache service sends is what the model service imports.
    info = CudaIpcInfo(device_index=1, storage_handle=b"storage", storage_size_bytes=4096, storage_offset_bytes=64,
                       ref_counter_handle=b"refs", ref_counter_offset=3, event_handle=b"event",
                       event_sync_required=True, shape=SHAPE, stride=(384, 192, 64, 16, 8, 1), storage_offset=5,
                       dtype=torch.float16)
    sent = cache_pb2.PoolHandle.FromString(handle_to_proto(info).SerializeToString())
    assert cuda_info_from_proto(sent) == info


def test_map_pool_missing_file_says_to_share_dev_shm(shm_dir):
    pool = create_shared_pool(SHAPE, torch.float32, directory=shm_dir)
    handle = handle_to_proto(pool.handle)
    pool.close()
    with pytest.raises(PoolMappingError, match="does not exist here.*must share"):
        map_pool(handle)
    assert not os.path.exists(pool.handle.path)  # and torch.from_file did not create it


def test_map_pool_wrong_file_size(shm_dir):
    with create_shared_pool(SHAPE, torch.float32, directory=shm_dir) as pool:
        os.truncate(pool.handle.path, pool.handle.size_bytes // 2)
        with pytest.raises(PoolMappingError, match="holds .* bytes, the handle says"):
            map_pool(handle_to_proto(pool.handle))


def test_map_pool_not_accessible(shm_dir):
    if os.geteuid() == 0:
        pytest.skip("root opens files whatever their mode")
    with create_shared_pool(SHAPE, torch.float32, directory=shm_dir) as pool:
        os.chmod(pool.handle.path, 0)
        with pytest.raises(PoolMappingError, match="same user"):
            map_pool(handle_to_proto(pool.handle))


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"size_bytes": 12}, ValueError, "pool handle says 12 bytes"),
        ({"dtype": cache_pb2.DTYPE_UNSPECIFIED}, ValueError, "DTYPE_UNSPECIFIED"),
        ({"shape": [2, 0, 3]}, ValueError, "positive"),
        ({"memory": None}, ValueError, "neither shared_memory nor cuda_ipc"),
    ],
)
def test_map_pool_rejects_malformed_handles(change, error, message):
    values = {"shape": list(SHAPE), "dtype": cache_pb2.DTYPE_FLOAT32, "size_bytes": 768 * 4, "memory": "shared"}
    values.update(change)
    handle = cache_pb2.PoolHandle(shape=values["shape"], dtype=values["dtype"], device="cpu")
    if values["memory"]:
        handle.shared_memory.path = "/dev/shm/pagedkv-1-0.kv"
        handle.shared_memory.size_bytes = values["size_bytes"]
    with pytest.raises(error, match=message):
        map_pool(handle)


def test_create_rejects_bad_shapes_and_dtypes(shm_dir):
    with pytest.raises(ValueError, match="positive"):
        create_shared_pool((2, 0, 3), torch.float32, directory=shm_dir)
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        create_shared_pool(SHAPE, torch.int64, directory=shm_dir)
    assert os.listdir(shm_dir) == []


def test_too_small_shm_is_a_clear_error_and_leaves_no_file(shm_dir, monkeypatch):
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(PoolMappingError, match="free but the KV pool needs.*shm_size"):
        create_shared_pool(SHAPE, torch.float32, directory=shm_dir)
    assert os.listdir(shm_dir) == []


def test_a_cleaner_running_while_a_pool_is_created_never_removes_it(shm_dir, monkeypatch):
    # Another cache service's start-up cleanup may run at any moment, also between this
    # one's creating the file and locking it: the pool's name must never be seen unlocked.
    real_open = os.open

    def open_then_clean(path, flags, *args):
        fd = real_open(path, flags, *args)
        if flags & os.O_CREAT:
            assert cleanup_stale_pools(shm_dir) == []
        return fd

    monkeypatch.setattr(os, "open", open_then_clean)
    with create_shared_pool(SHAPE, torch.float32, directory=shm_dir) as pool:
        monkeypatch.setattr(os, "open", real_open)
        assert os.listdir(shm_dir) == [os.path.basename(pool.handle.path)]
        assert cleanup_stale_pools(shm_dir) == []
        assert os.path.exists(pool.handle.path)


def test_a_creation_left_half_done_is_removed_once_old(shm_dir):
    fresh = os.path.join(shm_dir, ".pagedkv-1-00.kv.creating")
    old = os.path.join(shm_dir, ".pagedkv-2-00.kv.creating")
    for path in (fresh, old):
        Path(path).write_bytes(b"")
    os.utime(old, (1, 1))
    assert cleanup_stale_pools(shm_dir) == [old]
    assert os.path.exists(fresh)


def _pool_in_a_dead_process(shm_dir: str) -> str:
    """A pool file whose creator died without closing it (kill -9): its flock is gone."""
    code = (
        "import os, sys, torch\n"
        "from pagedkv.pool_memory import create_shared_pool\n"
        "pool = create_shared_pool((2, 2), torch.float32, directory=sys.argv[1])\n"
        "print(pool.handle.path, flush=True)\n"
        "os._exit(0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code, shm_dir], capture_output=True, text=True, check=True, cwd=REPO)
    return done.stdout.strip()


def test_cleanup_removes_only_files_no_live_service_holds(shm_dir):
    dead = _pool_in_a_dead_process(shm_dir)
    # A predecessor that had this very pid (common in containers): the pid is alive, but
    # nobody holds the file's lock, so it is stale.
    same_pid = os.path.join(shm_dir, f"pagedkv-{os.getpid()}-0123abcd.kv")
    Path(same_pid).write_bytes(b"x")
    live = create_shared_pool(SHAPE, torch.float32, directory=shm_dir)
    # A live pool of a service in another PID namespace: its name carries a pid that
    # means nothing here, but its lock is held.
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, os, sys, time\n"
         "fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)\n"
         "fcntl.flock(fd, fcntl.LOCK_EX)\n"
         "print('locked', flush=True)\n"
         "time.sleep(60)\n",
         os.path.join(shm_dir, "pagedkv-1-feedface.kv")],
        stdout=subprocess.PIPE, text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert sorted(cleanup_stale_pools(shm_dir)) == sorted([dead, same_pid])
        assert sorted(os.listdir(shm_dir)) == sorted([os.path.basename(live.handle.path), "pagedkv-1-feedface.kv"])
        assert cleanup_stale_pools(shm_dir) == []
        assert cleanup_stale_pools(os.path.join(shm_dir, "missing")) == []
        assert torch.count_nonzero(live.tensor) == 0  # still mapped and usable
    finally:
        holder.kill()
        holder.wait()
        live.close()
    # Closed: its lock is dropped with its file.
    assert not os.path.exists(live.handle.path)


def _hostile_files(shm_dir: str) -> dict[str, str]:
    """Files anyone can put in /dev/shm under names a pool could have; returns name -> what it is."""
    directory = Path(shm_dir)
    (directory / "pagedkv-999999999999999999999999-0.kv").write_bytes(b"x")  # os.kill: OverflowError
    (directory / "pagedkv-notapid-0.kv").write_bytes(b"x")
    (directory / "pagedkv-dir.kv").mkdir()
    target = directory / "precious"
    target.write_bytes(b"keep me")
    (directory / "pagedkv-link.kv").symlink_to(target)
    os.mkfifo(directory / "pagedkv-fifo.kv")
    foreign = directory / "pagedkv-7-foreign.kv"
    foreign.write_bytes(b"x")
    if os.geteuid() == 0:
        os.chown(foreign, 65534, 65534)  # another user's file
    else:
        foreign.chmod(0)  # unreadable
    (directory / "unrelated.kv").write_bytes(b"x")
    return {
        "pagedkv-999999999999999999999999-0.kv": "stale", "pagedkv-notapid-0.kv": "stale",
        "pagedkv-dir.kv": "kept", "pagedkv-link.kv": "kept", "pagedkv-fifo.kv": "kept",
        "pagedkv-7-foreign.kv": "kept", "unrelated.kv": "kept", "precious": "kept",
    }


def test_cleanup_skips_hostile_files_with_a_warning(shm_dir):
    files = _hostile_files(shm_dir)
    with structlog.testing.capture_logs() as logs:
        removed = cleanup_stale_pools(shm_dir)
    assert sorted(os.path.basename(path) for path in removed) == sorted(
        name for name, fate in files.items() if fate == "stale"
    )
    assert sorted(os.listdir(shm_dir)) == sorted(name for name, fate in files.items() if fate == "kept")
    assert (Path(shm_dir) / "precious").read_bytes() == b"keep me"
    skipped = {os.path.basename(event["path"]): event["reason"] for event in logs if event["event"] == "shm_file_skipped"}
    assert set(skipped) == {"pagedkv-dir.kv", "pagedkv-link.kv", "pagedkv-fifo.kv", "pagedkv-7-foreign.kv"}
    assert "not a regular file" in skipped["pagedkv-fifo.kv"]


def test_cache_service_starts_among_hostile_files(shm_dir, tmp_path):
    from harness.cache_helpers import attach, cache_stub
    from harness.processes import start_cache_service

    files = _hostile_files(shm_dir)
    with start_cache_service(tmp_path, "--shm-dir", shm_dir, "--kv-cache-bytes", "1MiB") as cache:
        reply = attach(cache_stub(cache.address))
        assert os.path.dirname(reply.pool.shared_memory.path) == shm_dir
        # A second start-up cleanup (another cache service on the same directory) leaves the live pool.
        assert cleanup_stale_pools(shm_dir) == []
        assert os.path.exists(reply.pool.shared_memory.path)
    assert cache.returncode == 0
    assert sorted(os.listdir(shm_dir)) == sorted(name for name, fate in files.items() if fate == "kept")
    skipped = [event for event in cache.log_events() if event.get("event") == "shm_file_skipped"]
    assert len(skipped) == 4


# ---- CUDA IPC: the field mapping, with torch's reduce/rebuild stood in for ---------------
# The tests named fake_* check pagedkv's mapping against fakes of torch's reduce and
# rebuild, and what the fakes recorded; the needs_cuda tests below them run the real ones.


FAKE_INFO = CudaIpcInfo(
    device_index=1,
    storage_handle=b"storage-handle",
    storage_size_bytes=4096,
    storage_offset_bytes=512,
    ref_counter_handle=b"ref-counter",
    ref_counter_offset=3,
    event_handle=b"event",
    event_sync_required=True,
    shape=(2, 2, 4, 16, 2, 8),
    stride=(1024, 512, 128, 16, 8, 1),
    storage_offset=64,
    dtype=torch.float16,
)


def test_export_refuses_a_cpu_tensor():
    with pytest.raises(ValueError, match="needs a CUDA tensor"):
        export_cuda_pool(torch.zeros(4))


def test_fake_reduce_export_maps_reduce_tensor_fields(monkeypatch):
    tensor = torch.zeros(4)

    def fake_reduce(given):
        assert given is tensor
        return reductions.rebuild_cuda_tensor, (
            torch.Tensor, torch.Size(FAKE_INFO.shape), FAKE_INFO.stride, 64, torch.storage.TypedStorage,
            torch.float16, 1, b"storage-handle", 4096, 512, False, b"ref-counter", 3, b"event", True,
        )

    monkeypatch.setattr(reductions, "reduce_tensor", fake_reduce)
    assert export_cuda_pool(tensor) == FAKE_INFO


def test_fake_reduce_export_without_event(monkeypatch):
    args = (torch.Tensor, torch.Size([4]), (1,), 0, torch.storage.TypedStorage, torch.float32, 0, b"h", 16, 0,
            False, b"r", 0, None, False)
    monkeypatch.setattr(reductions, "reduce_tensor", lambda tensor: (reductions.rebuild_cuda_tensor, args))
    info = export_cuda_pool(torch.zeros(4))
    assert (info.event_handle, info.event_sync_required, info.device) == (b"", False, "cuda:0")


def test_fake_rebuild_proto_round_trip_reaches_rebuild_cuda_tensor_in_order(monkeypatch):
    calls = []
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *args: calls.append(args) or "tensor")
    handle = cache_pb2.PoolHandle.FromString(handle_to_proto(FAKE_INFO).SerializeToString())
    assert handle.WhichOneof("memory") == "cuda_ipc" and handle.device == "cuda:1"
    assert map_pool(handle) == "tensor"
    assert calls == [(
        torch.Tensor, torch.Size(FAKE_INFO.shape), FAKE_INFO.stride, 64, torch.storage.TypedStorage,
        torch.float16, 1, b"storage-handle", 4096, 512, False, b"ref-counter", 3, b"event", True,
    )]


def test_fake_rebuild_import_passes_none_for_no_event(monkeypatch):
    calls = []
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", lambda *args: calls.append(args))
    import_cuda_pool(CudaIpcInfo(**{**{f: getattr(FAKE_INFO, f) for f in CudaIpcInfo.__dataclass_fields__},
                                    "event_handle": b"", "event_sync_required": False}))
    assert calls[0][13] is None and calls[0][14] is False


def test_import_errors_are_clear(monkeypatch):
    empty = CudaIpcInfo(**{**{f: getattr(FAKE_INFO, f) for f in CudaIpcInfo.__dataclass_fields__},
                           "storage_handle": b""})
    with pytest.raises(PoolMappingError, match="no storage handle"):
        import_cuda_pool(empty)

    def refuse(*args):
        raise RuntimeError("CUDA error: invalid device context")

    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", refuse)
    with pytest.raises(PoolMappingError, match="invalid device context.*PID namespace"):
        import_cuda_pool(FAKE_INFO)


def test_handle_to_proto_rejects_other_types():
    with pytest.raises(TypeError):
        handle_to_proto(torch.zeros(1))


def test_shared_handle_to_proto_alias(shm_dir):
    handle = SharedPoolHandle(path="/dev/shm/x.kv", size_bytes=64, shape=(4, 4), dtype=torch.float32)
    assert pool_memory.shared_handle_to_proto(handle) == handle_to_proto(handle)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: real CUDA IPC handles")


@needs_cuda
def test_export_of_a_real_cuda_tensor_names_its_storage():
    tensor = torch.zeros(SHAPE, dtype=torch.float16, device="cuda")[1]  # a view: offset into its storage
    info = export_cuda_pool(tensor)
    assert (info.shape, info.stride, info.dtype, info.device) == (tuple(tensor.shape), tensor.stride(),
                                                                  torch.float16, f"cuda:{tensor.device.index}")
    assert info.storage_handle and info.storage_offset == tensor.storage_offset()
    assert info.storage_size_bytes >= tensor.untyped_storage().nbytes()
    handle = cache_pb2.PoolHandle.FromString(handle_to_proto(info).SerializeToString())
    assert handle.WhichOneof("memory") == "cuda_ipc" and handle.device == info.device


@needs_cuda
def test_cuda_pool_in_a_second_process():
    tensor = torch.full(SHAPE, 1.5, device="cuda")
    handle = pool_memory.cuda_handle_to_proto(tensor)
    child = subprocess.run(
        [sys.executable, str(CHILD), handle.SerializeToString().hex(), "1.5", "7.0"],
        capture_output=True, text=True, timeout=300, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert child.returncode == 0 and child.stdout.strip() == "ok", child.stdout + child.stderr
    torch.cuda.synchronize()
    assert torch.all(tensor[-1, 1, -1] == 7.0)
