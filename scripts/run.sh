#!/usr/bin/env bash
# Set up (first run only) and start LoRA Studio on the embedded default model.
# Extra arguments go to app.py, e.g. `bash scripts/run.sh demo:wan2.2-t2v --port 8000`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python app.py "$@"
