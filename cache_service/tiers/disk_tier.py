"""The disk tier's files: one file a block, named by its chain digest, under a folder per KV geometry.

A file is, little-endian::

    magic "PKVBLK01" | u32 num_layers, num_kv_heads, head_dim, block_size | 16 bytes dtype name
    | parent digest (32; zeros: a chain's first block) | digest (32)
    | u16 fingerprint length, u16 salt length | fingerprint | salt | u32 token id x block_size
    | u64 payload length | HMAC-SHA256 of the header (everything before it)
    | payload: the block's K/V as the pool lays it out | HMAC-SHA256 of everything before it

Both MACs are keyed with the folder's key (``disk_folder.py``), which only the service
reads: the header's is checked at start-up, before a file is indexed, and the whole
file's on every read, so a torn, corrupted or edited file, or one written by anyone
without the key, is skipped with a warning, never served. Written to a temporary name
(mode 0600, O_EXCL, O_NOFOLLOW) and renamed into place, so a crash mid-write leaves a
temporary file (removed at the next start-up), never a file of the final name that is
short. A file not owned by the service's user, writable by others, or not a regular file
is skipped too. The header is checked against the folder's geometry and the file's exact
size at start-up; a hostile length cannot make a read allocate more than one block.
``write`` and ``read`` run in worker threads and touch nothing but their own file.
"""

from __future__ import annotations

import errno
import hashlib
import hmac
import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import structlog
import torch

from cache_service.blocks.prefix_hash import Namespace
from cache_service.tiers.disk_folder import DiskFolder, DiskFolderRefused, refuse_shared

log = structlog.get_logger()

MAGIC = b"PKVBLK02"  # 01: the unkeyed format, never read
SUFFIX = ".kvblock"
_FIXED = struct.Struct("<8sIIII16s32s32sHH")
_PAYLOAD_LEN = struct.Struct("<Q")
MAC_BYTES = 32
MAX_NAME_BYTES = 1024  # fingerprint or salt: the servicer takes at most 256 characters
FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class DiskFull(OSError):
    """The disk (or a quota) refused a write: demotions to disk stop for a while."""


class BadBlockFile(ValueError):
    """A block file that must not be served; the message says why."""


@dataclass(frozen=True, slots=True)
class DiskGeometry:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def tag(self) -> str:
        """The folder name: files of another geometry sit in another folder and are never read."""
        return f"L{self.num_layers}-H{self.num_kv_heads}-D{self.head_dim}-B{self.block_size}-{self.dtype_name}"

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def payload_bytes(self) -> int:
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * self.dtype.itemsize


@dataclass(frozen=True, slots=True)
class BlockRecord:
    """A block file's header: the identity it was written under."""

    digest: bytes
    parent_digest: bytes
    namespace: Namespace
    token_ids: tuple[int, ...]
    size: int


def file_bytes(geometry: DiskGeometry, namespace: Namespace) -> int:
    names = len(namespace[0].encode()) + len(namespace[1].encode())
    return (_FIXED.size + names + 4 * geometry.block_size + _PAYLOAD_LEN.size + MAC_BYTES + geometry.payload_bytes
            + MAC_BYTES)


class DiskTier:
    def __init__(self, folder: DiskFolder, capacity_bytes: int, geometry: DiskGeometry) -> None:
        self.root = folder.root
        self.geometry = geometry
        self.capacity_bytes = capacity_bytes
        self.folder = folder.geometry_folder(geometry.tag)
        self._key = folder.key
        self.used_bytes = 0
        self.sizes: dict[bytes, int] = {}  # digest -> file size, for the files the index holds

    @property
    def capacity_blocks(self) -> int:
        return self.capacity_bytes // file_bytes(self.geometry, ("", ""))

    def path(self, digest: bytes) -> Path:
        return self.folder / (digest.hex() + SUFFIX)

    # -- start-up ---------------------------------------------------------------------

    def scan(self) -> list[BlockRecord]:
        """The well-formed files of this geometry; everything else is skipped with a warning."""
        for other in sorted(self.root.iterdir()):
            if other.name != self.geometry.tag and not other.name.startswith("."):
                log.warning("disk_cache_other_geometry_ignored", path=str(other), geometry=self.geometry.tag)
        records = []
        for path in sorted(self.folder.iterdir()):
            if path.name.endswith(".tmp"):
                path.unlink(missing_ok=True)  # a write a crash interrupted: never renamed, never served
                continue
            try:
                records.append(self._read_header(path))
            except (OSError, BadBlockFile) as error:
                log.warning("disk_cache_file_skipped", path=str(path), reason=str(error))
        return records

    def _read_header(self, path: Path) -> BlockRecord:
        if not path.name.endswith(SUFFIX):
            raise BadBlockFile("not a block file name")
        fd = _open_private(path)
        try:
            info = os.fstat(fd)
            with os.fdopen(fd, "rb", closefd=False) as handle:
                head = handle.read(_FIXED.size + 2 * MAX_NAME_BYTES + 4 * self.geometry.block_size
                                   + _PAYLOAD_LEN.size + MAC_BYTES)
        finally:
            os.close(fd)
        record, _ = self._parse_header(head)
        if path.name != record.digest.hex() + SUFFIX:
            raise BadBlockFile("file name does not match the digest inside")
        if info.st_size != record.size:
            raise BadBlockFile(f"{info.st_size} bytes, its header says {record.size} (truncated or torn)")
        return record

    def _parse_header(self, data: bytes) -> tuple[BlockRecord, int]:
        g = self.geometry
        if len(data) < _FIXED.size:
            raise BadBlockFile("shorter than a block file header")
        magic, layers, heads, head_dim, block_size, dtype, parent, digest, fp_len, salt_len = _FIXED.unpack_from(data)
        if magic != MAGIC:
            raise BadBlockFile("not a pagedkv block file (magic)")
        found = (layers, heads, head_dim, block_size, dtype.rstrip(b"\0").decode(errors="replace"))
        if found != (g.num_layers, g.num_kv_heads, g.head_dim, g.block_size, g.dtype_name):
            raise BadBlockFile(f"written for another KV geometry {found}")
        if fp_len > MAX_NAME_BYTES or salt_len > MAX_NAME_BYTES:
            raise BadBlockFile("namespace longer than any the service writes")
        offset = _FIXED.size
        end = offset + fp_len + salt_len + 4 * block_size + _PAYLOAD_LEN.size
        if len(data) < end:
            raise BadBlockFile("header cut short")
        try:
            fingerprint = data[offset : offset + fp_len].decode()
            salt = data[offset + fp_len : offset + fp_len + salt_len].decode()
        except UnicodeDecodeError as error:
            raise BadBlockFile(f"namespace is not UTF-8: {error}") from None
        offset += fp_len + salt_len
        tokens = struct.unpack_from(f"<{block_size}I", data, offset)
        offset += 4 * block_size
        (payload_len,) = _PAYLOAD_LEN.unpack_from(data, offset)
        if payload_len != g.payload_bytes:
            raise BadBlockFile(f"payload of {payload_len} bytes, a block is {g.payload_bytes}")
        offset += _PAYLOAD_LEN.size
        if len(data) < offset + MAC_BYTES:
            raise BadBlockFile("header cut short")
        if not hmac.compare_digest(self._mac(data[:offset]), data[offset : offset + MAC_BYTES]):
            raise BadBlockFile("header MAC mismatch: not written by this service with its key")
        offset += MAC_BYTES
        size = offset + payload_len + MAC_BYTES
        return BlockRecord(digest, parent, (fingerprint, salt), tokens, size), offset

    # -- blocks ------------------------------------------------------------------------

    def encode(self, record: BlockRecord, payload: torch.Tensor) -> bytes:
        g = self.geometry
        fingerprint, salt = (part.encode() for part in record.namespace)
        head = _FIXED.pack(MAGIC, g.num_layers, g.num_kv_heads, g.head_dim, g.block_size, g.dtype_name.encode(),
                           record.parent_digest, record.digest, len(fingerprint), len(salt))
        body = payload.contiguous().view(torch.uint8).numpy().tobytes()
        header = b"".join((head, fingerprint, salt, struct.pack(f"<{g.block_size}I", *record.token_ids),
                           _PAYLOAD_LEN.pack(len(body))))
        data = b"".join((header, self._mac(header), body))
        return data + self._mac(data)

    def _mac(self, data: bytes) -> bytes:
        return hmac.new(self._key, data, hashlib.sha256).digest()

    def write(self, record: BlockRecord, payload: torch.Tensor) -> int:
        """Writes one block file (worker thread); returns its size. DiskFull when the disk is."""
        data = self.encode(record, payload)
        final = self.path(record.digest)
        temporary = self.folder / f".{record.digest.hex()}.{os.getpid()}.tmp"
        try:
            fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.rename(temporary, final)
        except OSError as error:
            temporary.unlink(missing_ok=True)
            if error.errno in FULL_ERRNOS:
                raise DiskFull(error.errno, f"disk cache write refused: {error.strerror}") from None
            raise
        return len(data)

    def read(self, record: BlockRecord) -> torch.Tensor:
        """The block's K/V, after checking the whole file against ``record``; BadBlockFile if it differs."""
        g = self.geometry
        fd = _open_private(self.path(record.digest))
        try:
            with os.fdopen(fd, "rb", closefd=False) as handle:
                data = handle.read(record.size + 1)
        finally:
            os.close(fd)
        if len(data) != record.size:
            raise BadBlockFile(f"{len(data)} bytes, expected {record.size} (truncated or grown)")
        if not hmac.compare_digest(self._mac(data[:-MAC_BYTES]), data[-MAC_BYTES:]):
            raise BadBlockFile("MAC mismatch (torn, corrupted, or not written by this service with its key)")
        found, offset = self._parse_header(data)
        if found != record:
            raise BadBlockFile("header differs from the one indexed at start-up")
        payload = bytearray(data[offset : offset + g.payload_bytes])
        return torch.frombuffer(payload, dtype=torch.uint8).view(g.dtype).reshape(g.block_shape)

    def added(self, digest: bytes, size: int) -> None:
        self.sizes[digest] = size
        self.used_bytes += size

    def remove(self, digest: bytes) -> None:
        self.used_bytes -= self.sizes.pop(digest, 0)
        self.path(digest).unlink(missing_ok=True)


def _open_private(path: Path) -> int:
    """An fd of ``path`` if it is a regular file (no symlink) of this user's that no one else may write."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as error:
        raise BadBlockFile(f"cannot open: {error.strerror}") from None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise BadBlockFile("not a regular file")
        try:
            refuse_shared(path, info, "block file")
        except DiskFolderRefused as error:
            raise BadBlockFile(str(error)) from None
    except BaseException:
        os.close(fd)
        raise
    return fd
