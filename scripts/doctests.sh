#!/usr/bin/env bash
# Run the docstring examples of the public modules as doctests (pytest --doctest-modules).
#   bash scripts/doctests.sh                          # every module in scripts/doctest_modules.txt
#   bash scripts/doctests.sh steerkit.probes.sweep    # only these modules (dotted names); pytest options after --
# The modules are imported by their installed names (conftest.py); the names doctests may use without
# importing (sm, tiny, tmp_dir, store, ...) are listed in conftest.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
# the examples are small: one intra-op thread each is as fast, and does not oversubscribe shared cores
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
# the examples choose their kernel implementation themselves: an interpreter switch from the caller's
# environment (the test suite sets one) would change what they show
unset TRITON_INTERPRET
modules=()
while [ $# -gt 0 ] && [ "$1" != "--" ]; do modules+=("$1"); shift; done
[ "${1:-}" = "--" ] && shift
if [ ${#modules[@]} -eq 0 ]; then
  mapfile -t modules < <(grep -v '^\s*#' scripts/doctest_modules.txt | grep -v '^\s*$')
fi
# each module's source file (a package's __init__.py: only that file, not the package's other modules)
origins=$("$PY" - "${modules[@]}" <<'PYEOF'
import importlib.util
import sys

for name in sys.argv[1:]:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.origin:
        sys.exit(f"doctests.sh: expected an importable module, found no module {name!r}")
    print(spec.origin)
PYEOF
)
mapfile -t files <<<"$origins"
exec "$PY" -m pytest -q -p no:cacheprovider --doctest-modules \
  -o doctest_optionflags="ELLIPSIS NORMALIZE_WHITESPACE NUMBER" "${files[@]}" "$@"
