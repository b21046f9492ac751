"""The package's C++ CPU kernels, compiled on first use with ``torch.utils.cpp_extension``.

A C++ compiler and Python headers are needed. Each build takes tens of seconds and is cached
outside the repository, under ``$TORCH_EXTENSIONS_DIR`` (default ``~/.cache/torch_extensions``),
in a folder named after a hash of the source, the headers, the compiler flags and the CPU's flags;
``vericache build-kernels`` builds them all ahead, :func:`is_built` tells whether one is there.
Where a kernel cannot be built, :func:`build` returns ``None`` once with a warning and callers take
their PyTorch path (slower, same tokens). ``VERICACHE_NO_KERNELS=1`` turns every kernel off.
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
# token_ops: no product fused into a sum (rotary embedding rounds as PyTorch's separate ops do).
_KERNEL_CFLAGS = {"linear": ["-fno-associative-math"], "token_ops": ["-ffp-contract=off"]}
# A build happens once per CPU and source version; without a word a first run looks hung.
NOTICE = ("vericache: building the C++ kernels for this CPU (first use, about a minute; "
          "'vericache build-kernels' does it ahead)")
_noticed = False


def names() -> list[str]:
    """The kernels of this package (``kernels/<name>.cpp``), the names :func:`build` takes."""
    return sorted(p.stem for p in _DIR.glob("*.cpp"))


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _cflags(name: str, vec_width: int | None) -> list[str]:
    return _CFLAGS + _KERNEL_CFLAGS.get(name, []) + ([f"-DVERICACHE_VEC_WIDTH={int(vec_width)}"] if vec_width else [])


def _source(name: str, source: Path | None) -> Path:
    return Path(source) if source is not None else _DIR / f"{name}.cpp"


def module_name(name: str, vec_width: int | None = None, source: Path | None = None) -> str:
    """The extension's name, ``vericache_<name>_<hash>``: a changed source, header, flag or CPU is
    another name, hence another build, never a stale one (-march=native code is only valid on
    this kind of CPU)."""
    parts = [_source(name, source).read_bytes(), *(h.read_bytes() for h in sorted(_DIR.glob("*.h"))),
             " ".join(_cflags(name, vec_width)).encode(), _cpu_flags().encode()]
    digest = hashlib.sha256(b"\0".join(parts)).hexdigest()[:12]
    return f"vericache_{name}_{digest}"


def build_dir(module: str) -> Path:
    """The folder torch's ``load`` builds ``module`` in, computed as torch does, without creating it."""
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        accel = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip else
                 f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
        python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
        root = os.path.join(get_default_build_root(), f"{python}_{accel}")
    return Path(root) / module


def is_built(name: str, vec_width: int | None = None, source: Path | None = None) -> bool:
    """Whether the kernel's compiled library is in the cache (loading it then takes no compiler)."""
    module = module_name(name, vec_width, source)
    return (build_dir(module) / f"{module}.so").is_file()


def load(name: str, vec_width: int | None = None, source: Path | None = None) -> Any:
    """Compile (unless cached) and import the kernel; raises what the build raises. Not cached
    per process: callers go through :func:`build`."""
    from torch.utils.cpp_extension import load as torch_load

    module = module_name(name, vec_width, source)
    directory = build_dir(module)
    directory.mkdir(parents=True, exist_ok=True)
    path = os.environ.get("PATH", "")
    # The build runs `ninja`: the pip one sits beside this interpreter, which a venv run without
    # activation does not have on its PATH.
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), path])
    try:
        return torch_load(name=module, sources=[str(_source(name, source))], extra_cflags=_cflags(name, vec_width),
                          extra_ldflags=["-fopenmp"], build_directory=str(directory), verbose=False)
    finally:
        os.environ["PATH"] = path


@functools.cache
def build(name: str, vec_width: int | None = None, source: Path | None = None) -> Any | None:
    """The compiled module of ``kernels/<name>.cpp`` (or of ``source``, another C++ file built the
    same way, e.g. a benchmark's probe), or ``None`` where it cannot be built.

    ``vec_width`` (4, 8 or 16 floats) overrides the vector width the kernels take from the CPU
    (``common.h``): tests build the other widths' code on one machine (slower there, same results)."""
    global _noticed
    if os.environ.get("VERICACHE_NO_KERNELS"):
        logger.info("VERICACHE_NO_KERNELS is set: %s kernel off", name)
        return None
    try:
        if not _noticed and not is_built(name, vec_width, source):
            # print, not the logger: no CLI configures logging, and this line is for the user.
            print(NOTICE, file=sys.stderr, flush=True)
            _noticed = True
        return load(name, vec_width, source)
    except Exception as e:  # no compiler, no headers, a build error: fall back, say so once
        logger.warning("%s kernel unavailable, using the PyTorch path: %s", name, e)
        return None
