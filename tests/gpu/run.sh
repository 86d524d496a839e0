#!/usr/bin/env bash
# The one script for the device machine (one H200): GPU-marked tests + GPU benchmark profiles.
# Results go under $OUT (default ./gpu-results). Each step has its own time cap so one slow step
# cannot eat the whole device budget; a failing step is recorded and the script goes on.
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-gpu-results}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
python -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))" | tee "$OUT/device.txt"
python -m pip install -q -e ".[test]" --no-deps 2>&1 | tail -1

step() {  # step NAME SECONDS CMD...
    local name=$1 secs=$2; shift 2
    echo "== $name" | tee -a "$OUT/summary.txt"
    timeout "$secs" "$@" >"$OUT/$name.log" 2>&1
    echo "   rc=$?" | tee -a "$OUT/summary.txt"
}

step gpu-tests 240 python -m pytest -m gpu tests/gpu -q -x --junitxml="$OUT/gpu-tests.xml"
step bench-packed 90 python -m fastkit.cli bench packed --gpu --out "$OUT"
step bench-offload 90 python -m fastkit.cli bench offload --gpu --out "$OUT"
step bench-moe 90 python -m fastkit.cli bench moe --gpu --out "$OUT"
step bench-sft 90 python -m fastkit.cli bench sft --gpu --out "$OUT"
cp assets/bench_*.md "$OUT/" 2>/dev/null || true
cat "$OUT/summary.txt"
