#!/usr/bin/env bash
# The GPU check: run on a machine with one CUDA GPU, torch, transformers and triton, and no package registry,
# from the repository root, with the bundle scripts/gpu_bundle.sh made (carry build/gpu-bundle along). About
# 5 minutes on one H200. It installs the bundle's wheels and steerkit (editable, no dependencies, nothing
# downloaded), then runs
#   1. the tests marked `device` on cuda (STEERKIT_TEST_DEVICE=cuda: the bfloat16 equalities, on random weights in
#      the default model's configuration: the bundle's skeleton, its config.json and tokenizer);
#   2. benchmarks/gpu_kernels.py --quick (the fused kernel vs a device copy and eager torch);
#   3. benchmarks/gpu_steer_graph.py (the steering operator inside a CUDA-graph replay);
#   4. benchmarks/bench_real_size.py --device cuda --only 1b (Llama-3.2-1B's shape in bfloat16: load, record,
#      steered vs unsteered decode, a patching grid, beside plain transformers);
#   5. benchmarks/bench_tune.py and bench_refusal.py --device cuda --quick on random weights in the default
#      model's shape: the batched tuning grid and refusal scoring vs cell by cell / one prompt at a time.
# Results go to $OUT (default build/gpu-check): the test log and the CSVs. GPU_CHECK_SMOKE=1 runs the same steps on
# the CPU at toy sizes (checks the script itself).
# Usage: bash scripts/gpu_check.sh [BUNDLE]      (default build/gpu-bundle)
set -uo pipefail
cd "$(dirname "$0")/.."
BUNDLE=$(cd "${1:-build/gpu-bundle}" && pwd) || { echo "gpu_check: no bundle at ${1:-build/gpu-bundle}" >&2; exit 2; }
OUT=${OUT:-build/gpu-check}
PY=${PYTHON:-python}
mkdir -p "$OUT"
SMOKE=${GPU_CHECK_SMOKE:-0}
status=0
step() {  # name, command...: run one step, log it, remember a failure and go on
  local name=$1; shift
  echo "== $name: $*" | tee -a "$OUT/gpu_check.log"
  local t0=$SECONDS
  "$@" >>"$OUT/gpu_check.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc in $((SECONDS - t0)) s" | tee -a "$OUT/gpu_check.log"
  [ $rc -eq 0 ] || status=1
}
: >"$OUT/gpu_check.log"
$PY -c "import torch, transformers; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', \
torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, 'transformers', transformers.__version__)" \
  | tee -a "$OUT/gpu_check.log"
step install $PY -m pip install -q --no-index --find-links "$BUNDLE/wheels" jaxtyping wadler_lindig gguf pyyaml \
  pytest pluggy iniconfig pygments psutil setuptools wheel
step install-steerkit $PY -m pip install -q --no-index --no-deps --no-build-isolation -e .
export STEERKIT_TEST_TOKENIZER="$BUNDLE/skeleton" HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
if [ "$SMOKE" = 1 ]; then
  export STEERKIT_TEST_DEVICE=cpu
  step device-tests $PY -m pytest -q -p no:cacheprovider -m device tests/core/test_bfloat16.py
  step gpu-kernels env TRITON_INTERPRET=1 $PY benchmarks/gpu_kernels.py --smoke --out "$OUT/gpu_kernels.csv"
  step gpu-steer-graph $PY benchmarks/gpu_steer_graph.py --smoke --out "$OUT/gpu_steer_graph.csv"
  step real-size $PY benchmarks/bench_real_size.py --quick --skip-3b --tokenizer "$STEERKIT_TEST_TOKENIZER" \
    --work "${TMPDIR:-/tmp}/steerkit-real-size" --out "$OUT/real_size.csv"
  step tune $PY benchmarks/bench_tune.py --quick --layers 1 --scales 2 --skeleton "$STEERKIT_TEST_TOKENIZER" \
    --out "$OUT/tune.csv"
  step refusal $PY benchmarks/bench_refusal.py --quick --skeleton "$STEERKIT_TEST_TOKENIZER" \
    --out "$OUT/refusal_scoring.csv"
else
  export STEERKIT_TEST_DEVICE=cuda
  step device-tests $PY -m pytest -q -p no:cacheprovider -m device tests/core/test_bfloat16.py
  step gpu-kernels $PY benchmarks/gpu_kernels.py --quick --out "$OUT/gpu_kernels.csv"
  step gpu-steer-graph $PY benchmarks/gpu_steer_graph.py --dtype bfloat16 --out "$OUT/gpu_steer_graph.csv"
  step real-size $PY benchmarks/bench_real_size.py --device cuda --only 1b --tokenizer "$STEERKIT_TEST_TOKENIZER" \
    --work "${TMPDIR:-/tmp}/steerkit-real-size" --out "$OUT/real_size_cuda.csv"
  rm -rf "${TMPDIR:-/tmp}/steerkit-real-size"
  step tune $PY benchmarks/bench_tune.py --device cuda --clock wall --quick --skeleton "$STEERKIT_TEST_TOKENIZER" \
    --out "$OUT/tune_cuda.csv"
  step refusal $PY benchmarks/bench_refusal.py --device cuda --quick --skeleton "$STEERKIT_TEST_TOKENIZER" \
    --out "$OUT/refusal_scoring_cuda.csv"
fi
grep "^== " "$OUT/gpu_check.log"
exit $status
