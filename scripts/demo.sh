#!/usr/bin/env bash
# Set up (if needed) and run the demo pipeline on the embedded default model.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/steerkit demo "$@"
