"""The disk tier's folder: checked, locked for the service's life, and its HMAC key.

Block files are trusted only as far as the folder is: a file another user could write
would be served as K/V to whoever's prompt hashes to it. So the folder, each geometry
folder in it, and the key must be owned by the service's user and writable by nobody
else, and are never followed through a symlink; and every file carries an HMAC under a
key only the service reads (``disk_tier.py``), so a file the service did not write is
never served, whoever wrote it.

Two services on one folder would remove each other's files (a scan removes files no chain
reaches), so the first holds an exclusive flock on ``.lock`` for its life, with its pid
and host written in it; a second is refused with that holder in the message. A lock
held by a process that died is gone with it (the kernel drops a dead process's flocks).
"""

from __future__ import annotations

import datetime
import fcntl
import os
import secrets
import socket
import stat
from pathlib import Path

LOCK_NAME = ".lock"
KEY_NAME = ".hmac-key"
KEY_BYTES = 32


class DiskFolderRefused(ValueError):
    """The disk tier's folder, key or lock cannot be used; the message says why and what to do."""


def check_private(path: Path, kind: str, is_kind=stat.S_ISDIR) -> os.stat_result:
    """lstat ``path``: it must be a ``kind`` (no symlink) owned by this user that no one else may write."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise DiskFolderRefused(f"{path} is a symlink; the disk tier follows none: give the real {kind}")
    if not is_kind(info.st_mode):
        raise DiskFolderRefused(f"{path} is not a {kind}")
    refuse_shared(path, info, kind)
    return info


def refuse_shared(path: Path, info: os.stat_result, kind: str) -> None:
    if info.st_uid != os.geteuid():
        raise DiskFolderRefused(f"{kind} {path} is owned by uid {info.st_uid}, not by this service's user "
                                f"(uid {os.geteuid()}); chown it or give another")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise DiskFolderRefused(f"{kind} {path} is writable by group or others (mode "
                                f"{stat.S_IMODE(info.st_mode):04o}); chmod go-w it")


class DiskFolder:
    """``--disk-cache-dir``, opened: checked, locked and with its key loaded (or made)."""

    def __init__(self, root: str | Path, key_file: str | Path | None = None) -> None:
        self.root = Path(root)
        try:
            self.root.mkdir(mode=0o700, parents=True, exist_ok=True)
        except OSError as error:
            raise DiskFolderRefused(f"--disk-cache-dir {self.root}: cannot create it: {error.strerror}") from None
        check_private(self.root, "folder")
        self._lock = self._take_lock()
        try:
            self.key = load_key(Path(key_file) if key_file else self.root / KEY_NAME)
        except BaseException:
            self.close()
            raise

    def geometry_folder(self, tag: str) -> Path:
        """The folder of one KV geometry's files, made if missing, refused if not private."""
        folder = self.root / tag
        try:
            folder.mkdir(mode=0o700)
        except FileExistsError:
            pass
        check_private(folder, "folder")
        return folder

    def close(self) -> None:
        if self._lock is not None:
            self._lock.close()  # drops the flock
            self._lock = None

    def _take_lock(self):
        path = self.root / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        handle = os.fdopen(fd, "r+")
        try:
            refuse_shared(path, os.fstat(fd), "lock file")
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = handle.read(200).strip() or "another process"
                raise DiskFolderRefused(f"--disk-cache-dir {self.root} is in use by {holder}; two cache services "
                                        "on one folder would remove each other's files: give each its own") from None
            handle.seek(0)
            handle.truncate()
            handle.write(f"cache service pid {os.getpid()} on {socket.gethostname()}, since "
                         f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M:%S} UTC\n")
            handle.flush()
        except BaseException:
            handle.close()
            raise
        return handle


def load_key(path: Path) -> bytes:
    """The HMAC key at ``path``, made there (0600, O_EXCL) if no file is."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        pass
    except OSError as error:
        raise DiskFolderRefused(f"cannot create the disk tier's key {path}: {error.strerror}; "
                                "give --disk-cache-key-file") from None
    else:
        with os.fdopen(fd, "wb") as handle:
            handle.write(secrets.token_bytes(KEY_BYTES))
    return read_key(path, "the disk tier's key", DiskFolderRefused,
                    "remove it (and the block files, which it signed) to make a new one")


def read_key(path: Path, what: str, refused: type[ValueError], remedy: str) -> bytes:
    """The KEY_BYTES key at ``path``: a regular file (no symlink) of this user's that no one
    else may read or write; ``refused`` (with ``what`` and, for a wrong size, ``remedy``) otherwise."""
    try:
        # O_NONBLOCK: a FIFO in its place must not hang the start-up.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as error:
        raise refused(f"cannot open {what} {path}: {error.strerror} (a symlink is never followed)") from None
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)  # before fdopen, which refuses a folder with an error of its own
        raise refused(f"{what} {path} is not a regular file")
    with os.fdopen(fd, "rb") as handle:
        try:
            refuse_shared(path, info, "key file")
        except DiskFolderRefused as error:
            raise refused(str(error)) from None
        if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise refused(f"{what} {path} may be read by group or others (mode "
                          f"{stat.S_IMODE(info.st_mode):04o}); chmod 600 it")
        key = handle.read(KEY_BYTES + 1)
    if len(key) != KEY_BYTES:
        raise refused(f"{what} {path} holds {len(key)} bytes, not {KEY_BYTES}; {remedy}")
    return key
