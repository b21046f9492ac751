"""Files moved by NIXL (``nixl-cu12``, POSIX backend): the disk tier's layout and atomic renames,
with every value's bytes transferred by a NIXL agent between registered DRAM and FILE regions."""

from __future__ import annotations

import os
import threading
import time
import uuid
import warnings

import torch

from .base import TierError
from .disk import DiskTier

try:  # optional dependency: pip install 'lmcache_vericache[nixl]'
    from nixl_cu12._api import nixl_agent, nixl_agent_config
except ImportError:  # pragma: no cover - exercised only where nixl is missing
    nixl_agent = None


class NixlTier(DiskTier):
    """A :class:`DiskTier` whose file reads and writes are NIXL POSIX transfers.

    The same path works with NIXL's GDS backends where GPUDirect Storage exists (then the DRAM
    side would be device memory). NIXL's Python agent makes no thread-safety promise, so each
    calling thread gets its own agent. Files are interchangeable with :class:`DiskTier`'s.
    """

    name = "nixl"

    def __init__(self, path: str | os.PathLike, *, fsync: bool = False, backend: str = "POSIX",
                 max_bytes: int | None = None, stale_tmp_s: float = 3600.0, sweep_s: float = 60.0) -> None:
        """``backend`` is NIXL's; the other arguments are :class:`DiskTier`'s."""
        if nixl_agent is None:
            raise TierError("nixl tier: nixl-cu12 is not installed (pip install 'lmcache_vericache[nixl]')")
        self.backend = backend
        self._local = threading.local()
        self._id = uuid.uuid4().hex[:8]
        super().__init__(path, fsync=fsync, max_bytes=max_bytes, stale_tmp_s=stale_tmp_s, sweep_s=sweep_s)
        try:
            self._agent()
        except Exception as e:
            raise TierError(f"nixl tier: cannot create a NIXL agent with backend {backend}: {e}") from e

    def _agent(self):
        agent = getattr(self._local, "agent", None)
        if agent is None:
            name = f"vericache-{self._id}-{threading.get_ident()}"
            agent = nixl_agent(name, nixl_agent_config(backends=[self.backend]))
            self._local.agent = agent
        return agent

    def _transfer(self, op: str, fd: int, mem: torch.Tensor) -> None:
        """``op`` is NIXL's: WRITE moves memory to the file, READ the file to memory."""
        if not mem.numel():
            return
        agent = self._agent()
        dram = agent.register_memory(mem)
        file = agent.register_memory([(0, mem.numel(), fd, "")], "FILE")
        handle = None
        try:
            handle = agent.initialize_xfer(op, dram.trim(), file.trim(), agent.name)
            state = agent.transfer(handle)
            while state == "PROC":
                time.sleep(0.0001)
                state = agent.check_xfer_state(handle)
            if state != "DONE":
                raise OSError(f"NIXL {op} transfer ended in state {state}")
        except OSError:
            raise
        except Exception as e:  # nixl raises its own exception types
            raise OSError(f"NIXL {op} failed: {e}") from e
        finally:
            if handle is not None:
                agent.release_xfer_handle(handle)
            agent.deregister_memory(file)
            agent.deregister_memory(dram)

    def _write_fd(self, fd: int, view: memoryview) -> None:
        with warnings.catch_warnings():  # read-only source memory: NIXL only reads it
            warnings.simplefilter("ignore", UserWarning)
            mem = torch.frombuffer(view, dtype=torch.uint8) if view.nbytes else torch.empty(0, dtype=torch.uint8)
        self._transfer("WRITE", fd, mem)

    def _read_fd(self, fd: int, size: int) -> bytearray:
        buf = bytearray(size)  # NIXL needs registered, writable memory to read into
        if size:
            self._transfer("READ", fd, torch.frombuffer(buf, dtype=torch.uint8))
        return buf
