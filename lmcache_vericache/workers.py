"""Background worker threads that run PyTorch CPU ops (reads, swaps, copies, hashes)."""

from __future__ import annotations

import ctypes
import functools
import os

import torch


@functools.cache
def _openmp():
    """The OpenMP runtime PyTorch loaded (GNU, Intel or LLVM), or ``None``."""
    for name in ("libgomp.so.1", "libiomp5.so", "libomp.so"):
        try:
            return ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
        except OSError:
            continue
    return None


def torch_serial() -> None:
    """Run this thread's PyTorch CPU ops on one thread: the initializer of every worker pool and
    the first call of every worker thread.

    A torch op that parallelizes on a second Python thread starts a second OpenMP thread team; with
    more OpenMP threads than cores, libgomp stops spinning between parallel regions, and every small
    op of the serving thread's forwards then waits for its threads to wake. Measured on a 2-core CPU:
    the linear layers of a batch-8 decode step took 19 ms, and 36 ms for the rest of the process
    once one prefix read had run on a pool thread. Workers copy, hash and (de)serialize, which is
    memory-bound: several workers, one core each. Only this thread's OpenMP count changes
    (``torch.set_num_threads`` would also change what every later thread starts with)."""
    torch.zeros(2).sum()  # PyTorch sets a thread's OpenMP count at its first op: let it, then override
    lib = _openmp()
    if lib is not None:
        lib.omp_set_num_threads(1)
