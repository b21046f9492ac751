#!/usr/bin/env bash
# The prepared GPU check: one run on a bare CUDA machine, at most GPU_CHECK_BUDGET_S (470 s) from start
# to last line. Run from anywhere:  bash benchmarks/gpu/check.sh   (README.md here)
#
# Two installs. Online (PyPI reachable): a venv with PyPI's CUDA vLLM 0.32.0 and the package. Offline
# (no registry answers, or GPU_CHECK_OFFLINE=1; e.g. a lent GPU machine that reaches nothing): the
# image's own python3 and torch, wheels carried in .whl/ (blake3: `pip download` it for the image's
# Python) put on PYTHONPATH with the repo; the vllm stage is skipped (no vLLM, no model there) and
# the engine stage runs SmolLM2's shape with random weights (the model does not travel).
#
# Stages, in order, each with its own time limit: install, facts, pcie, tests (pytest -m gpu), attention
# (the kernel table), draft_step (the engine's draft step against its full step), vllm, engine. Each
# prints exactly one JSON line on stdout, also appended to $OUT/gpu_check.jsonl ($OUT defaults to
# benchmarks/results/gpu); its log is $OUT/<stage>.log. A failed stage does not stop the next.
# A stage's limit is what is left of the budget less the nominal seconds of the stages after it (so
# slack left by a fast stage goes to later ones), at most twice its nominal; with under 10 s it is
# skipped with a line saying so.
#
# GPU_CHECK_VLLM_ARGS: more options for the vllm stage (benchmarks/gpu/vllm_decode.py --help).
# GPU_CHECK_DRY_RUN=1: no install (GPU_CHECK_PYTHON, default python3, must have the package), every
# stage in its --dry-run mode; on a CPU host facts and pcie report "no CUDA" (ok: false).
set -u
cd "$(dirname "$0")/../.."
export OUT=${OUT:-benchmarks/results/gpu}
mkdir -p "$OUT"
: > "$OUT/gpu_check.jsonl"
DRY=${GPU_CHECK_DRY_RUN:-0}
VENV=${GPU_CHECK_VENV:-/tmp/vericache-gpu-venv}
SYS_PY=$(command -v python3)
G=benchmarks/gpu
NAMES=(install facts pcie tests attention draft_step vllm engine)
NOMINAL=(150 10 20 60 45 30 85 70)  # seconds; online, they sum to the default budget (470: 8 minutes with slack)
BUDGET=470
OFFLINE=${GPU_CHECK_OFFLINE:-}
if [[ -z $OFFLINE && $DRY != 1 ]]; then
  "$SYS_PY" -c "import urllib.request as u; u.urlopen('https://pypi.org/simple/pip/', timeout=5)" 2>/dev/null \
    && OFFLINE=0 || OFFLINE=1
fi
if [[ $DRY == 1 ]]; then PY=${GPU_CHECK_PYTHON:-python3}; FLAG=--dry-run
elif [[ $OFFLINE == 1 ]]; then PY=$SYS_PY; FLAG=; NOMINAL=(20 10 20 60 100 120 0 120); BUDGET=470  # 450 + slack
else PY=$VENV/bin/python; FLAG=; fi
BUDGET=${GPU_CHECK_BUDGET_S:-$BUDGET}
START=$SECONDS

# limit NAME: seconds this stage may take now (see the header)
limit() {
  local i reserve=0 after=0 cap=0
  for i in "${!NAMES[@]}"; do
    ((after)) && reserve=$((reserve + NOMINAL[i]))
    if [[ ${NAMES[i]} == "$1" ]]; then after=1; cap=$((2 * NOMINAL[i])); fi
  done
  local left=$((BUDGET - (SECONDS - START) - reserve))
  echo $((left < cap ? left : cap))
}

# stage NAME CMD...: run CMD under the stage's limit through common.py wrap (exactly one line)
stage() {
  local name=$1 lim
  shift
  lim=$(limit "$name")
  if ((lim < 10)); then
    "$SYS_PY" $G/common.py emit --stage "$name" --skipped "budget: ${lim} s left for it"
    return
  fi
  echo "[check +$((SECONDS - START)) s] $name (limit ${lim} s)" >&2
  "$SYS_PY" $G/common.py wrap --stage "$name" --timeout "$lim" --log "$OUT/$name.log" -- "$@"
}

if [[ $DRY == 1 ]]; then
  "$SYS_PY" $G/common.py emit --stage install --skipped "dry run: $PY"
elif [[ $OFFLINE == 1 ]]; then
  export PYTHONPATH=/tmp/vericache-site:$PWD${PYTHONPATH:+:$PYTHONPATH}
  stage install bash $G/install.sh --offline /tmp/vericache-site
else
  stage install bash $G/install.sh "$VENV"
  [[ -x $PY ]] || PY=$SYS_PY  # failed install: later stages still report (their errors)
fi
stage facts "$PY" $G/facts.py $FLAG
stage pcie "$PY" $G/pcie.py $FLAG
stage tests "$PY" $G/gpu_tests.py $FLAG
if [[ -f $G/attention.py ]]; then
  stage attention "$PY" $G/attention.py --json $FLAG
else
  "$SYS_PY" $G/common.py emit --stage attention --error "benchmarks/gpu/attention.py missing"
fi
# the drivers must end before the stage's limit kills them (the engines run in their own sessions)
stage draft_step "$PY" $G/draft_step.py --budget-s $(($(limit draft_step) - 10)) $FLAG
# shellcheck disable=SC2086  # GPU_CHECK_VLLM_ARGS: more vllm_decode.py options, e.g. "--feature-batches 32,64"
if [[ $OFFLINE == 1 ]]; then  # the stage serves SmolLM2, which an offline machine cannot fetch
  "$SYS_PY" $G/common.py emit --stage vllm --skipped "offline: no registry for vLLM or the model"
else
  stage vllm "$PY" $G/vllm_decode.py --budget-s $(($(limit vllm) - 15)) $FLAG ${GPU_CHECK_VLLM_ARGS:-}
fi
ENGINE_MODEL=smollm2; [[ $OFFLINE == 1 ]] && ENGINE_MODEL=random-smollm2
stage engine "$PY" $G/engine_cuda.py --model $ENGINE_MODEL --budget-s $(($(limit engine) - 5)) $FLAG
echo "[check +$((SECONDS - START)) s] done; lines in $OUT/gpu_check.jsonl" >&2
