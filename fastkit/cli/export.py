"""``fastkit export``: the export menu (:func:`fastkit.export.menu.export`) on a saved model, and the same
options for ``fastkit train`` (``--merged``, ``--gguf q8_0 q4_k_m``, ``--name``, ``--push-to-hub REPO``).

    fastkit export --model OUTPUT/lora --merged --gguf q8_0 q4_k_m --name my-model [--push-to-hub me/my-model]

``--model`` is a folder ``save_lora`` wrote (the base model it names is loaded, the adapter put on it) or a
plain transformers folder / Hub id (then merged and GGUF only). Outputs go beside it (``--out-dir``, default
the folder above ``--model``): ``merged_16bit/``, ``gguf/``. Every option is checked before a model loads.
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

from fastkit.export.gguf.quants import K_QUANTS, QUANTIZATIONS

logger = logging.getLogger(__name__)


def add_menu_arguments(p: argparse.ArgumentParser, merged_help: str = "also save a merged 16-bit model") -> None:
    """``--merged``, ``--gguf Q [Q ...]``, ``--name``, ``--push-to-hub``, ``--public`` on parser ``p``."""
    p.add_argument("--merged", action="store_true", help=merged_help)
    p.add_argument("--gguf", nargs="+", choices=QUANTIZATIONS, default=None, metavar="Q",
                   help=f"GGUFs (with an Ollama Modelfile) at these quantizations: {', '.join(QUANTIZATIONS)} "
                        f"({', '.join(K_QUANTS)} need pip install 'fastkit-llm[llamacpp]')")
    p.add_argument("--name", default=None, help="the GGUF's name (file <name>-<q>.gguf; the Ollama model name)")
    p.add_argument("--push-to-hub", "--push_to_hub", default=None, metavar="REPO",
                   help="upload each verified folder: LoRA to REPO, merged to REPO-merged, GGUF to REPO-GGUF "
                        "(private; token from HF_TOKEN or huggingface-cli login)")
    p.add_argument("--public", action="store_true", help="create the Hub repositories public (default private)")


def check_menu_arguments(args: argparse.Namespace, lora: bool = True) -> dict[str, str]:
    """Everything about the menu options that can be checked before a model loads; the Hub repos."""
    from fastkit.export.menu import check_options

    kinds = tuple(k for k, on in (("lora", lora), ("merged", args.merged), ("gguf", bool(args.gguf))) if on)
    return check_options(args.gguf, args.name, args.push_to_hub, kinds)[2]


def add_parser(sub) -> argparse.ArgumentParser:
    """Register ``fastkit export`` on the ``sub`` subparsers of the main command."""
    p = sub.add_parser("export", help="save a trained model as LoRA / merged 16-bit / GGUF (several quantizations), "
                                      "verified, and upload it to the Hub",
                       description="Export a saved model: merged 16-bit and GGUF at several quantizations, each "
                                   "verified by reloading it; --push-to-hub uploads the verified folders.")
    p.add_argument("--model", default=None, help="a folder save_lora wrote (OUTPUT/lora), or a merged folder "
                   "(default: the newest LoRA adapters under ./outputs, what fastkit train / dpo / kto / grpo saved "
                   "last)")
    p.add_argument("--out-dir", "--out_dir", default=None,
                   help="where the outputs go (default: the folder above --model)")
    p.add_argument("--lora", action="store_true", help="save (and upload) the LoRA adapters again, verified")
    add_menu_arguments(p, merged_help="save a merged 16-bit model (plain transformers)")
    p.add_argument("--data", default=None, help="the training data's name, for the Hub model card")
    p.add_argument("--no-verify", dest="verify", action="store_false", default=None,
                   help="skip reloading each output to compare its logits (not recommended)")
    p.add_argument("--max-seq-length", "--max_seq_length", type=int, default=2048,
                   help="the context to load the model with")
    p.set_defaults(run=run)
    return p


def load_saved(path: str, max_seq_length: int = 2048, trainable: bool = False):
    """``(model, tokenizer, is_adapter)`` from a folder ``save_lora`` wrote (the base it names, the adapter on it,
    the tokenizer and chat template saved with it) or a plain transformers folder / Hub id."""
    from fastkit import FastModel
    from fastkit.errors import FastkitError
    from fastkit.export import load_lora

    folder = Path(path).expanduser()
    if folder.suffix == ".gguf":
        raise FastkitError(f"--model {path}: a GGUF is already an export; give the LoRA or merged folder.")
    config = folder / "adapter_config.json"
    if not config.is_file():
        vision = _vision(folder, str(path), False)
        model, tokenizer = FastModel.from_pretrained(str(path), max_seq_length=max_seq_length, **vision)
        return model, tokenizer, False
    from fastkit.checks import read_adapter_config

    base = read_adapter_config(folder, f"--model {path}").get("base_model_name_or_path")
    if not base:
        raise FastkitError(f"{config}: no base_model_name_or_path; this adapter does not say which model it is for.")
    from transformers import AutoTokenizer

    from fastkit.families.twins import twin_source

    twin_of = twin_source(base)  # a --twin run's adapters: the same deterministic twin, rebuilt offline
    vision = _vision(folder, twin_of or base, twin_of is not None)
    model, processor = FastModel.from_pretrained(twin_of or base, max_seq_length=max_seq_length,
                                                 twin=twin_of is not None, **vision)
    model = load_lora(model, folder, is_trainable=trainable)
    from fastkit.data.vision import is_processor

    if is_processor(processor):  # a vision-language model: the processor saved with the adapter, else the base's
        return model, _processor(folder, processor), True
    return model, AutoTokenizer.from_pretrained(str(folder)), True


def _vision(folder: Path, model: str, twin: bool) -> dict:
    """``{"vision": True}`` where ``folder`` holds a processor and ``model`` is a vision-language family (Gemma 3
    loads its text model otherwise); ``{}`` where that is not known here (the load decides)."""
    from fastkit.cli.model_facts import model_facts

    if not saved_processor(folder):
        return {}
    _, facts = model_facts(model, twin)
    return {"vision": True} if facts is not None and facts.vision is not None else {}


def saved_processor(folder: Path) -> bool:
    """Whether ``folder`` holds a multimodal processor (``save_lora`` / ``save_merged`` of a vision-language
    model write one): it loads as a vision-language model with that processor."""
    return (folder / "processor_config.json").is_file() or (folder / "preprocessor_config.json").is_file()


def _processor(folder: Path, fallback):
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(str(folder))
    except (OSError, ValueError, TypeError, ImportError) as exc:
        logger.warning("fastkit export: the processor in %s does not load (%s); using the base model's", folder, exc)
        return fallback


OUTPUTS = "outputs"
"""Where fastkit train / dpo / kto / grpo save by default (``outputs/<command>/lora``), under the working folder."""


def default_model(root: str | Path = OUTPUTS) -> Path:
    """``fastkit export`` without ``--model``: the newest ``<run>/lora`` folder under ``root`` holding LoRA adapters
    (the run just trained, whichever command and output folder it had); refused naming where runs save if none."""
    from fastkit.errors import FastkitError

    found = [p.parent for p in Path(root).glob("*/lora/adapter_config.json")]
    if not found:
        raise FastkitError(f"fastkit export: no --model, and no LoRA adapters under ./{root} (fastkit train saves "
                           f"them in <--output-dir>/lora, {root}/train/lora by default); pass --model FOLDER.")
    return max(found, key=lambda p: (p / "adapter_config.json").stat().st_mtime)


def newest_run(folder: Path) -> dict | None:
    """The run identity (fastkit_run.json) of the newest checkpoint in ``folder``, if there is one."""
    from fastkit.training.identity import RUN_FILE, checkpoints

    for ckpt in reversed(checkpoints(folder)):
        if (ckpt / RUN_FILE).is_file():
            return json.loads((ckpt / RUN_FILE).read_text())
    return None


def run(args: argparse.Namespace) -> int:
    """``fastkit export`` with parsed ``args``: prints every file written and the ``ollama create`` line."""
    from fastkit.errors import FastkitError
    from fastkit.export.menu import export

    if not (args.lora or args.merged or args.gguf):
        raise FastkitError("fastkit export: nothing to do; add --merged, --gguf Q [Q ...] and/or --lora.")
    check_menu_arguments(args, lora=args.lora)  # before the model loads
    if args.model is None:
        args.model = str(default_model())
        print(f"fastkit export: --model {args.model} (the newest LoRA adapters under {OUTPUTS}/)")
    model, tokenizer, is_adapter = load_saved(args.model, args.max_seq_length)
    if args.lora and not is_adapter:
        raise FastkitError(f"fastkit export --lora: {args.model} holds no LoRA adapter (no adapter_config.json).")
    out = Path(args.out_dir) if args.out_dir else Path(args.model).expanduser().resolve().parent
    result = export(model, tokenizer, out, lora=args.lora, merged=args.merged, gguf=args.gguf, name=args.name,
                    push_to_hub=args.push_to_hub, private=not args.public, verify=args.verify, data=args.data,
                    run=newest_run(out))
    print(result)
    return 0


def save_after_training(args: argparse.Namespace, model, tokenizer, trainer) -> None:
    """``fastkit train``'s saves: the LoRA always, ``--merged`` / ``--gguf`` / ``--push-to-hub`` on request."""
    from fastkit.export.menu import export

    result = export(model, tokenizer, args.output_dir, lora=True, merged=args.merged, gguf=args.gguf,
                    name=args.name, push_to_hub=args.push_to_hub, private=not args.public,
                    data=getattr(args, "data_label", args.data), run=trainer)
    print(result)


__all__ = ["add_menu_arguments", "add_parser", "check_menu_arguments", "default_model", "load_saved", "run",
           "save_after_training"]
