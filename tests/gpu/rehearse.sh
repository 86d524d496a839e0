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
# Steps 1-4 run for each device image in FASTKIT_REHEARSAL_IMAGES (default "old new"): "old" is the bare image
# above; "new" is the package list read on 2026-11-17 (the same plus pyarrow, pandas, xxhash, matplotlib,
# pytest-timeout, huggingface_hub 1.33), where the carried datasets + TRL import, so bench-sft (the whole TRL
# step) must run: rehearsal_check.py --expect-trl fails if it was skipped.
set -euo pipefail
cd "$(dirname "$0")/../.."
REH=${FASTKIT_REHEARSAL_DIR:-/tmp/fastkit-rehearsal}
DEVICE_SET_old="torch==2.11.0 transformers==5.17.0 huggingface_hub==1.5.0 peft accelerate numpy pytest"
DEVICE_SET_new="torch==2.11.0 transformers==5.17.0 huggingface_hub==1.33.0 peft accelerate numpy pytest pyarrow pandas \
xxhash matplotlib pytest-timeout"
IMAGES=${FASTKIT_REHEARSAL_IMAGES:-old new}
t0=$(date +%s)
PY=""
for cand in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.12*/bin/python3.12 "$(command -v python3.12 || true)" \
            "$(command -v python3.11 || true)" "$(command -v python3)"; do
    if [ -n "$cand" ] && "$cand" -c 'import venv' 2>/dev/null; then PY=$cand; break; fi
done
PYV=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
mkdir -p "$REH"
rehearse_image() {  # $1: old | new -- one device image: its venv, the device command, the check
    local image=$1 set venv out rc expect=()
    set=$(eval echo "\$DEVICE_SET_$image")
    venv="$REH/venv-$image" out="$REH/out-$image"
    if [ "$(cat "$venv/.device-set" 2>/dev/null)" != "$PYV $set" ]; then
        rm -rf "$venv"
        "$PY" -m venv "$venv"
        # shellcheck disable=SC2086
        "$venv/bin/python" -m pip install -q --disable-pip-version-check $set
        echo "$PYV $set" > "$venv/.device-set"
    fi
    echo "rehearsal env ($image image): python $PYV, $("$venv/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)') ($(( $(date +%s) - t0 )) s)"
    rm -rf "$out"
    set +e
    env -u VIRTUAL_ENV -u PYTHONPATH PATH="$venv/bin:/usr/bin:/bin" OUT="$out" FASTKIT_GPU_WORK="$REH/work-$image" \
        unshare -n bash tests/gpu/run.sh
    rc=$?
    set -e
    [ "$image" = new ] && expect=(--expect-trl)
    python tests/gpu/rehearsal_check.py "$out" "$rc" "${expect[@]}"
}
python tests/gpu/gpu_run.py --fetch --python-version "$PYV"
for image in $IMAGES; do rehearse_image "$image"; done
FLOOR=${IMAGES%% *}  # the floor runs once, in the first image's environment
echo "floor: core patch tests on torch 2.11 + carried transformers 5.24"
env -u VIRTUAL_ENV PYTHONPATH="$REH/work-$FLOOR/core/site-packages:$PWD" HF_HUB_OFFLINE=1 unshare -n "$REH/venv-$FLOOR/bin/python" -m pytest -q -p no:cacheprovider \
    tests/test_packing.py tests/test_offload.py tests/test_moe.py tests/test_patching.py tests/test_syncs.py
echo "rehearsal ok ($(( $(date +%s) - t0 )) s)"
