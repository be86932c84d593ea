"""The KV tiers' settings (--host-cache-bytes, --disk-cache-dir, --disk-cache-bytes,
--disk-cache-key-file, --remote-kv and its own) and their checks."""

from __future__ import annotations

from dataclasses import dataclass

from cache_service.tiers.remote_backends import parse_remote_url

DEFAULT_REMOTE_KV_TIMEOUT_MS = 250
DEFAULT_REMOTE_KV_QUEUE_BLOCKS = 1024


@dataclass(frozen=True, slots=True)
class TierSettings:
    # 0: no host tier (the default keeps the pool-only behaviour).
    host_cache_bytes: int = 0
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = 0
    # The HMAC key file (None: .hmac-key in disk_cache_dir).
    disk_cache_key_file: str | None = None
    # The remote tier shared by replicas: the store's URL (None: no remote tier), the MAC
    # key file every cache service of the cluster shares, how long a Lease call waits for
    # the store's blocks, and how many blocks may wait to be written.
    remote_kv: str | None = None
    remote_kv_key_file: str | None = None
    remote_kv_timeout_ms: int = DEFAULT_REMOTE_KV_TIMEOUT_MS
    remote_kv_queue_blocks: int = DEFAULT_REMOTE_KV_QUEUE_BLOCKS

    def __post_init__(self) -> None:
        if self.host_cache_bytes < 0:
            raise ValueError(f"--host-cache-bytes cannot be negative, got {self.host_cache_bytes}")
        if self.disk_cache_bytes < 0:
            raise ValueError(f"--disk-cache-bytes cannot be negative, got {self.disk_cache_bytes}")
        if self.disk_cache_dir and not self.disk_cache_bytes:
            raise ValueError("--disk-cache-dir needs --disk-cache-bytes: how much of the disk the tier may use")
        if self.disk_cache_bytes and not self.disk_cache_dir:
            raise ValueError("--disk-cache-bytes needs --disk-cache-dir: where the tier's files go")
        if self.disk_cache_key_file and not self.disk_cache_dir:
            raise ValueError("--disk-cache-key-file needs --disk-cache-dir: it signs that folder's files")
        if self.remote_kv:
            parse_remote_url(self.remote_kv)
            if not self.remote_kv_key_file:
                raise ValueError("--remote-kv needs --remote-kv-key-file: the MAC key every cache service of the "
                                 "cluster shares, which signs the store's blocks")
        elif self.remote_kv_key_file:
            raise ValueError("--remote-kv-key-file needs --remote-kv: it signs that store's blocks")
        if self.remote_kv_timeout_ms < 1:
            raise ValueError(f"--remote-kv-timeout-ms must be at least 1, got {self.remote_kv_timeout_ms}")
        if self.remote_kv_queue_blocks < 1:
            raise ValueError(f"--remote-kv-queue-blocks must be at least 1, got {self.remote_kv_queue_blocks}")

    @property
    def enabled(self) -> bool:
        return bool(self.host_cache_bytes or self.disk_cache_dir or self.remote_kv)
