#!/usr/bin/env bash
# Set up (venv, requirements, Debian's Chromium for the browser tests) and run the tests.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/test_manager.py -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
# one data dir for the whole run, so demo models are built once
export LORA_STUDIO_TEST_HOME=${LORA_STUDIO_TEST_HOME:-$(mktemp -d -t lora-studio-tests.XXXXXX)}
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
