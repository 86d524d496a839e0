"""Upload what :func:`fastkit.export.menu.export` verified to the Hugging Face Hub, with a model card.

Through ``huggingface_hub`` itself: ``create_repo`` (private unless asked otherwise; an existing repo keeps its
visibility, as the Hub does) then ``upload_folder`` of the saved folder, restricted to the files this export
wrote and verified (``allow_patterns``), plus the model card (README.md, a ``huggingface_hub.ModelCard``: its
metadata from ``ModelCardData``, the base model, the data and the fastkit options of the run; ``save_lora`` /
``save_merged`` write a first one, :func:`write_card`, in place of PEFT's template). The token is the one
``huggingface_hub`` finds (``HF_TOKEN``, or what ``huggingface-cli login`` / ``hf auth login`` stored) or the one
given; it is checked (``whoami``) before anything is saved, so a missing or refused token never costs a save. The
endpoint is ``huggingface_hub``'s (``HF_ENDPOINT``); tests point it at a recording server on 127.0.0.1
(tests/test_export_hub.py).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

from fastkit.errors import FastkitError

logger = logging.getLogger(__name__)

SUFFIX = {"lora": "", "merged": "-merged", "gguf": "-GGUF"}
"""``push_to_hub="me/x"``: the LoRA goes to ``me/x``, the merged model to ``me/x-merged``, the GGUFs to
``me/x-GGUF`` (the Hub's usual names for those)."""
_TWIN_PREFIX = "fastkit-twin:"  # == fastkit.families.twins.TWIN_PREFIX (tests/test_export_hub.py)
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")


def repos_for(push_to_hub: Any, kinds: tuple[str, ...]) -> dict[str, str]:
    """``{kind: repo id}`` for the ``kinds`` exported (``{}``: no upload); bad repo ids raise here."""
    if push_to_hub in (None, False, ""):
        return {}
    if isinstance(push_to_hub, str):
        repos = {k: push_to_hub.strip() + SUFFIX[k] for k in kinds}
    elif isinstance(push_to_hub, dict):
        unknown = sorted(set(push_to_hub) - set(SUFFIX))
        if unknown:
            raise FastkitError(f"push_to_hub={push_to_hub!r}: unknown kinds {unknown}; use 'lora', 'merged', 'gguf'.")
        repos = {k: str(v).strip() for k, v in push_to_hub.items() if k in kinds and v}
    else:
        raise FastkitError(f"push_to_hub={push_to_hub!r}: give a repo id like 'your-name/my-model' (or a dict "
                           "{'lora': ..., 'merged': ..., 'gguf': ...}).")
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    for repo in repos.values():
        try:
            validate_repo_id(repo)
        except HFValidationError as exc:
            raise FastkitError(f"push_to_hub: {repo!r} is not a Hub repo id ({exc}); give 'your-name/my-model'."
                               ) from exc
    return repos


def check_can_push(repo: str, token: str | None = None) -> str:
    """The user the token belongs to; FastkitError (before anything is saved) when there is none, it is
    refused, or ``huggingface_hub`` is in offline mode."""
    from huggingface_hub import HfApi, constants, get_token

    if constants.is_offline_mode():
        raise FastkitError(f"push_to_hub={repo!r}: huggingface_hub is in offline mode (HF_HUB_OFFLINE=1); unset it "
                           "to upload, or drop push_to_hub. Nothing was saved.")
    token = token or get_token()
    if not token:
        raise FastkitError(f"push_to_hub={repo!r}: no Hugging Face token. Log in with `huggingface-cli login` (or "
                           "`hf auth login`), or set HF_TOKEN to a token with write access "
                           "(https://huggingface.co/settings/tokens). Nothing was saved.")
    try:
        who = HfApi().whoami(token=token)
    except Exception as exc:  # noqa: BLE001 -- whatever the Hub says, nothing is saved and the reason is shown
        raise FastkitError(f"push_to_hub={repo!r}: the Hub did not accept the token ({type(exc).__name__}: "
                           f"{str(exc)[:160]}); log in again (`huggingface-cli login`). Nothing was saved.") from exc
    return str(who.get("name", ""))


# ----------------------------------------------------------------------------------------- model card


def _hub_id(value: Any) -> str | None:
    """``value`` when it looks like a Hub id and is not a local path (the card's YAML links only those)."""
    text = str(value or "")
    return text if _HUB_ID.match(text) and not Path(text).exists() else None


def _run_identity(run: Any) -> dict:
    if run is None:
        return {}
    if isinstance(run, dict):
        return run
    # fit() leaves the run identity on the trainer (fastkit.training.identity.run_identity); read it there
    # rather than importing training/ (export/ sits below training/: tests/test_import_graph.py)
    identity = getattr(run, "fastkit_identity", None)
    if isinstance(identity, dict):
        return identity
    logger.info("fastkit: the model card names no run options (this trainer has not been through fit())")
    return {}


def _adapter_options(model) -> dict:
    peft = getattr(model, "peft_config", None) or {}
    config = next(iter(peft.values()), None)
    if config is None:
        return {}
    keys = ("r", "lora_alpha", "lora_dropout", "target_modules", "target_parameters", "use_rslora", "use_dora")
    values = config.to_dict()
    return {k: sorted(v) if isinstance(v, (set, list)) else v for k, v in values.items() if k in keys and v}


_USE = {
    "lora": 'from peft import AutoPeftModelForCausalLM\nmodel = AutoPeftModelForCausalLM.from_pretrained("{repo}")',
    "merged": 'from transformers import AutoModelForCausalLM\nmodel = AutoModelForCausalLM.from_pretrained("{repo}")',
    "gguf": "ollama run hf.co/{repo}:{quant}\n# or: llama-cli -hf {repo}:{quant}",
}
_WHAT = {"lora": "LoRA adapters (PEFT format)", "merged": "a merged 16-bit model (plain transformers)",
         "gguf": "GGUF files for llama.cpp / Ollama / LM Studio (LoRA merged)"}


def model_card(kind: str, repo: str, files: list[str], *, base: str, data: str | None, run: dict,
               adapter: dict, quantizations: list[str], upload: bool = True):
    """The README.md of a saved or uploaded folder, a ``huggingface_hub.ModelCard``: its metadata from
    ``ModelCardData`` (base_model, datasets, library_name, tags), its text the data, fastkit options, files and how
    to load it. ``repo``: the Hub repo id, or the local folder (``save_lora`` / ``save_merged``)."""
    from huggingface_hub import ModelCard, ModelCardData

    # a --twin run: a tiny random model, not a fine-tune of the model it stands in for (families.twins.TWIN_PREFIX,
    # spelled here: families imports export)
    twin_of = base[len(_TWIN_PREFIX):] if isinstance(base, str) and base.startswith(_TWIN_PREFIX) else None
    meta = ModelCardData(base_model=base if _hub_id(base) and twin_of is None else None,
                         datasets=[data] if _hub_id(data) else None,
                         library_name={"lora": "peft", "merged": "transformers"}.get(kind),
                         pipeline_tag="text-generation",
                         tags=["fastkit", kind, *(["lora"] if kind == "lora" else [])])
    hyper = {k: v for k, v in (run.get("hyperparameters") or {}).items() if v is not None}
    origin = (f"trained on a tiny random twin of `{twin_of}` (a smoke test, not a fine-tune of it)" if twin_of
              else f"fine-tuned from `{base}`" if base else "fine-tuned (base model not recorded)")
    lines = [f"# {repo.replace(chr(92), '/').rstrip('/').split('/')[-1]}", "", f"{_WHAT[kind]}, {origin} with fastkit.",
             "", "## Data", "", f"- dataset: {data or 'not recorded'}"]
    if run.get("data"):
        lines.append(f"- fingerprint of the token ids trained on: `{run['data']}`")
    options = {**adapter, **hyper}
    if options:
        lines += ["", "## fastkit options", "", "| option | value |", "|---|---|"]
        lines += [f"| {k} | `{json.dumps(v)}` |" for k, v in options.items()]
    lines += ["", "## Files", "", "Each was reloaded after saving and its logits compared with the trained model"
              f"{' before upload' if upload else ''}.", ""] + [f"- `{f}`" for f in files]
    use = _USE[kind].format(repo=repo, quant=(quantizations or ["q8_0"])[0].upper())
    lines += ["", "## Use", "", "```", use, "```", ""]
    return ModelCard(f"---\n{meta.to_yaml()}\n---\n\n" + "\n".join(lines))


def write_card(folder: Path, kind: str, model, where: str, verified: bool) -> None:
    """A save's own README.md (``save_lora``: instead of PEFT's "[More Information Needed]" template;
    ``save_merged``): the base model, the adapter's options and the files; ``export(push_to_hub=...)`` writes the
    full card (data, the run's options) when it uploads."""
    from fastkit.patching import unwrap

    base = str(getattr(unwrap(model).config, "name_or_path", "") or "")
    files = [f for f in sorted(p.name for p in folder.iterdir() if p.is_file()) if f != "README.md"]
    card = model_card(kind, where, files, base=base, data=None, run={}, adapter=_adapter_options(model),
                      quantizations=[], upload=False)
    text = str(card)
    if not verified:
        text = text.replace("Each was reloaded after saving and its logits compared with the trained model.",
                            "Saved with verify=False: not reloaded and compared.")
    (folder / "README.md").write_text(text, encoding="utf-8")


# --------------------------------------------------------------------------------------------- upload


def push_folder(folder: Path, repo: str, files: list[str], card, *, private: bool,
                token: str | None) -> str:
    """Create ``repo`` (private by default) and upload ``files`` of ``folder`` plus the card (a ``ModelCard`` or
    its text); the repo URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=token)
    url = api.create_repo(repo, private=private, exist_ok=True, repo_type="model")
    (folder / "README.md").write_text(str(card), encoding="utf-8")
    api.upload_folder(repo_id=url.repo_id, folder_path=str(folder), repo_type="model",
                      allow_patterns=sorted(set(files) | {"README.md"}),
                      commit_message=f"fastkit export: {', '.join(sorted(files))[:200]}")
    logger.info("fastkit: uploaded %d files of %s to %s", len(files) + 1, folder, url)
    return str(url)


def push_result(result, repos: dict[str, str], *, model, data: str | None, run: Any, private: bool,
                token: str | None) -> None:
    """Upload each verified folder of ``result`` (an ExportResult) to its repo; sets each artifact's hub_url."""
    from fastkit.patching import unwrap

    identity = _run_identity(run)
    base = str((identity.get("model") or {}).get("name_or_path") or unwrap(model).config.name_or_path or "")
    adapter = _adapter_options(model)
    for kind, repo in repos.items():
        artifacts = [a for a in result.artifacts if a.kind == kind]
        if not artifacts:
            continue
        files = list(dict.fromkeys(f for a in artifacts for f in a.files))  # one mmproj for several quants
        if kind == "gguf" and result.modelfile:
            files.append(Path(result.modelfile).name)
        quants = [a.quantization for a in artifacts if a.quantization]
        card = model_card(kind, repo, files, base=base, data=data, run=identity, adapter=adapter,
                          quantizations=quants)
        url = push_folder(artifacts[0].folder, repo, files, card, private=private, token=token)
        for a in artifacts:
            a.hub_url = url


__all__ = ["SUFFIX", "check_can_push", "model_card", "push_folder", "push_result", "repos_for", "write_card"]
