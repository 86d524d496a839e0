"""The export menu: LoRA, merged 16-bit and GGUF (a list of quantizations) in one call, each save verified,
then, on request, each verified folder uploaded to the Hugging Face Hub. The same menu is ``fastkit export``,
``fastkit train --gguf ... --push-to-hub ...`` and every notebook's export cell.

    result = export(model, tokenizer, "outputs", lora=True, merged=True, gguf=["q8_0", "q4_k_m"],
                    name="my-model", push_to_hub="me/my-model")
    print(result)         # every file written and verified, the Hub URLs, the `ollama create` line to copy

Layout under ``out_dir`` (the notebooks' and ``fastkit train``'s): ``lora/``, ``merged_16bit/``,
``gguf/<name>-<quantization>.gguf`` + ``gguf/Modelfile``. Nothing here writes model files itself: each
artifact is :func:`~fastkit.export.save.save_lora` / ``save_merged`` / ``save_gguf`` (verified and atomic,
:mod:`fastkit.export.verified`). What this module adds:

- every option is checked before the first save: an unknown quantization, a K-quant without llama-cpp-python,
  a family with no GGUF layout, a bad GGUF name, a Hub upload without a token or in offline mode;
- the ``Modelfile`` names the first quantization of the list (each ``save_gguf`` rewrote it for its own);
- nothing is uploaded before every save of the call has verified (:mod:`fastkit.export.hub`).
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fastkit import checks, registry
from fastkit.errors import FastkitError
from fastkit.export import verified as saving
from fastkit.export.gguf.quants import K_QUANTS, LLAMA_CPP_QUANTS, QUANTIZATIONS
from fastkit.patching import unwrap

logger = logging.getLogger(__name__)

FOLDERS = {"lora": "lora", "merged": "merged_16bit", "gguf": "gguf"}
"""Where each kind goes under ``out_dir`` (the notebooks' and ``fastkit train``'s layout)."""
KINDS = tuple(FOLDERS)


@dataclass
class Artifact:
    """One thing :func:`export` wrote."""

    kind: str
    """``"lora"``, ``"merged"`` or ``"gguf"``."""
    path: str
    """The folder (lora, merged) or the .gguf file."""
    files: list[str]
    """Every file of it (paths relative to its folder) as written by the save."""
    verified: bool
    """True when the save reloaded it and its logits matched the model in memory (False: ``verify=False`` or
    not enough host RAM to reload, logged)."""
    quantization: str | None = None
    """The GGUF quantization (None for lora / merged)."""
    hub_url: str | None = None
    """The Hub repository it was uploaded to (None: not uploaded)."""

    @property
    def folder(self) -> Path:
        p = Path(self.path)
        return p.parent if self.kind == "gguf" else p


@dataclass
class ExportResult:
    """What :func:`export` did: ``print(result)`` lists it; ``result.files`` is every file written."""

    artifacts: list[Artifact] = field(default_factory=list)
    """One per LoRA folder, merged folder and GGUF file, in the order written."""
    modelfile: str | None = None
    """The Ollama Modelfile (it names the first GGUF quantization of the call)."""
    ollama: str | None = None
    """The line to copy: ``ollama create NAME -f .../Modelfile``."""

    @property
    def files(self) -> list[str]:
        """Every file written (absolute paths), the Modelfile included."""
        out = [str(a.folder / f) for a in self.artifacts for f in a.files]
        return out + ([self.modelfile] if self.modelfile else [])

    def get(self, kind: str, quantization: str | None = None) -> Artifact:
        for a in self.artifacts:
            if a.kind == kind and (quantization is None or a.quantization == quantization):
                return a
        raise KeyError(f"{kind} {quantization or ''}".strip())

    def __str__(self) -> str:
        lines = []
        for a in self.artifacts:
            what = f"GGUF {a.quantization}" if a.kind == "gguf" else {"lora": "LoRA adapters",
                                                                      "merged": "merged 16-bit"}[a.kind]
            check = "verified" if a.verified else "NOT verified (verify=False or too little host RAM)"
            n = len(a.files)
            lines.append(f"{what}: {a.path} ({n} file{'' if n == 1 else 's'}, {check})")
            if a.kind == "gguf" and n > 1:
                lines.append(f"  with {a.files[1]} (the vision projector: llama.cpp's --mmproj)")
            if a.hub_url:
                lines.append(f"  on the Hub: {a.hub_url}")
        if self.ollama:
            lines.append(f"Ollama: {self.ollama}")
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------ checks


def gguf_list(gguf: Any) -> list[str]:
    """``gguf`` as a list of known quantizations (a string is one; case-insensitive; duplicates dropped)."""
    if gguf is None or gguf is False:
        return []
    items = [gguf] if isinstance(gguf, str) else gguf
    if not isinstance(items, (list, tuple)) or not all(isinstance(q, str) for q in items):
        raise FastkitError(f"export(gguf={gguf!r}): give a list of quantizations, e.g. gguf=['q8_0', 'q4_k_m'] "
                           f"(known: {', '.join(QUANTIZATIONS)}).")
    out = []
    for q in (q.strip().lower() for q in items):
        if q not in QUANTIZATIONS:
            raise FastkitError(f"export(gguf=...): {q!r} is not a quantization fastkit writes; use any of "
                               f"{', '.join(QUANTIZATIONS)} (Ollama's default is 'q4_k_m').")
        if q not in out:
            out.append(q)
    return out


def check_llama_cpp(quants: list[str]) -> None:
    """Every GGUF needs gguf-py, and K-quants llama.cpp's own quantizer: refused, with the install line, where
    missing."""
    from fastkit.extras import require

    if quants:  # every GGUF is written with gguf-py
        require("gguf", f"GGUF {', '.join(quants)}", "Nothing was saved.")
    k = [q for q in quants if q in LLAMA_CPP_QUANTS]
    if k and importlib.util.find_spec("llama_cpp") is None:
        raise FastkitError(f"GGUF {', '.join(k)}: made by llama.cpp's own quantizer (llama_model_quantize), from "
                           "llama-cpp-python, which is not installed: pip install 'fastkit-llm[llamacpp]' (it "
                           "compiles llama.cpp, ~15-30 min on 2 CPU cores). Without it, use 'q8_0' or 'q4_0' "
                           "(written by fastkit itself). Nothing was saved.")


def check_options(gguf: Any = None, name: str | None = None, push_to_hub: Any = None,
                  kinds: tuple[str, ...] = KINDS, token: str | None = None
                  ) -> tuple[list[str], str | None, dict[str, str]]:
    """The checks that need no model (the CLI runs them before loading one): ``(quantizations, name, repos)``;
    a repo id without a namespace gets the token's user."""
    quants = gguf_list(gguf)
    check_llama_cpp(quants)
    if name is not None:
        name = saving.safe_name(name, "name")
    from fastkit.export import hub

    repos = hub.repos_for(push_to_hub, kinds)
    if repos:
        user = hub.check_can_push(next(iter(repos.values())), token)
        repos = {k: r if "/" in r or not user else f"{user}/{r}" for k, r in repos.items()}
    return quants, name, repos


def _check_model(model: torch.nn.Module, lora: bool, quants: list[str]) -> None:
    if lora and not hasattr(model, "peft_config"):
        raise FastkitError("export(lora=True) needs a PEFT model (FastModel.get_peft_model or load_lora); pass "
                           "lora=False to export a plain model as merged / GGUF only.")
    model_type = getattr(unwrap(model).config, "model_type", None)
    archs = registry.gguf_archs()  # read now: a row added at run time counts
    from fastkit.export.gguf import mmproj

    if quants and model_type not in archs and not mmproj.writes(model):  # a VLM: text GGUF + mmproj
        raise FastkitError(f"export(gguf={quants}): model_type {model_type!r} has no GGUF layout in fastkit "
                           f"(it has: {', '.join(archs)}); pass gguf=[] and convert the merged folder with "
                           "llama.cpp's convert_hf_to_gguf.py. Nothing was saved.")


# ------------------------------------------------------------------------------------------- saves


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _save_lora(model, tokenizer, out: Path, check: bool) -> Artifact:
    from fastkit.export.save import save_lora

    path = Path(save_lora(model, tokenizer, out / FOLDERS["lora"], verify=check))
    return Artifact("lora", str(path), _files(path), check)


def _save_merged(model, tokenizer, out: Path, check: bool, dtype: torch.dtype) -> Artifact:
    from fastkit.export.save import save_merged

    path = Path(save_merged(model, tokenizer, out / FOLDERS["merged"], dtype=dtype, verify=check))
    return Artifact("merged", str(path), _files(path), check)


def _save_gguf(model, tokenizer, out: Path, check: bool, quantization: str, name: str | None) -> Artifact:
    from fastkit.export.gguf import mmproj
    from fastkit.export.gguf.save import save_gguf

    file = Path(save_gguf(model, tokenizer, out / FOLDERS["gguf"], quantization=quantization, name=name,
                          verify=check))
    projector = file.parent / mmproj.file_name(file.name)  # a vision-language model's: listed and uploaded too
    files = [file.name, projector.name] if mmproj.writes(model) and projector.is_file() else [file.name]
    return Artifact("gguf", str(file), files, check, quantization=quantization)


def _verify_plan(model, kinds: tuple[str, ...], verify: bool | None, dtype: torch.dtype | None,
                 push: bool) -> dict[str, bool]:
    """Which saves reload to check (each save's own rule), decided up front: an upload needs every one checked."""
    dtypes = {"lora": None, "merged": dtype, "gguf": torch.float16}
    plan = {k: saving.should_verify(model, dtypes[k], verify, f"save_{'gguf' if k == 'gguf' else k}")
            for k in kinds}
    unchecked = [k for k, on in plan.items() if not on]
    if push and unchecked:
        raise FastkitError(f"export(push_to_hub=...): the {', '.join(unchecked)} save would not be verified "
                           f"(verify={verify!r}; with verify=None: not enough free host RAM to reload it), and only "
                           "verified saves are uploaded. Pass verify=True to check anyway, or upload the folder "
                           "yourself (huggingface-cli upload). Nothing was saved.")
    return plan


def _modelfile(tokenizer, ggufs: list[Artifact]) -> tuple[str | None, str | None]:
    """The Modelfile for the first quantization of the call, and the ``ollama create`` line for it."""
    if not ggufs:
        return None, None
    from fastkit.export.gguf.modelfile import modelfile
    from fastkit.export.owned import record_own

    first = Path(ggufs[0].path)
    path = first.parent / "Modelfile"
    text = modelfile(tokenizer, first.name)  # None (warned) where no TEMPLATE renders the chat template
    if text is None:
        return None, None
    path.write_text(text)  # each save_gguf wrote one for its own file: the first wins
    record_own(path.parent, path.name, "save_gguf")  # still fastkit's own file for the next save (the manifest)
    stem = first.name[: -len(f"-{ggufs[0].quantization}.gguf")]
    return str(path), f"ollama create {ollama_name(stem)} -f {path}"


def ollama_name(stem: str) -> str:
    """An Ollama model name from a GGUF file stem (lowercase; letters, digits, ``-``, ``_``, ``.``)."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in stem.lower()).strip("-.") or "fastkit-model"


def export(model: torch.nn.Module, tokenizer, out_dir: str | Path, *, lora: bool = True, merged: bool = False,
           gguf: list[str] | str | None = None, name: str | None = None, push_to_hub: str | dict | None = None,
           private: bool = True, verify: bool | None = None, merged_dtype: torch.dtype | str | None = None,
           data: str | None = None, run: Any = None, token: str | None = None) -> ExportResult:
    """Save ``model`` every way asked, each save verified, then upload each verified folder if asked.

    - ``lora``: PEFT adapters in ``out_dir/lora``; ``merged``: a plain transformers model in
      ``out_dir/merged_16bit`` (``merged_dtype``, default the training dtype); ``gguf``: a list of quantizations
      (``"f16"``, ``"bf16"``, ``"q8_0"``, ``"q4_0"`` written by fastkit; ``"q4_k_m"``, ``"q5_k_m"``, ``"q6_k"`` by
      llama.cpp's quantizer, from ``fastkit-llm[llamacpp]``) in ``out_dir/gguf``, as ``<name>-<q>.gguf``, with an
      Ollama ``Modelfile`` for the first one.
    - ``push_to_hub``: a repo id (``"me/my-model"``): the LoRA goes to it, the merged model to ``<repo>-merged``,
      the GGUFs to ``<repo>-GGUF``; or a dict ``{"lora": repo, "merged": repo, "gguf": repo}``. Repositories are
      created private unless ``private=False``; the token is ``token``, else ``HF_TOKEN`` or the one
      ``huggingface-cli login`` / ``hf auth login`` stored. Each folder gets a model card (README.md) naming the
      base model, ``data`` and the run's options (``run``: the trainer, or its run identity from a checkpoint's
      fastkit_run.json); only the files this call verified are uploaded, so an upload with a save that would not
      be verified (``verify=False``, or too little host RAM to reload it) is refused before the first save.
    - ``verify``: as each save's (None: check unless the reload would not fit in host RAM).

    Every option is checked before the first save. Returns an :class:`ExportResult` (``print`` it).
    """
    kinds = tuple(k for k, on in (("lora", lora), ("merged", merged), ("gguf", bool(gguf_list(gguf)))) if on)
    if not kinds:
        raise FastkitError("export: nothing to save; pass lora=True, merged=True and/or gguf=['q8_0', ...].")
    if not isinstance(private, bool):
        raise FastkitError(f"export(private={private!r}): give True (the default) or False.")
    out = checks.check_save_target(out_dir, "export out_dir")
    quants, name, repos = check_options(gguf, name, push_to_hub, kinds, token)
    _check_model(model, lora, quants)
    from fastkit.export.merge import training_dtype

    dtype = (checks.resolve_dtype(merged_dtype) or training_dtype(model)) if merged else None
    if merged and dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise FastkitError(f"export(merged_dtype={merged_dtype!r}): give torch.float16, torch.bfloat16 or "
                           "torch.float32. Nothing was saved.")
    plan = _verify_plan(model, kinds, verify, dtype, bool(repos))
    result = ExportResult()
    if lora:
        result.artifacts.append(_save_lora(model, tokenizer, out, plan["lora"]))
    if merged:
        result.artifacts.append(_save_merged(model, tokenizer, out, plan["merged"], dtype))
    ggufs = [_save_gguf(model, tokenizer, out, plan["gguf"], q, name) for q in quants]
    result.artifacts += ggufs
    result.modelfile, result.ollama = _modelfile(tokenizer, ggufs)
    for a in result.artifacts:
        logger.info("fastkit: %s %s (%s)", a.kind, a.path, "verified" if a.verified else "not verified")
    if repos:  # only now: every save of this call has verified
        from fastkit.export import hub

        hub.push_result(result, repos, model=model, data=data, run=run, private=private, token=token)
    if result.ollama:
        logger.info("fastkit: %s", result.ollama)
    return result


__all__ = ["Artifact", "ExportResult", "FOLDERS", "KINDS", "K_QUANTS", "QUANTIZATIONS", "check_options", "export",
           "gguf_list", "ollama_name"]
