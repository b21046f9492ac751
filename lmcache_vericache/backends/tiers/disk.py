"""Local disk: one file per value, written atomically (temp file + rename), optionally bounded."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from pathlib import Path

from .base import Blob, CapacityTier, ErrorLog, TierError, check_key

logger = logging.getLogger(__name__)

_RESCAN_OVER_CAP_S = 5.0  # an over-cap put re-reads the directory at most this often


class DiskTier(CapacityTier):
    """Values as files ``<dir>/<blake2b(key)>.kv``.

    A put writes a private temp file in the same directory and renames it over the final name, so a
    reader sees the old file, the new one or none, and a failed write (disk full) leaves only the
    old value. Several processes may share one directory. A restart finds everything stored
    before: the file name is a function of the key. ``fsync=True`` also makes puts survive power
    loss (the file, then the directory after the rename); without it a crash can leave a short or
    empty file, which the chunk digests turn into a miss.

    **Private by default**: ``~`` in ``path`` is expanded, a created directory gets mode 0700 and
    files 0600. An existing directory owned by another user, or writable by group or others, is
    refused with :class:`TierError` (another local user could read the KV or plant chunks).

    **Bound** ``max_bytes``: a put that would take the values over it first evicts the least
    recently used files (recency is the file's mtime: a put sets it, a ``get`` hit bumps it, in any
    process sharing the directory); a value larger than the bound raises :class:`TierError`. The
    sizes live in an in-memory index built by scanning the directory at start-up, kept current on
    put/get/delete/evict and rebuilt by a re-scan every ``sweep_s`` and, at most every
    few seconds, when it says a put does not fit. Files of other processes are found by these
    scans, so with several writers the bound holds up to their puts since the last scan. Temp
    files (values being written) are never counted or evicted.

    **Crashed writers' temp files** (``.*.tmp``) older than ``stale_tmp_s`` are removed at start-up
    and by a put at most every ``sweep_s`` seconds.

    Reads are one plain ``os.read`` per value, like a raw file read. ``benchmarks/store.py``
    measures this against raw reads and aiofiles, which runs the same syscalls through a thread hop
    and is no faster; async callers run ``get`` in a thread pool (the store does). No O_DIRECT:
    the page cache is what makes re-reads of a shared prefix cheap.

    Threading: every method is thread-safe; file I/O runs outside the lock, which guards the index
    (eviction and the rename of a put happen under it, so concurrent puts never overshoot).
    """

    name = "disk"

    def __init__(self, path: str | os.PathLike, *, fsync: bool = False, max_bytes: int | None = None,
                 stale_tmp_s: float = 3600.0, sweep_s: float = 60.0) -> None:
        if max_bytes is not None and max_bytes <= 0:
            raise TierError(f"disk tier: max_bytes must be > 0, got {max_bytes}")
        self.path = Path(path).expanduser()
        try:
            self.path.mkdir(parents=True, mode=0o700)
            os.chmod(self.path, 0o700)  # whatever the umask
        except FileExistsError:
            self._check_private()
        except OSError as e:
            raise TierError(f"disk tier: cannot create directory {self.path}: {e.strerror or e}") from e
        if not os.access(self.path, os.W_OK | os.X_OK):
            raise TierError(f"disk tier: directory {self.path} is not writable")
        self.fsync, self.max_bytes = fsync, max_bytes
        self.stale_tmp_s, self.sweep_s = stale_tmp_s, sweep_s
        self._errors = ErrorLog(logger)
        self._closed = False
        self._lock = threading.Lock()
        self._index: OrderedDict[str, tuple[int, int]] = OrderedDict()  # name -> (size, mtime_ns), LRU first
        self._total = 0
        self._last_scan = self._last_sweep = -float("inf")
        with self._lock:
            self._scan(sweep=True)

    def _check_private(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError as e:
            raise TierError(f"disk tier: cannot use directory {self.path}: {e.strerror or e}") from e
        if not stat.S_ISDIR(st.st_mode):
            raise TierError(f"disk tier: cannot create directory {self.path}: a file is in the way")
        mode = stat.S_IMODE(st.st_mode)
        why = (f"owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})" if st.st_uid != os.geteuid()
               else f"writable by others (mode {mode:04o})" if mode & stat.S_IWOTH
               else f"writable by group (mode {mode:04o})" if mode & stat.S_IWGRP else None)
        if why:
            raise TierError(f"disk tier: refusing directory {self.path}: {why}; another local user could read "
                            "the KV cache or plant chunks in it (use a private directory, e.g. chmod 700)")

    def _file(self, key: str) -> Path:
        check_key(key)
        return self.path / (hashlib.blake2b(key.encode(), digest_size=16).hexdigest() + ".kv")

    # -- index (all under self._lock) ---------------------------------------------------------------
    def _scan(self, *, sweep: bool) -> None:
        """Rebuilds the index from the directory (bounded tiers); ``sweep`` also removes stale temps."""
        now, found = time.time(), []
        try:
            with os.scandir(self.path) as entries:
                for e in entries:
                    with contextlib.suppress(FileNotFoundError):  # another process evicted or renamed it
                        if e.name.endswith(".kv") and not e.name.startswith("."):
                            if self.max_bytes is not None:
                                st = e.stat()
                                found.append((st.st_mtime_ns, e.name, st.st_size))
                        elif sweep and e.name.startswith(".") and e.name.endswith(".tmp"):
                            if now - e.stat().st_mtime > self.stale_tmp_s:
                                os.unlink(e.path)
        except OSError as e:
            self._errors("disk tier %s: scanning the directory failed: %s", self.path, e)
            return
        self._last_scan = time.monotonic()
        if sweep:
            self._last_sweep = self._last_scan
        if self.max_bytes is not None:
            found.sort()
            self._index = OrderedDict((name, (size, mtime)) for mtime, name, size in found)
            self._total = sum(size for _, _, size in found)

    def _forget(self, name: str) -> None:
        old = self._index.pop(name, None)
        if old is not None:
            self._total -= old[0]

    def _note(self, name: str, size: int, mtime_ns: int) -> None:
        self._forget(name)
        self._index[name] = (size, mtime_ns)
        self._total += size

    def _make_room(self, name: str, size: int, cap: int) -> None:
        """Evicts least recently used files until ``size`` more bytes (replacing ``name``) fit."""
        if self._total - self._index.get(name, (0, 0))[0] + size > cap and \
                time.monotonic() - self._last_scan >= min(self.sweep_s, _RESCAN_OVER_CAP_S):
            self._scan(sweep=False)  # other processes' puts and evictions
        self._forget(name)
        while self._total + size > cap and self._index:
            victim, (vsize, vmtime) = next(iter(self._index.items()))
            try:
                st = os.stat(self.path / victim)
                if st.st_mtime_ns > vmtime:  # used by another process since we looked: keep it
                    self._note(victim, st.st_size, st.st_mtime_ns)
                    continue
                os.unlink(self.path / victim)
            except FileNotFoundError:
                pass
            self._forget(victim)

    # -- CapacityTier -------------------------------------------------------------------------------
    def put(self, key: str, data: Blob) -> None:
        final = self._file(key)
        if self._closed:
            raise TierError(f"disk tier {self.path}: put {key!r} after close")
        view = memoryview(data).cast("B")
        cap = self.max_bytes
        if cap is not None and view.nbytes > cap:
            raise TierError(f"disk tier {self.path}: put {key!r}: {view.nbytes} bytes is larger than the "
                            f"tier's max_bytes {cap}")
        if time.monotonic() - self._last_sweep >= self.sweep_s:
            with self._lock:
                self._scan(sweep=True)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                self._write_fd(fd, view)
                if self.fsync:
                    os.fsync(fd)
                mtime = os.fstat(fd).st_mtime_ns
            finally:
                os.close(fd)
            if cap is None:
                os.replace(tmp, final)
            else:
                with self._lock:
                    self._make_room(final.name, view.nbytes, cap)
                    os.replace(tmp, final)
                    self._note(final.name, view.nbytes, mtime)
            if self.fsync:  # make the rename durable too
                dfd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        except OSError as e:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise TierError(
                f"disk tier {self.path}: writing {key!r} ({view.nbytes} bytes) failed: {e.strerror or e}"
            ) from e

    def get(self, key: str) -> Blob | None:
        if self._closed:
            return None
        path = self._file(key)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        except OSError as e:
            self._errors("disk tier %s: cannot open %r: %s", self.path, key, e)
            return None
        try:
            data = self._read_fd(fd, os.fstat(fd).st_size)
        except OSError as e:
            self._errors("disk tier %s: reading %r failed: %s", self.path, key, e)
            return None
        finally:
            os.close(fd)
        now = time.time_ns()
        try:  # recency for every process's eviction
            os.utime(path, ns=(now, now))
        except OSError:  # evicted or deleted meanwhile: the value read is still whole
            return data
        if self.max_bytes is not None:
            with self._lock:
                self._note(path.name, len(data), now)
        return data

    # I/O hooks (the NIXL tier moves the same files through NIXL's POSIX backend)
    def _write_fd(self, fd: int, view: memoryview) -> None:
        done = 0
        while done < view.nbytes:
            done += os.write(fd, view[done:])

    def _read_fd(self, fd: int, size: int) -> Blob:
        # One uninitialized allocation, as a plain file read does; a bytearray would be zero-filled
        # first, an extra pass over memory that costs a large share of a read from the page cache.
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
        path = self._file(key)
        with contextlib.suppress(OSError):
            path.unlink()
        with self._lock:
            self._forget(path.name)

    def close(self) -> None:
        self._closed = True
