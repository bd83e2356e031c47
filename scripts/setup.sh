#!/usr/bin/env bash
# Create the development environments from the committed locks (scripts/lock.sh refreshes them):
#   .venv           locks/venv.txt (with STEERKIT_SETUP_EXTRAS=engines also locks/venv-engines.txt: llama.cpp)
#   .venv-vllm      locks/venv-vllm.txt      (STEERKIT_SETUP_EXTRAS=engines)
#   .venv-saelens   locks/venv-saelens.txt   (STEERKIT_SETUP_EXTRAS=engines)
#   .venv-circuit-tracer  locks/venv-circuit-tracer.txt  (STEERKIT_SETUP_EXTRAS=engines; without steerkit)
# Each ends up holding exactly its locks' packages, then steerkit, editable, without dependencies (not where
# EDITABLE=no). Idempotent: a second run with unchanged locks only checks them.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

# sync ENV LOCK...: install the locks' packages into ENV, remove what no lock names (nor $KEEP), install steerkit
sync_env() {
  local env=$1; shift
  [ -x "$env/bin/python" ] || "$PY" -m venv "$env"
  local pip=("$env/bin/python" -m pip --disable-pip-version-check -q)
  "${pip[@]}" install --no-deps "$(grep -h '^pip==' "$@" | head -1)"
  local req=(); for lock in "$@"; do req+=(-r "$lock"); done
  "${pip[@]}" install --no-deps "${req[@]}"
  "$env/bin/python" scripts/lockcheck.py --prune "$@" ${KEEP:-}
  [ "${EDITABLE:-yes}" = yes ] || return 0
  # setuptools notes that an editable install by a finder can be shadowed by same-named folders: steerkit/_rootnames.py
  PYTHONWARNINGS="ignore:Editable installation" "${pip[@]}" install --no-deps --no-build-isolation -e .
}

if [ "${STEERKIT_SETUP_EXTRAS:-}" = "engines" ]; then
  sync_env .venv locks/venv.txt locks/venv-engines.txt
  sync_env .venv-vllm locks/venv-vllm.txt
  sync_env .venv-saelens locks/venv-saelens.txt
  EDITABLE=no sync_env .venv-circuit-tracer locks/venv-circuit-tracer.txt   # the cross-checks' driver needs no steerkit
else
  KEEP=locks/venv-engines.txt sync_env .venv locks/venv.txt   # llama.cpp, where an engines set-up installed it, stays
fi
