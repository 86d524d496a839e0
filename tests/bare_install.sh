#!/usr/bin/env bash
# README's "Set up" command, verbatim, in a fresh virtual environment that holds nothing else (no extras, no
# IPython, no Jupyter), then what a new user does next in that same environment:
#   1. the first ```bash block under "## Set up" in README.md, run as written (it ends with `fastkit quickstart`);
#   2. `fastkit train` on the cached SmolLM2 folder the quickstart names ("train on it again: ..."), on a multi-turn
#      chat file in HuggingFaceH4/no_robots' schema;
#   3. `fastkit plan` on that folder, offline.
# A change to README's command is therefore tested; so is any import of the notebook stack on a terminal path.
# Usage: bash tests/bare_install.sh [WORKDIR]   (default: a temp folder, removed at the end; .ci/run calls it)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
WORK=${1:-$(mktemp -d)}
[ -n "${1:-}" ] || trap 'rm -rf "$WORK"' EXIT
mkdir -p "$WORK"
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore FASTKIT_CACHE="$WORK/cache"
start=$(date +%s)

# the command: README.md's first bash block of the "## Set up" section, exactly as written
awk '/^## /{section=$0} section=="## Set up" && /^```bash$/{inside=1; next} inside && /^```$/{exit} inside' \
    README.md > "$WORK/setup.sh"
if [ ! -s "$WORK/setup.sh" ]; then
    echo "bare install: README.md has no \`\`\`bash block under '## Set up'" >&2
    exit 1
fi
echo "bare install: README's set-up command:"; sed 's/^/    /' "$WORK/setup.sh"

python -m venv "$WORK/venv"   # no --system-site-packages: nothing but what the command installs
# shellcheck disable=SC1091
source "$WORK/venv/bin/activate"
set -o pipefail
bash -euo pipefail "$WORK/setup.sh" 2>&1 | tee "$WORK/setup.log"
echo "bare install: set-up command done in $(( $(date +%s) - start )) s"

# it really is bare: none of the notebook stack came in as a dependency
python - <<'EOF'
import importlib.util, sys
present = [m for m in ("IPython", "ipywidgets", "matplotlib", "jupyter_core", "ipykernel", "nbformat")
           if importlib.util.find_spec(m) is not None]
if present:
    sys.exit(f"bare install: not bare, {present} came in with README's command")
import fastkit
print("bare install: fastkit from", fastkit.__file__, "| no IPython, ipywidgets, matplotlib, Jupyter")
EOF

# the folder the quickstart told the user to train on again
folder=$(sed -n 's/.*train on it again: fastkit train --model \([^ ]*\) --data .*/\1/p' "$WORK/setup.log" | tail -1)
if [ -z "$folder" ] || [ ! -f "$folder/config.json" ]; then
    echo "bare install: the quickstart did not name its cached weights folder ('train on it again: ...')" >&2
    exit 1
fi
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
fastkit train --model "$folder" --data "$REPO/fastkit/data/no_robots_sample.jsonl" --steps 2 \
    --max-seq-length 512 --lora-r 4 --checkpointing off --save-steps 2 --output-dir "$WORK/train" 2>&1 \
    | tee "$WORK/train.log"
grep -q "training finished at step 2/2" "$WORK/train.log"
test -f "$WORK/train/lora/adapter_model.safetensors"
fastkit plan "$folder" --gpu t4 | tee "$WORK/plan.log"
grep -q "GiB" "$WORK/plan.log"
# a Hub id fastkit ships the config of: answered offline (HF_HUB_OFFLINE=1 above), no Hub retries
set +e
fastkit plan Qwen/Qwen3-14B --gpu t4 --4bit > "$WORK/plan14b.log" 2>&1
rc=$?
set -e
tail -1 "$WORK/plan14b.log"
if [ "$rc" -gt 1 ] || ! grep -q "predicted peak" "$WORK/plan14b.log"; then
    echo "bare install: fastkit plan Qwen/Qwen3-14B --gpu t4 --4bit did not answer offline (exit $rc)" >&2
    exit 1
fi
echo "bare install: passed in $(( $(date +%s) - start )) s"
