"""Background worker threads that run PyTorch CPU ops (reads, swaps, copies, hashes)."""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

import torch


@functools.cache
def _torch_cpu():
    """``libtorch_cpu`` as loaded: its symbols and those of what it links (its OpenMP runtime,
    whatever its file name); ``None`` where it cannot be opened."""
    try:
        return ctypes.CDLL(str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"),
                           mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return None


def torch_serial() -> None:
    """Run this thread's PyTorch CPU ops on one thread: the initializer of every worker pool and
    the first call of every worker thread.

    A torch op that parallelizes on a second Python thread starts a second OpenMP thread team; with
    more OpenMP threads than cores, libgomp stops spinning between parallel regions, and every small
    op of the serving thread's forwards then waits for its threads to wake. Measured on a 2-core CPU:
    the linear layers of a batch-8 decode step took 19 ms, and 36 ms for the rest of the process
    once one prefix read had run on a pool thread. Workers copy, hash and (de)serialize, which is
    memory-bound: several workers, one core each. Only this thread's OpenMP count changes (a per-thread
    setting; ``torch.set_num_threads`` would also change what every later thread starts with). MKL
    keeps its own count, which PyTorch sets only when ``torch.set_num_threads`` is called."""
    torch.get_num_threads()  # PyTorch sets a thread's count once, at its first query: let it, then override
    fn = getattr(_torch_cpu(), "omp_set_num_threads", None)
    if fn is not None:
        fn(1)
