"""Local disk: one file per value, written atomically (temp file + rename)."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import threading
import time
from pathlib import Path

from .base import Blob, CapacityTier, ErrorLog, TierError, check_key

logger = logging.getLogger(__name__)

_STALE_TMP_S = 3600.0


class DiskTier(CapacityTier):
    """Values as files ``<dir>/<blake2b(key)>.kv``.

    A put writes a private temp file in the same directory and renames it over the final name, so a
    reader sees the old file, the new one or none, and a failed write (disk full) leaves only the
    old value. Several processes may share one directory. A restart finds everything stored
    before: there is no index to rebuild, the file name is a function of the key. ``fsync=True``
    also makes puts survive power loss; without it a crash can leave a short or empty file, which
    the chunk digests turn into a miss.

    Reads are one plain ``os.read`` per value, like a raw file read. ``benchmarks/store.py``
    measures this against raw reads and aiofiles, which runs the same syscalls through a thread hop
    and is no faster; async callers run ``get`` in a thread pool (the store does). No O_DIRECT:
    the page cache is what makes re-reads of a shared prefix cheap.
    """

    name = "disk"

    def __init__(self, path: str | os.PathLike, *, fsync: bool = False) -> None:
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise TierError(f"disk tier: cannot create directory {self.path}: {e.strerror or e}") from e
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise TierError(f"disk tier: directory {self.path} is not writable")
        self.fsync = fsync
        self._errors = ErrorLog(logger)
        self._closed = False
        self._sweep_stale_temps()

    def _file(self, key: str) -> Path:
        check_key(key)
        return self.path / (hashlib.blake2b(key.encode(), digest_size=16).hexdigest() + ".kv")

    def _sweep_stale_temps(self) -> None:
        # Temp files of writers that crashed; recent ones may belong to a live writer elsewhere.
        now = time.time()
        for tmp in self.path.glob(".*.tmp"):
            with contextlib.suppress(OSError):
                if now - tmp.stat().st_mtime > _STALE_TMP_S:
                    tmp.unlink()

    def put(self, key: str, data: Blob) -> None:
        final = self._file(key)
        if self._closed:
            raise TierError(f"disk tier {self.path}: put {key!r} after close")
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        view = memoryview(data).cast("B")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
            try:
                self._write_fd(fd, view)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise TierError(
                f"disk tier {self.path}: writing {key!r} ({view.nbytes} bytes) failed: {e.strerror or e}"
            ) from e

    def get(self, key: str) -> Blob | None:
        if self._closed:
            return None
        try:
            fd = os.open(self._file(key), os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            self._errors("disk tier %s: cannot open %r: %s", self.path, key, e)
            return None
        try:
            return self._read_fd(fd, os.fstat(fd).st_size)
        except OSError as e:
            self._errors("disk tier %s: reading %r failed: %s", self.path, key, e)
            return None
        finally:
            os.close(fd)

    # I/O hooks (the NIXL tier moves the same files through NIXL's POSIX backend)
    def _write_fd(self, fd: int, view: memoryview) -> None:
        done = 0
        while done < view.nbytes:
            done += os.write(fd, view[done:])

    def _read_fd(self, fd: int, size: int) -> Blob:
        # One uninitialized allocation, as a plain file read does; a bytearray would be zero-filled
        # first, an extra pass over memory (measured: ~40% of raw read bandwidth from page cache).
        data = os.read(fd, size)
        while len(data) < size:  # short reads: only for values over 2 GiB
            more = os.read(fd, size - len(data))
            if not more:  # cannot happen with rename-only writers; the digest rejects the rest
                break
            data += more
        return data

    def contains(self, key: str) -> bool:
        return not self._closed and self._file(key).exists()

    def delete(self, key: str) -> None:
        with contextlib.suppress(OSError):
            self._file(key).unlink()

    def close(self) -> None:
        self._closed = True
