"""Glue: keep a frozen input embedding and lm_head in host memory (registry names ``host_embedding``, ``host_lm_head``).

Replaces, on the instances: the input embedding's ``forward`` (``F.embedding`` of a device weight) by a row
gather on the host and one non-blocking copy of the rows (:func:`fastkit.patches.host.rows.gather_rows`);
the lm_head's ``forward`` (``F.linear``) by the same product over vocabulary chunks streamed from the host
(:class:`~fastkit.patches.host.rows.StreamedLinear`); the chunked loss (:mod:`fastkit.patches.loss.patch`)
then streams the head inside its cross-entropy (:mod:`fastkit.patches.loss.streamed`). The weights'
``Parameter`` objects stay where they were in the module tree; only their storage moves to pinned host
memory. Why: on GPT-OSS-20B each of the two is 201,088 x 2,880 (1.08 GiB in fp16), what keeps a QLoRA run
at 2,048 tokens off a free T4 (docs/plan.md). Turned on by :class:`HostWeights` (``FastModel.get_peft_model
(host_weights=...)``, "auto" from the load-time plan: :func:`fastkit.plan.check_fits`).

The host embedding needs the token ids on the host: reading them back from the device would be a sync per
step. :class:`HostIdsCollator` (``fastkit.make_trainer`` installs it) adds the collator's own CPU copy to
the batch under ``fastkit_host_ids`` as a :class:`HostIds` box, which the Trainer's and accelerate's device
placement pass through untouched (it is neither a tensor nor has ``.to``); the decoder's ``forward`` pops it
and hands it to the embedding for the duration of that call (a context variable). A forward without it
(a plain ``model(input_ids)`` with device ids) is still correct: the ids are copied to the host (one
blocking read, counted in :func:`host_stats` ``.no_host_ids`` and logged once) — chosen over refusing, so that
eval, generation and user code keep working.

What must not change: the logits and every gradient (the rows and chunks are copies of the same values;
tests/test_host_weights.py compares against the unpatched model). Refused (the model unchanged, and
:func:`enable_host_weights` raises :class:`FastkitError`): a trainable embedding / head (full fine-tuning,
PEFT ``modules_to_save``, LoRA on the head), an embedding that is not a plain ``nn.Embedding`` (scaled
embeddings, ``max_norm``), a head that is not a plain ``nn.Linear``, tied embedding and head. A weight that
starts training after the patch raises at the next forward.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import types
from dataclasses import dataclass, field

import torch

from fastkit.errors import FastkitError
from fastkit.patches.host.rows import gather_rows, streamed_linear, to_host, vocab_rows
from fastkit.patches.loss.chunked import CHUNK_BYTES
from fastkit.patching import apply_patch, revert, unwrap

logger = logging.getLogger(__name__)

HOST_EMBEDDING = "host_embedding"
HOST_LM_HEAD = "host_lm_head"
HOST_IDS_KWARG = "fastkit_host_ids"
"""Batch key (added by :class:`HostIdsCollator`) and forward kwarg: the token ids on the host."""
_STATS_ATTR = "_fastkit_host_stats"
_ROWS_ATTR = "_fastkit_host_block_bytes"

# The host ids of the decoder forward that is running now (set and reset by the decoder wrapper).
_HOST_IDS: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("fastkit_host_ids", default=None)

# Note: [host weights survive model.to]
# The Trainer (``_move_model_to_device``) and accelerate (``prepare_model``) call ``model.to(device)`` on a
# model that is not bitsandbytes-quantized, which moves every parameter, the host ones included, back to
# the GPU. The patched forwards therefore check (a host-side attribute read, no sync) that the weight is
# still on the host and, if not, move its storage back there once (logged; it costs one copy, at the
# first step, before any activation is alive); a cast (``model.half()``) leaves an unpinned host tensor,
# which is pinned again the same way. Revert moves the storage to the device the weight had
# when the patch was applied. The Parameter object itself never changes, so optimizers, PEFT and
# state_dict keep seeing the same object.


@dataclass
class HostWeights:
    """Which frozen weight matrices stay in host memory during training (``get_peft_model(host_weights=...)``)."""

    input_embedding: bool = False
    """Keep the frozen input embedding on the host (pinned where CUDA is available): each forward gathers
    its rows there and copies them to the device without blocking. Needs the token ids on the host:
    ``fastkit.make_trainer``'s collator carries them; a call without them reads the ids back (one sync,
    counted in ``host_stats(model).no_host_ids``)."""
    lm_head: bool = False
    """Keep the frozen lm_head on the host, streamed to the device in vocabulary chunks: by the chunked
    loss (forward, and again in backward: two transfers of the head per step) and by its own forward
    (eval, generation). Forces fastkit's chunked loss in ``make_trainer`` (TRL's kernel needs the head on
    the device)."""
    block_bytes: int = CHUNK_BYTES
    """Device bytes of one (tokens x vocabulary rows) fp32 block of the streamed head; sets the rows per
    chunk (also capped so that one chunk of the head itself stays within it)."""

    @property
    def any(self) -> bool:
        """True when at least one weight goes to the host."""
        return self.input_embedding or self.lm_head


@dataclass
class HostStats:
    """What the host embedding did (host-side counters, no device values)."""

    host_ids: int = 0
    """Forwards whose lookup used the collator's host ids (no device read)."""
    no_host_ids: int = 0
    """Forwards that came without the host copy of the ids: on a GPU each reads them back from the device
    (one blocking copy; on a CPU the ids are already there)."""
    warned: bool = False
    """The one warning about device reads was logged."""
    rehomed: list = field(default_factory=list)
    """Names of weights moved back to the host after a ``model.to`` (Note: [host weights survive model.to])."""


class HostIds:
    """The collator's CPU ``input_ids``, boxed so device placement leaves them on the host (no ``.to``)."""

    __slots__ = ("ids",)

    def __init__(self, ids: torch.Tensor):
        self.ids = ids

    def __getstate__(self):
        return self.ids

    def __setstate__(self, ids):
        self.ids = ids


class HostIdsCollator:
    """Wraps a collator so each batch also carries its ``input_ids`` as they are on the host. Picklable."""

    def __init__(self, collator):
        self.collator = collator

    def __call__(self, features, *args, **kwargs):
        batch = self.collator(features, *args, **kwargs)
        ids = batch.get("input_ids") if hasattr(batch, "get") else None
        if isinstance(ids, torch.Tensor) and ids.device.type == "cpu":
            batch[HOST_IDS_KWARG] = HostIds(ids)
        return batch


# ------------------------------------------------------------------------------------------ shared parts


def _move_storage(param: torch.Tensor, swap) -> None:
    """Move ``param``'s storage to (pinned) host memory; revert moves it back to where it was (``param`` is the undo's
    argument, not a closure's: a deepcopy's revert moves the copy's storage, not the original's)."""
    device = param.device
    param.data = to_host(param.data)
    swap.on_undo(_move_back, param, device)


def _move_back(param: torch.Tensor, device: torch.device) -> None:
    param.data = param.data.to(device)


def _keep_on_host(param: torch.Tensor, name: str, stats: HostStats | None) -> None:
    """Note: [host weights survive model.to] (a ``model.half()`` leaves an unpinned host copy: pinned again)."""
    if param.device.type == "cpu" and (param.is_pinned() or not torch.cuda.is_available()):
        return
    where = param.device
    param.data = to_host(param.data)
    logger.info("fastkit: %s was moved to %s (model.to / a cast); back in pinned host memory", name, where)
    if stats is not None:
        stats.rehomed.append(name)


def _refuse_trainable(param: torch.Tensor, what: str) -> None:
    if param.requires_grad:
        raise FastkitError(f"{what} is kept on the host (HostWeights) but now trains (requires_grad=True: full "
                           "fine-tuning or PEFT modules_to_save). Load the model again without host_weights "
                           "(get_peft_model(host_weights=fastkit.HostWeights())) to train it.")


def _tied(model: torch.nn.Module) -> bool:
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    return emb is not None and head is not None and getattr(head, "weight", None) is getattr(emb, "weight", None)


def _frozen_reason(module: torch.nn.Module, what: str) -> str | None:
    if getattr(module, "modules_to_save", None) is not None:
        return f"the {what} trains (PEFT modules_to_save)"
    if any(p.requires_grad for p in module.parameters()):
        return f"the {what} is trainable (full fine-tuning or modules_to_save): only a frozen one can stay on the host"
    return None


def _plain_frozen_reason(module: torch.nn.Module | None, what: str, kind: type, why_plain: str) -> str | None:
    """Why ``module`` (the model's input embedding or lm_head) cannot stay on the host: missing, trainable, or not
    exactly ``kind`` (``why_plain`` says what a subclass may do differently); None when it can."""
    if module is None:
        return f"no {what}"
    reason = _frozen_reason(module, what)
    if reason:
        return reason
    if type(module) is not kind:
        return f"the {what} is a {type(module).__name__}, not a plain nn.{kind.__name__} ({why_plain})"
    return None


# ----------------------------------------------------------------------------------------- input embedding


def _embedding_forward(self, input_ids: torch.Tensor) -> torch.Tensor:
    stats = getattr(self, _STATS_ATTR)
    _refuse_trainable(self.weight, "The input embedding")
    _keep_on_host(self.weight, "the input embedding", stats)
    host = _HOST_IDS.get()
    if host is not None and tuple(host.shape) == tuple(input_ids.shape):
        stats.host_ids += 1
        return gather_rows(self.weight, host, input_ids.device)
    stats.no_host_ids += 1
    if input_ids.device.type != "cpu" and torch.is_grad_enabled() and not stats.warned:  # training, not generate()
        stats.warned = True
        logger.warning("fastkit: host embedding: token ids came without their host copy (%s); reading them "
                           "back from the device costs one sync per forward. fastkit.make_trainer's collator "
                           "carries them.", HOST_IDS_KWARG)
    return gather_rows(self.weight, input_ids.to("cpu"), input_ids.device)


def _decoder_forward(original):
    @functools.wraps(original)
    def forward(*args, fastkit_host_ids=None, **kwargs):
        ids = fastkit_host_ids.ids if isinstance(fastkit_host_ids, HostIds) else fastkit_host_ids
        if ids is not None and (not isinstance(ids, torch.Tensor) or ids.device.type != "cpu"):
            where = f" on {ids.device}" if isinstance(ids, torch.Tensor) else ""
            raise FastkitError(f"{HOST_IDS_KWARG} must be the token ids as a CPU tensor (or a HostIds box), got "
                               f"{type(ids).__name__}{where}.")
        token = _HOST_IDS.set(ids)
        try:
            return original(*args, **kwargs)
        finally:
            _HOST_IDS.reset(token)

    return forward


class HostEmbeddingPatch:
    """The frozen input embedding in host memory, rows gathered there (see the module docstring)."""

    name = HOST_EMBEDDING

    def check(self, model: torch.nn.Module) -> str | None:
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        reason = _plain_frozen_reason(emb, "input embedding", torch.nn.Embedding, "it may scale its rows")
        if reason:
            return reason
        if emb.max_norm is not None:
            return "the input embedding renormalizes rows (max_norm)"
        if _tied(model):
            return "the input embedding is tied to the lm_head (one weight): not kept on the host"
        if getattr(model, "base_model", model) is model:
            return "no decoder (base_model) to carry the host token ids"
        return None

    def apply(self, model: torch.nn.Module, swap) -> None:
        emb = model.get_input_embeddings()
        decoder = model.base_model
        swap.setattr(emb, _STATS_ATTR, HostStats())
        swap.setattr(emb, "forward", types.MethodType(_embedding_forward, emb))
        swap.setattr(decoder, "forward", _decoder_forward(decoder.forward))
        _move_storage(emb.weight, swap)


# ---------------------------------------------------------------------------------------------- lm_head


def head_rows(head: torch.nn.Module, tokens: int) -> int | None:
    """Vocabulary rows per streamed chunk for ``tokens`` tokens when ``head`` is kept on the host, else None."""
    block = getattr(head, _ROWS_ATTR, None)
    if block is None:
        return None
    _refuse_trainable(head.weight, "The lm_head")
    _keep_on_host(head.weight, "the lm_head", None)
    vocab, hidden = head.weight.shape
    by_head = block // (hidden * head.weight.element_size())  # one chunk of the head itself within the block
    return max(1, min(vocab_rows(tokens, vocab, block), by_head))


def _head_forward(self, hidden: torch.Tensor) -> torch.Tensor:
    rows = head_rows(self, hidden.numel() // hidden.shape[-1])
    if self.bias is not None:
        _keep_on_host(self.bias, "the lm_head bias", None)
    return streamed_linear(hidden, self.weight, self.bias, rows)


class HostLMHeadPatch:
    """The frozen lm_head in host memory, streamed in vocabulary chunks (see the module docstring)."""

    name = HOST_LM_HEAD

    def __init__(self, block_bytes: int = CHUNK_BYTES):
        self.block_bytes = block_bytes

    def check(self, model: torch.nn.Module) -> str | None:
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        reason = _plain_frozen_reason(head, "lm_head", torch.nn.Linear, "LoRA on the head?")
        if reason:
            return reason
        if _tied(model):
            return "the lm_head is tied to the input embedding (one weight): not kept on the host"
        return None

    def apply(self, model: torch.nn.Module, swap) -> None:
        head = model.get_output_embeddings()
        swap.setattr(head, _ROWS_ATTR, int(self.block_bytes))
        swap.setattr(head, "forward", types.MethodType(_head_forward, head))
        _move_storage(head.weight, swap)
        if head.bias is not None:
            _move_storage(head.bias, swap)


# -------------------------------------------------------------------------------------------------- API


def enable_host_weights(model: torch.nn.Module, config: HostWeights) -> dict[str, str]:
    """Keep what ``config`` asks for on the host. Returns ``{patch name: how}``; idempotent, revertible.

    Raises :class:`FastkitError` (the model left as it was) when a requested weight cannot stay on the host.
    """
    if not isinstance(config, HostWeights):
        raise FastkitError(f"host_weights must be a fastkit.HostWeights (or 'auto'), got {type(config).__name__}.")
    base = unwrap(model)
    wanted = [(HostEmbeddingPatch(), config.input_embedding), (HostLMHeadPatch(config.block_bytes), config.lm_head)]
    done: dict[str, str] = {}
    for patch, on in wanted:
        if not on:
            continue
        ok, how = apply_patch(base, patch)
        if not ok:
            revert(base, list(done))
            raise FastkitError(f"{patch.name}: cannot keep it on the host: {how}. Drop it from HostWeights "
                               "(it then stays on the GPU).")
        done[patch.name] = how
        w = (base.get_input_embeddings() if patch.name == HOST_EMBEDDING else base.get_output_embeddings()).weight
        logger.info("fastkit: %s: %s (%s, %.2f GiB in %s host memory)", patch.name, how, "x".join(map(str, w.shape)),
                    w.numel() * w.element_size() / 2**30, "pinned" if w.is_pinned() else "pageable")
    return done


def host_stats(model: torch.nn.Module) -> HostStats | None:
    """The host embedding's counters (None when it is not active)."""
    emb = unwrap(model).get_input_embeddings()
    return getattr(emb, _STATS_ATTR, None)


def wrap_collator(collator):
    """``collator`` that also puts the host ``input_ids`` in each batch (idempotent)."""
    return collator if isinstance(collator, HostIdsCollator) else HostIdsCollator(collator)


__all__ = ["HOST_EMBEDDING", "HOST_IDS_KWARG", "HOST_LM_HEAD", "HostEmbeddingPatch", "HostIds", "HostIdsCollator",
           "HostLMHeadPatch", "HostStats", "HostWeights", "enable_host_weights", "head_rows", "host_stats",
           "wrap_collator"]
