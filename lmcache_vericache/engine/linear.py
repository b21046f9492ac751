"""The engine's linear layers: the package's kernel (``kernels/linear.cpp``) for the few rows of a
decode step or a verify block on a CPU, PyTorch elsewhere.

With 1-200 rows the weights are most of a step's bytes, and the BLAS behind ``F.linear`` runs far
from that bound on an AVX2-only CPU, bf16 weights (no bf16 arithmetic there) furthest
(``benchmarks/linear.py`` measures both paths; docs/benchmarks.md). On the kernel's path (up to
``MAX_ROWS`` rows) a row's output does not depend on the rows that share its call.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from . import kernels

Tensor = torch.Tensor

# Rows up to which the kernel runs; above (prefill chunks) the BLAS's blocking wins. On AVX2 the
# kernel leads in fp32 and bf16 up to 256 rows (docs/benchmarks.md).
MAX_ROWS = 256


@functools.cache
def _bf16_arithmetic() -> bool:
    """The CPU multiplies bf16 itself (AVX512-BF16 or AMX): the BLAS's bf16 path is then the fast one."""
    flags = kernels._cpu_flags().split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


def kernel_for(x: Tensor, weight: Tensor):
    """The kernel's module where it takes ``x [N, in]`` (any N) and ``weight``, else ``None``:
    CPU tensors of one dtype, fp32, or bf16 on a CPU without bf16 arithmetic; ``in`` a multiple
    of the vector width."""
    if (x.device.type != "cpu" or weight.device.type != "cpu" or x.dim() != 2 or x.dtype != weight.dtype
            or not weight.is_contiguous() or weight.dtype not in (torch.float32, torch.bfloat16)
            or (weight.dtype == torch.bfloat16 and _bf16_arithmetic())):
        return None
    mod = kernels.build("linear")
    return mod if mod is not None and x.shape[1] % mod.vec_width == 0 else None


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for ``x [N, in]``, in ``x``'s dtype (float32 accumulation)."""
    mod = kernel_for(x, weight)
    if mod is not None and x.shape[0] <= MAX_ROWS:
        if bias is None:
            return mod.linear(x.contiguous(), weight)  # x's dtype out: no conversions around the call
        y = mod.linear(x.float().contiguous(), weight)  # the bias added to the float sums, rounded once
        y += bias
        return y.to(x.dtype)
    if (x.device.type == "cpu" and x.dtype == weight.dtype == torch.bfloat16 and x.dim() == 2
            and x.shape[0] > MAX_ROWS and not _bf16_arithmetic()):
        # prefill rows of bf16 weights where the CPU has no bf16 arithmetic: the fp32 BLAS on widened
        # copies (far faster than the bf16 BLAS there; the copy is small beside a product of this many rows)
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(x.dtype)
    return F.linear(x, weight, bias)


def apply(module: torch.nn.Module, x: Tensor) -> Tensor:
    """``module(x)`` for a plain ``nn.Linear`` (no hooks) through :func:`linear`; any other module,
    or one with hooks (offloading, adapters), is called as it is."""
    if type(module) is torch.nn.Linear and not (module._forward_hooks or module._forward_pre_hooks):
        return linear(x, module.weight, module.bias)
    return module(x)
