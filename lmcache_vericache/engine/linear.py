"""The engine's linear layers: the package's kernel (``kernels/linear.cpp``) for the few rows of a
decode step or a verify block on a CPU, PyTorch elsewhere.

With 1-200 rows the weights are most of a step's bytes, and the BLAS behind ``F.linear`` ran far
from that bound on an AVX2-only CPU: 8 fp32 rows at 2.1x the kernel's time, bf16 weights (no bf16
arithmetic there) at 4-5x for 4 rows or more (``benchmarks/linear.py``). The kernel's rows do not
depend on the batch: a row's output is the same whatever rows share its call.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import kernels

Tensor = torch.Tensor

# Rows up to which the kernel runs; above (prefill chunks) the BLAS's blocking wins. Measured on
# AVX2 the kernel led up to 256 rows (fp32 1.1x there, bf16 4.8x).
MAX_ROWS = 256


@functools.cache
def _bf16_arithmetic() -> bool:
    """The CPU multiplies bf16 itself (AVX512-BF16 or AMX): the BLAS's bf16 path is then the fast one."""
    flags = kernels._cpu_flags().split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _kernel(x: Tensor, weight: Tensor):
    if (x.device.type != "cpu" or x.dim() != 2 or x.dtype != weight.dtype or not weight.is_contiguous()
            or weight.dtype not in (torch.float32, torch.bfloat16)
            or (weight.dtype == torch.bfloat16 and _bf16_arithmetic())):
        return None
    mod = kernels.build("linear")
    return mod if mod is not None and x.shape[1] % mod.vec_width == 0 else None


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for ``x [N, in]``, in ``x``'s dtype (float32 accumulation)."""
    mod = _kernel(x, weight)
    if mod is None:
        return F.linear(x, weight, bias)
    if x.shape[0] > MAX_ROWS:
        if weight.dtype == torch.bfloat16:  # no bf16 arithmetic: the fp32 BLAS on widened copies, 5x faster
            return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
        return F.linear(x, weight, bias)
    if bias is None:
        return mod.linear(x.contiguous(), weight)  # x's dtype out: no conversions around the call
    y = mod.linear(x.float().contiguous(), weight)  # the bias added to the float sums, rounded once
    y += bias
    return y.to(x.dtype)


def apply(module: torch.nn.Module, x: Tensor) -> Tensor:
    """``module(x)`` for an ``nn.Linear`` through :func:`linear`; any other module is called as it is."""
    if type(module) is torch.nn.Linear:
        return linear(x, module.weight, module.bias)
    return module(x)
