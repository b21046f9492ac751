"""The package's C++ CPU kernels, compiled on first use with ``torch.utils.cpp_extension``.

A C++ compiler and Python headers are needed (about half a minute per kernel here, cached under
``~/.cache/torch_extensions`` per source, header and CPU flags). Where a kernel cannot be built,
:func:`build` returns ``None`` once with a warning and callers take their PyTorch path (slower,
same tokens). ``VERICACHE_NO_KERNELS=1`` turns every kernel off.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_DIR = Path(__file__).parent
# Vectorized float reductions need reassociation; no -ffast-math (the kernels rely on -inf).
_CFLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fassociative-math", "-fno-signed-zeros",
           "-fno-trapping-math", "-fopenmp"]
# Per kernel, after _CFLAGS. linear: its sums stay in the order written (each output one fixed
# order whatever the rows beside it; its vectors are explicit, nothing needs reassociation).
_KERNEL_CFLAGS = {"linear": ["-fno-associative-math"]}


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


@functools.cache
def build(name: str, vec_width: int | None = None, source: Path | None = None) -> Any | None:
    """The compiled module of ``kernels/<name>.cpp`` (or of ``source``, another C++ file built the
    same way, e.g. a benchmark's probe), or ``None`` where it cannot be built.

    ``vec_width`` (4, 8 or 16 floats) overrides the vector width the kernels take from the CPU
    (``common.h``): tests build the other widths' code on one machine (slower there, same results)."""
    if os.environ.get("VERICACHE_NO_KERNELS"):
        logger.info("VERICACHE_NO_KERNELS is set: %s kernel off", name)
        return None
    path = os.environ.get("PATH", "")
    source = Path(source) if source is not None else _DIR / f"{name}.cpp"
    try:
        from torch.utils.cpp_extension import load

        # The build runs `ninja`: the pip one sits beside this interpreter, which a venv run without
        # activation does not have on its PATH.
        os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), path])
        # -march=native: the build is only valid on this kind of CPU, so its flags name it.
        cflags = _CFLAGS + _KERNEL_CFLAGS.get(name, []) + ([f"-DVERICACHE_VEC_WIDTH={int(vec_width)}"] if vec_width else [])
        parts = [source.read_bytes(), *(h.read_bytes() for h in sorted(_DIR.glob("*.h"))),
                 " ".join(cflags).encode(), _cpu_flags().encode()]
        tag = hashlib.sha256(b"\0".join(parts)).hexdigest()[:12]
        return load(name=f"vericache_{name}_{tag}", sources=[str(source)], extra_cflags=cflags,
                    extra_ldflags=["-fopenmp"], verbose=False)
    except Exception as e:  # no compiler, no headers, a build error: fall back, say so once
        logger.warning("%s kernel unavailable, using the PyTorch path: %s", name, e)
        return None
    finally:
        os.environ["PATH"] = path
