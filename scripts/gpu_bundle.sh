#!/usr/bin/env bash
# Prepare, on this machine, what scripts/gpu_check.sh needs on a GPU machine that has torch, transformers and
# triton but no package registry: the wheels of steerkit's light dependencies (pure Python, the versions this
# .venv runs, with pytest's and the build backend's) and the default model's skeleton: its config.json and
# tokenizer files, no weights (the default model itself, 89 MiB as a GGUF, does not travel: the device tests and
# the default-model benchmarks run on random weights in its configuration).
# Usage: bash scripts/gpu_bundle.sh [OUT]        (default build/gpu-bundle; prints its size, well under 64 MiB)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-build/gpu-bundle}
PY=.venv/bin/python
rm -rf "$OUT"
mkdir -p "$OUT/wheels" "$OUT/skeleton"
pins=$($PY - <<'PY'
import importlib.metadata as m
names = ["jaxtyping", "wadler_lindig", "gguf", "pyyaml", "pytest", "pluggy", "iniconfig", "pygments",
         "setuptools", "wheel", "psutil"]
out = []
for n in names:
    try:
        out.append(f"{n}=={m.version(n)}")
    except m.PackageNotFoundError:
        if n == "wheel":
            out.append("wheel")
print(" ".join(out))
PY
)
# every wheel for this Python; pyyaml and psutil are platform wheels for CPython on x86-64 Linux: pyyaml also
# for the other Pythons the GPU machine may run (pip there takes the one that fits)
$PY -m pip download -q --no-deps -d "$OUT/wheels" $pins
yaml=$(echo "$pins" | tr ' ' '\n' | grep '^pyyaml')
for v in 3.10 3.12 3.13; do
  $PY -m pip download -q --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 --python-version "$v" -d "$OUT/wheels" "$yaml" \
    || echo "gpu_bundle: no $yaml wheel for Python $v" >&2
done
$PY - "$OUT/skeleton" <<'PY'
import sys
import steerkit
sm = steerkit.load_model()
sm.tokenizer.save_pretrained(sys.argv[1])
sm.hf_model.config.save_pretrained(sys.argv[1])
PY
du -sh "$OUT"
ls "$OUT/wheels"
