"""The KV tiers' settings (--host-cache-bytes, --disk-cache-dir, --disk-cache-bytes,
--disk-cache-key-file) and their checks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TierSettings:
    # 0: no host tier (the default keeps the pool-only behaviour).
    host_cache_bytes: int = 0
    disk_cache_dir: str | None = None
    disk_cache_bytes: int = 0
    # The HMAC key file (None: .hmac-key in disk_cache_dir).
    disk_cache_key_file: str | None = None

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

    @property
    def enabled(self) -> bool:
        return bool(self.host_cache_bytes or self.disk_cache_dir)
