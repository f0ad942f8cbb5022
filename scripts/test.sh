#!/usr/bin/env bash
# Set up (venv, requirements, Debian's Chromium for the browser tests) and run a tier of the tests:
#   bash scripts/test.sh            the default tier: everything but the slow checks (CI's first step)
#   bash scripts/test.sh --quick    the inner loop: no served app, browser or Ray cluster (about 3 min)
#   bash scripts/test.sh --slow     the exhaustive checks marked slow (CI's second step)
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/test_manager.py -x` (a later `-m` wins).
set -euo pipefail
cd "$(dirname "$0")/.."
tier=default
case "${1:-}" in
  --quick) tier=quick; shift ;;
  --slow) tier=slow; shift ;;
esac
bash scripts/setup.sh
if [ "$tier" != quick ] && [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
fi
# one data dir for the whole run, so demo models are built once
export LORA_STUDIO_TEST_HOME=${LORA_STUDIO_TEST_HOME:-$(mktemp -d -t lora-studio-tests.XXXXXX)}
# the default and quick tiers on two pytest workers (pytest-xdist; a module stays on one worker, so its
# served app is started once); the slow tier alone, since each of its Ray clusters wants the whole machine
workers=${LORA_STUDIO_TEST_WORKERS:-2}
case "$tier" in
  quick) marks="not slow and not served"; par=(-n "$workers" --dist loadfile) ;;
  slow) marks="slow"; par=() ;;
  *) marks="not slow"; par=(-n "$workers" --dist loadfile) ;;
esac
[ "$workers" = 1 ] && par=()
started=$(date +%s)
set +e
.venv/bin/python -m pytest -q -m "$marks" "${par[@]}" "$@"
rc=$?
set -e
echo "scripts/test.sh: the $tier tier took $(( $(date +%s) - started )) s of pytest (set-up not counted)"
# pytest's 5: nothing selected (e.g. no slow test under the paths given) is not a failure of the tier
[ "$rc" = 5 ] && rc=0
exit "$rc"
