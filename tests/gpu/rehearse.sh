#!/usr/bin/env bash
# CI's rehearsal of the device run, as faithful as this machine allows (replaces the old dry run):
#   1. a fresh virtual environment holding ONLY the GPU machine's package set: Python 3.12 (3.11 where no
#      3.12 is found), torch 2.11 (the cu130 build, which runs on CPU), transformers 5.17, the oldest
#      huggingface_hub that 5.17 accepts, peft, accelerate, numpy, pytest. No trl, datasets, pyarrow,
#      pandas, xxhash, matplotlib, bitsandbytes or pytest-timeout.
#   2. the carried wheels fetched here for that interpreter, as before a device call (`--fetch`);
#   3. the device command exactly as the device runs it (`bash tests/gpu/run.sh`, same argv, install path
#      and folders), with no network at all (`unshare -n`) and no virtual environment activated;
#   4. tests/gpu/rehearsal_check.py reads what came back in $OUT: only "no CUDA" may have stopped anything;
#   5. the floor: the core patch tests on the lowest torch pyproject admits (2.11) with the carried
#      transformers 5.24 (the lowest it admits), in the same environment.
set -euo pipefail
cd "$(dirname "$0")/../.."
REH=${FASTKIT_REHEARSAL_DIR:-/tmp/fastkit-rehearsal}
DEVICE_SET="torch==2.11.0 transformers==5.17.0 huggingface_hub==1.5.0 peft accelerate numpy pytest"
t0=$(date +%s)
PY=""
for cand in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 "$(command -v python3.12 || true)" \
            "$(command -v python3.11 || true)" "$(command -v python3)"; do
    if [ -n "$cand" ] && "$cand" -c 'import venv' 2>/dev/null; then PY=$cand; break; fi
done
PYV=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
mkdir -p "$REH"
if [ "$(cat "$REH/venv/.device-set" 2>/dev/null)" != "$PYV $DEVICE_SET" ]; then
    rm -rf "$REH/venv"
    "$PY" -m venv "$REH/venv"
    # shellcheck disable=SC2086
    "$REH/venv/bin/python" -m pip install -q --disable-pip-version-check $DEVICE_SET
    echo "$PYV $DEVICE_SET" > "$REH/venv/.device-set"
fi
echo "rehearsal env: python $PYV, $("$REH/venv/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)') ($(( $(date +%s) - t0 )) s)"
python tests/gpu/gpu_run.py --fetch --python-version "$PYV"
rm -rf "$REH/out"
set +e
env -u VIRTUAL_ENV -u PYTHONPATH PATH="$REH/venv/bin:/usr/bin:/bin" OUT="$REH/out" FASTKIT_GPU_WORK="$REH/work" \
    unshare -n bash tests/gpu/run.sh
rc=$?
set -e
python tests/gpu/rehearsal_check.py "$REH/out" "$rc"
echo "floor: core patch tests on torch 2.11 + carried transformers 5.24"
env -u VIRTUAL_ENV PYTHONPATH="$REH/work/core/site-packages:$PWD" HF_HUB_OFFLINE=1 unshare -n "$REH/venv/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_packing.py tests/test_offload.py tests/test_moe.py tests/test_patching.py tests/test_syncs.py
echo "rehearsal ok ($(( $(date +%s) - t0 )) s)"
