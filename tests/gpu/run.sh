#!/usr/bin/env bash
# The one script for the GPU machine (see tests/gpu/gpu_run.py for what each mode does):
#   bash tests/gpu/run.sh --fetch     here, before a device call: carried wheels into .gpu-wheels/
#   bash tests/gpu/run.sh             on the device (carry .gpu-wheels): tests + profiles -> $OUT (<= 8 files)
#   bash tests/gpu/run.sh --dry-run   CPU rehearsal of the same path; CI runs it
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=$(command -v python3 || command -v python)
exec "$PY" tests/gpu/gpu_run.py "$@"
