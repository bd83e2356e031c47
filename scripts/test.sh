#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite; pytest's arguments pass through
# (`bash scripts/test.sh tests/core/test_core.py -x`). Prints where the time went: the set-up, the suite and the
# slowest tests.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
STEERKIT_SETUP_EXTRAS=engines bash scripts/setup.sh
# the app's browser test drives Debian's chromium through Playwright (never `playwright install`)
if [ ! -x /usr/bin/chromium ] && [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null; then
  (apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium) >/dev/null \
    || echo "test.sh: could not install chromium; the browser test will be skipped" >&2
fi
setup=$((SECONDS - start))
echo "test.sh: set-up took ${setup} s"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
status=0
.venv/bin/python -m pytest -q -p no:cacheprovider --durations=25 "$@" || status=$?
echo "test.sh: set-up ${setup} s, suite $((SECONDS - start - setup)) s, total $((SECONDS - start)) s"
exit $status
