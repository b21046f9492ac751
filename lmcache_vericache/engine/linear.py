"""The engine's linear layers: the package's kernel (``kernels/linear.cpp``) for the few rows of a
decode step or a verify block on a CPU, PyTorch elsewhere.

With 1-200 rows the weights are most of a step's bytes, and the BLAS behind ``F.linear`` runs far
from that bound on an AVX2-only CPU, bf16 weights (no bf16 arithmetic there) furthest
(``benchmarks/linear.py`` measures both paths; docs/benchmarks.md). On the kernel's path (up to
``MAX_ROWS`` rows) a row's output does not depend on the rows that share its call.

bf16 weights on a CPU with bf16 arithmetic: the kernel's AVX512-BF16 dot path (no widening) where
the CPU has no AMX tiles. Measured on a 2-core AMD EPYC (AVX512-BF16, no AMX), SmolLM2's 30 layers:
8 rows 13.9 ms against oneDNN's 20.8, 136 rows 94.8 against 83.2. It is taken for the verify blocks'
rows too, though oneDNN is 12% faster there: one path for every row count up to ``MAX_ROWS`` means
a verify block computes the linear layers of each of its tokens bit for bit as that token's decode
step does, so bf16 VeriCache and full-KV decoding round alike (a verify of more rows, batch x
(L + 1) > ``MAX_ROWS``, i.e. beyond batch 16 at the longest horizon, takes oneDNN and may round
apart). With AMX tiles oneDNN multiplies there (not measured against the kernel yet).
``VERICACHE_LINEAR`` (``auto``, ``kernel``, ``blas``) overrides the choice for bf16 weights (A/B runs).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F

from . import kernels

Tensor = torch.Tensor

# Rows up to which the kernel runs: a verify block of the default horizon's longest (64 drafts, 65
# tokens) at batch 16, so that every verify block computes its tokens' linear layers as their
# decode steps do (an 8k / batch-8 greedy run whose looping requests reached L = 34 and 40 took
# oneDNN there, above the earlier 256, and 3 of 8 outputs left full-KV decoding at margins of
# 0-0.25). Prefill chunks (256 tokens by default) take it too. Above, the BLAS's blocking wins: it
# is 12% / 16% / 27% faster at 280 / 520 / 1040 bf16 rows on the AVX-512 host, which those rare long
# verify blocks now pay; on AVX2 the kernel leads in fp32 and bf16 up to 256 rows (docs/benchmarks.md).
MAX_ROWS = 1040


@functools.cache
def _bf16_arithmetic() -> bool:
    """The CPU multiplies bf16 itself (AVX512-BF16 or AMX): bf16 weights then need no widening."""
    flags = kernels._cpu_flags().split()
    return "avx512_bf16" in flags or "amx_bf16" in flags


@functools.cache
def _amx() -> bool:
    return "amx_bf16" in kernels._cpu_flags().split()


LINEAR_PATHS = ("auto", "kernel", "blas")


def bf16_path(mod) -> str:
    """Where bf16 weights are multiplied (the module's docstring): ``kernel`` or ``blas``, ``auto`` the
    kernel where the CPU has no bf16 arithmetic, or has AVX512-BF16 (``mod.bf16_dot``) and no AMX."""
    choice = os.environ.get("VERICACHE_LINEAR", "auto")
    if choice not in LINEAR_PATHS:
        raise ValueError(f"VERICACHE_LINEAR must be one of {', '.join(LINEAR_PATHS)}, got {choice!r}")
    if choice != "auto":
        return choice
    if not _bf16_arithmetic():
        return "kernel"
    return "kernel" if mod.bf16_dot and not _amx() else "blas"


def kernel_for(x: Tensor, weight: Tensor):
    """The kernel's module where it takes ``x [N, in]`` (any N) and ``weight``, else ``None``:
    CPU tensors of one dtype, fp32 or bf16 (bf16: where :func:`bf16_path` says ``kernel``); ``in``
    a multiple of the vector width."""
    if (x.device.type != "cpu" or weight.device.type != "cpu" or x.dim() != 2 or x.dtype != weight.dtype
            or not weight.is_contiguous() or weight.dtype not in (torch.float32, torch.bfloat16)):
        return None
    mod = kernels.build("linear")
    if mod is None or x.shape[1] % mod.vec_width != 0:
        return None
    return mod if weight.dtype == torch.float32 or bf16_path(mod) == "kernel" else None


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear(x, weight, bias)`` for ``x [N, in]``, in ``x``'s dtype (float32 accumulation)."""
    mod = kernel_for(x, weight)
    if mod is not None and x.shape[0] <= MAX_ROWS:
        if bias is None:
            return mod.linear(x.contiguous(), weight)  # x's dtype out: no conversions around the call
        y = mod.linear(x.contiguous(), weight, float_out=True)  # the bias added to the float sums, rounded once
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
