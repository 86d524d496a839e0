"""A GGUF file in llama.cpp as the tuned model of an evaluation (``fastkit eval --gguf FILE``).

What it is for. After ``fastkit export --gguf``, the model users run is the GGUF in llama.cpp (Ollama, LM Studio,
llama-server), quantized. The evaluation (:func:`fastkit.evaluate`) asks a model for two things only: the logits of
a row of token ids (``model(input_ids=ids).logits``: the answer loss, forgetting and drift) and an answer
(``model.generate(...)``: exact / contains / the user's checks). :class:`LlamaCppModel` answers both from
llama.cpp, so the base (transformers) and the GGUF are compared on the same rows with the same report.

What must not change. The rows are the tokenizer's token ids, fed to llama.cpp as ids (never re-tokenized by
llama.cpp), so both models score exactly the same tokens; a GGUF whose vocabulary is not the tokenizer's (another
model's file) is refused at load, before any row runs, since every number would be wrong. Logits are llama.cpp's
own (``logits_all``), so a quantized file's loss shows its quantization. Greedy answers are llama.cpp's argmax; the
sampled answer is llama.cpp's sampler seeded per row (seeded and repeatable, not the same draws as torch's).
llama.cpp is loaded through :func:`fastkit.export.gguf.llamacpp.load` (its portable CPU kernels).
"""

from __future__ import annotations

import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch

from fastkit.errors import FastkitError

logger = logging.getLogger(__name__)

PROBE = "Hello! What is 2 + 2? The answer, in JSON: {\"answer\": 4}."
"""Text both tokenizers must split into the same ids (the vocabulary check)."""


def check_file(path: str) -> Path:
    """``path`` as a GGUF file (exists, a file, GGUF's magic), checked before any model loads."""
    file = Path(path).expanduser()
    if not file.exists():
        raise FastkitError(f"--gguf {path}: no such file; give the .gguf fastkit export --gguf wrote.")
    if not file.is_file():
        raise FastkitError(f"--gguf {path}: not a file; give the .gguf file itself (fastkit export --gguf writes "
                           "OUT/<name>.gguf).")
    with open(file, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise FastkitError(f"--gguf {path}: not a GGUF file (it does not start with GGUF's magic bytes).")
    return file


class LlamaCppModel:
    """The GGUF at ``path`` in llama.cpp, answering as the evaluation asks a model (logits, generate).

    ``tokenizer``: the tokenizer the rows are made with (the base model's, or the run's); ``vocab_size``: the base
    model's logits width (they must match for the drift's KL); ``n_ctx``: the longest row plus an answer;
    ``eos_ids``: the tokens that end an answer (the base's generation config and tokenizer)."""

    training = False
    device = torch.device("cpu")

    def __init__(self, path: str | Path, tokenizer, vocab_size: int, n_ctx: int, eos_ids=(),
                 threads: int | None = None):
        from fastkit.export.gguf import llamacpp

        self.path = Path(path)
        self.n_ctx = n_ctx
        self.llm = llamacpp.load(self.path, "fastkit eval --gguf", n_ctx=n_ctx, logits_all=True, n_threads=threads,
                                 n_threads_batch=threads, seed=0)
        self.eos_ids = {int(i) for i in eos_ids} | {int(self.llm.token_eos())}
        self._check_vocab(tokenizer, vocab_size)

    def _check_vocab(self, tokenizer, vocab_size: int) -> None:
        n_vocab = self.llm.n_vocab()
        ours = tokenizer.encode(PROBE, add_special_tokens=False)
        theirs = self.llm.tokenize(PROBE.encode("utf-8"), add_bos=False, special=False)
        if n_vocab != vocab_size or ours != theirs:
            self.close()
            why = (f"{n_vocab} tokens, the model {vocab_size}" if n_vocab != vocab_size
                   else "it splits text into other tokens")
            raise FastkitError(f"--gguf {self.path}: its vocabulary is not the base model's tokenizer ({why}); give "
                               "the GGUF exported from this base model (or its run).")

    @property
    def label(self) -> str:
        """What the report calls the tuned model."""
        return f"{self.path.name} in llama.cpp"

    def eval(self) -> LlamaCppModel:
        return self

    def train(self, mode: bool = True) -> LlamaCppModel:
        return self  # nothing trains in llama.cpp

    def close(self) -> None:
        self.llm.close()

    def _ids(self, input_ids: torch.Tensor) -> list[int]:
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"LlamaCppModel scores one row at a time, got input_ids of shape {tuple(input_ids.shape)}")
        ids = input_ids[0].tolist()
        if len(ids) > self.n_ctx:
            raise FastkitError(f"--gguf: a row of {len(ids)} tokens is longer than the context llama.cpp was loaded "
                               f"with ({self.n_ctx}); lower --max-seq-length or --max-new-tokens.")
        return ids

    def __call__(self, input_ids: torch.Tensor, **_) -> SimpleNamespace:
        """``.logits`` ``[1, T, V]`` float32: llama.cpp's next-token logits at every position of the row."""
        ids = self._ids(input_ids)
        self.llm.reset()
        self.llm.eval(ids)
        scores = np.array(self.llm.scores[:len(ids)], dtype=np.float32)  # [T, V]
        return SimpleNamespace(logits=torch.from_numpy(scores)[None])  # [1, T, V]

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int, do_sample: bool = False,
                 temperature: float | None = None, top_p: float | None = None, **_) -> torch.Tensor:
        """``[1, P + N]``: the prompt and llama.cpp's answer (greedy, or sampled from the seed the caller set with
        ``torch.manual_seed``: the same seed gives the same answer), its end token included when it stops."""
        prompt = self._ids(input_ids)
        if do_sample:
            self.llm.set_seed(int(torch.initial_seed()) % 2**32)
            knobs = dict(temp=float(temperature or 1.0), top_p=float(top_p or 1.0))
        else:
            knobs = dict(temp=0.0, top_p=1.0)
        new: list[int] = []
        room = min(max_new_tokens, self.n_ctx - len(prompt))
        if room > 0:
            for token in self.llm.generate(prompt, top_k=0, min_p=0.0, repeat_penalty=1.0, reset=True, **knobs):
                new.append(int(token))
                if token in self.eos_ids or len(new) >= room:
                    break
        return torch.tensor([prompt + new])


def context_for(tokenizer, max_seq_length: int, options) -> int:
    """The context llama.cpp needs for an evaluation with ``options``: the longest row and its answer, and the
    forgetting's general text and prompts with the base's answer."""
    from fastkit.evaluation import forgetting as fg
    from fastkit.evaluation.general_text import GENERAL_TEXT

    need = max_seq_length + max(options.max_new_tokens, 1)
    if options.forgetting:
        need = max(need, *(len(fg.text_ids(tokenizer, t)) for t in GENERAL_TEXT),
                   *(len(fg.probe_ids(tokenizer, p)) + options.forgetting_tokens for p in fg.GENERAL_PROMPTS))
    return need


def load_gguf(path: str | Path, base: torch.nn.Module, tokenizer, n_ctx: int) -> LlamaCppModel:
    """The GGUF at ``path`` next to ``base`` (its vocabulary and end tokens), for :func:`fastkit.evaluate`; close it
    (``.close()``) when done."""
    eos = getattr(getattr(base, "generation_config", None), "eos_token_id", None)
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer.eos_token_id is not None:
        eos_ids.append(tokenizer.eos_token_id)
    vocab = base.get_output_embeddings().weight.shape[0]
    logger.info("fastkit eval: %s in llama.cpp as the tuned model (context %d)", path, n_ctx)
    return LlamaCppModel(path, tokenizer, vocab, n_ctx, eos_ids)


__all__ = ["LlamaCppModel", "check_file", "context_for", "load_gguf"]
