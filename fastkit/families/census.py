"""The census: is fastkit exact on one model family? Proven on a tiny random twin, in about a second.

One function, :func:`check_family`, decides whether a ``model_type`` may be patched. It builds a tiny
twin (random weights, fp32, CPU) from the family's own config class (or from a given config: the
loader's self-check of a family the table does not know), then checks, against the same weights
unpatched:

- ``packed``: a packed row of several documents gives the logits AND every gradient of each document
  run alone (a document longer than the twin's sliding window, a 1-token-free mix of lengths);
- ``unpacked``: a plain (non-packed) batch gives the unpatched logits and gradients — this is the MoE
  routing check where the family has experts;
- ``calls``: every attention call of the packed forward ran per document (Note [attention ran per
  document] in :mod:`fastkit.patches.packing`), as many as the unpatched forward makes;
- ``syncs``: the packed forward makes no more host syncs (:class:`fastkit.SyncCounter`) than the
  same row unpacked — packing adds none;
- ``revert``: after :func:`fastkit.patching.revert` the model is as it was (attributes, hooks,
  config, parameters) and computes the unpatched logits;
- ``banner``: the load banner names exactly the active patches (and every note of the row);
- ``row``: what the table row says about the attention layout (windows, softcap, sinks, MLA, experts)
  is what the twin shows.

``tests/test_census.py`` runs it over every type of transformers' causal-LM mapping and writes
``docs/coverage.md``; a type whose row is in :data:`fastkit.registry.MODEL_TABLE` and fails is a red
test named after the type. The loader runs the same check on a family not in the table.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import time
from dataclasses import dataclass, field, replace

import torch

from fastkit import _hf, registry
from fastkit.errors import FastkitError
from fastkit.families.patch import patch_with_facts
from fastkit.patching import active_patches, revert
from fastkit.syncs import SyncCounter

logger = logging.getLogger(__name__)

LENGTHS = (9, 14, 4, 13)
"""Documents of the census' packed row: one longer than every twin's sliding window (8)."""
CENSUS_WINDOW = 8
"""The sliding window of every census twin that has one (shorter than two of the documents)."""
LOGIT_TOL = 1e-5
"""Max |Δlogits| allowed, relative to max(1, max|logits|): fp32, different summation order (~1e-7 seen)."""
GRAD_TOL = 1e-4
"""Max |Δgrad| per tensor allowed, relative to that tensor's max |grad| (fp32; ~1e-6 seen)."""

CHECKS = ("row", "packed", "calls", "syncs", "unpacked", "revert", "banner")


@dataclass
class CensusResult:
    """What the census found for one type."""

    model_type: str
    """The type checked."""
    status: str = "error"
    """``exact`` (every check passed), ``refused`` (fastkit declines: ``reason``), ``wrong`` (a check failed),
    ``error`` (the twin could not be built or run, ``reason``)."""
    passed: list[str] = field(default_factory=list)
    """Names of the checks that passed (see :data:`CHECKS`)."""
    failed: str = ""
    """The first check that failed."""
    reason: str = ""
    """Why the type is not exact, in words."""
    logits: float | None = None
    """Max |Δlogits| of the packed row vs each document alone."""
    grads: float | None = None
    """Worst per-tensor relative |Δgrad| of the packed row vs each document alone."""
    moe: bool = False
    """The twin has experts fastkit routes (then ``unpacked`` is the MoE parity check)."""
    syncs: int | None = None
    """Host syncs of the patched packed step (it may make no more than the same row unpacked)."""
    attention: str = ""
    """The attention backend the twin ran (``eager`` where the family has no sdpa)."""
    seconds: float = 0.0
    """Wall time of this check."""
    label: str = ""
    """The status as docs/coverage.md shows it (set by :func:`coverage_markdown`)."""

    @property
    def exact(self) -> bool:
        return self.status == "exact"


class CensusFailure(AssertionError):
    """A census check failed; ``check`` names it."""

    def __init__(self, check: str, message: str):
        super().__init__(message)
        self.check = check


# ------------------------------------------------------------------------------------------------ twin


def twin_model(config, attn: str = "sdpa") -> tuple[torch.nn.Module, str]:
    """A random fp32 CPU causal LM of ``config``; falls back to eager where the family has no ``attn``."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config), dtype=torch.float32, attn_implementation=attn)
    except ValueError as exc:
        if attn == "eager" or "attention" not in str(exc).lower():
            raise
        return twin_model(config, "eager")
    return model.eval(), attn


def _census_window(config):
    """The twin's sliding window made shorter than a census document, so windows are exercised."""
    window = getattr(config, "sliding_window", None)
    if isinstance(window, int) and not isinstance(window, bool) and window > CENSUS_WINDOW:
        config = copy.deepcopy(config)
        config.sliding_window = CENSUS_WINDOW
    return config


def layout_of(model: torch.nn.Module) -> dict[str, bool]:
    """The attention / experts layout a row must state, read from a built model."""
    from fastkit.patches.moe.patch import experts_modules, looped_modules

    cfg = model.config
    layer_types = getattr(cfg, "layer_types", None) or []
    window = getattr(cfg, "sliding_window", None)
    windowed = any("sliding" in str(t) or "local" in str(t) for t in layer_types) or (
        isinstance(window, int) and window > 0 and getattr(cfg, "use_sliding_window", True) is not False)
    return dict(
        sliding_window=bool(windowed),
        softcap=bool(getattr(cfg, "attn_logit_softcapping", None)),
        attention_sinks=any(n.endswith(".sinks") for n, _ in model.named_parameters()),
        mla=getattr(cfg, "kv_lora_rank", None) is not None,
        moe=bool(experts_modules(model) or looped_modules(model)),
    )


def candidate_row(model_type: str, model: torch.nn.Module, attn: str) -> registry.ModelFacts:
    """The plain row a family would get: its layout as the twin shows it, nothing else special."""
    return registry.ModelFacts(model_type, default_attn=attn, **layout_of(model))


# --------------------------------------------------------------------------------------------- running


def _batch(vocab: int, lengths=LENGTHS, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    ids = torch.randint(3, min(vocab, 300), (1, total), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths])[None]  # (1, T): restarts at 0 per document
    return ids, pos


def _loss(logits: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """A fixed random projection of the logits: every logit reaches the gradients."""
    g = torch.Generator().manual_seed(seed)
    return (logits * torch.randn(logits.shape, generator=g)).sum()


def _step(model, **inputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    logits = model(**inputs, use_cache=False).logits.float()
    _loss(logits).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


def _per_document(model, ids, lengths):
    model.zero_grad(set_to_none=True)
    outs, start = [], 0
    for n in lengths:
        outs.append(model(input_ids=ids[:, start:start + n], use_cache=False).logits.float())
        start += n
    logits = torch.cat(outs, dim=1)  # (1, T, V)
    _loss(logits).backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return logits.detach(), grads


def _logit_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max()) / max(1.0, float(want.abs().max()))


def _grad_err(got: dict, want: dict) -> float:
    if got.keys() != want.keys():
        missing = sorted(want.keys() ^ got.keys())[:3]
        raise CensusFailure("packed", f"gradients reach different parameters ({missing})")
    worst = 0.0
    for name, w in want.items():
        scale = float(w.abs().max())
        err = float((got[name] - w).abs().max())
        worst = max(worst, err / scale if scale > 0 else err)
    return worst


def fingerprint(model: torch.nn.Module) -> dict:
    """Everything a patch may change, by content: instance attributes, hooks (the packed-batch guard too: it goes
    through the patch mechanism, so revert removes it), config, parameters."""
    mods = {}
    for name, m in model.named_modules():
        own = {k: repr(v) if not isinstance(v, torch.Tensor) else ("tensor", v.data_ptr())
               for k, v in vars(m).items() if k not in ("_parameters", "_buffers", "_modules")
               and "hooks" not in k and not k.startswith("_fastkit_report")}
        hooks = {k: [(h, repr(f)) for h, f in v.items()] for k, v in vars(m).items()
                 if "hooks" in k and isinstance(v, dict)}
        mods[name] = (own, hooks)
    params = {n: (p.data_ptr(), tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()}
    configs = {k: repr(v) for k, v in sorted(vars(model.config).items())}
    return dict(modules=mods, params=params, config=configs, attn=_hf.attn_implementation(model.config),
                experts=_hf.experts_implementation(model.config))


def _diff(a: dict, b: dict) -> str:
    for key in a:
        if a[key] != b[key]:
            if isinstance(a[key], dict):
                bad = [k for k in a[key].keys() | b[key].keys() if a[key].get(k) != b[key].get(k)]
                return f"{key}: {sorted(map(str, bad))[:3]}"
            return f"{key}: {a[key]!r} -> {b[key]!r}"
    return ""


# ----------------------------------------------------------------------------------------------- checks


def _check_row(row: registry.ModelFacts, model) -> None:
    shown = layout_of(model)
    for name, value in shown.items():
        if getattr(row, name) != value:
            raise CensusFailure("row", f"the row says {name}={getattr(row, name)}, the twin shows {value}")


def _patch(model, row: registry.ModelFacts, self_verified: bool = False):
    with _quiet():
        patch_with_facts(model, row, self_verified=self_verified)
    if registry.PACKING not in active_patches(model):
        from fastkit.patching import report

        why = report(model).skipped.get(registry.PACKING, "not applied")
        raise CensusFailure("refused", f"packing not applied: {why}")


@contextlib.contextmanager
def _quiet():
    """The twin's load banner and transformers' warnings are not the census' output."""
    fk, tf = logging.getLogger("fastkit"), logging.getLogger("transformers")
    levels = fk.level, tf.level
    fk.setLevel(logging.WARNING + 1)
    tf.setLevel(logging.ERROR)
    try:
        yield
    finally:
        fk.setLevel(levels[0])
        tf.setLevel(levels[1])


def _check_banner(model, row: registry.ModelFacts, self_verified: bool) -> None:
    from fastkit.patching import report

    banner = report(model).banner()
    active = active_patches(model)
    shown = {line.split("+ ", 1)[1].split(":")[0] for line in banner.splitlines() if ":   + " in line}
    if shown != set(active):
        raise CensusFailure("banner", f"the banner shows patches {sorted(shown)}, active are {active}")
    if row.note and row.note not in banner:
        raise CensusFailure("banner", f"the row's note {row.note!r} is not in the banner")
    if self_verified != ("self-verified" in banner):
        raise CensusFailure("banner", f"self-verified={self_verified} but the banner says otherwise:\n{banner}")


def _run_checks(res: CensusResult, row: registry.ModelFacts, base, self_verified: bool, grads: bool) -> None:
    from fastkit.patches.packing import LENGTHS_KWARG

    _check_row(row, base)
    res.passed.append("row")
    if not row.packing:
        return _run_moe_only(res, row, base)
    ids, pos = _batch(base.config.get_text_config().vocab_size)
    want_logits, want_grads = _per_document(base, ids, LENGTHS)
    plain_ids = ids.view(2, -1)  # (2, T/2): a plain batch, no packing
    base_plain = _step(base, input_ids=plain_ids)

    patched = copy.deepcopy(base)
    before = fingerprint(patched)
    _patch(patched, row, self_verified)
    _check_same(_step(patched, input_ids=plain_ids), base_plain, "unpacked")  # also warms up one-time checks
    res.passed.append("unpacked")
    packed = {"input_ids": ids, "position_ids": pos, LENGTHS_KWARG: [list(LENGTHS)]}
    try:
        with SyncCounter() as packed_syncs:
            got_logits, got_grads = _step(patched, **packed)
    except FastkitError as exc:
        raise CensusFailure("calls", str(exc).split(". ")[0]) from exc
    res.logits = _logit_err(got_logits, want_logits)
    if not res.logits <= LOGIT_TOL:
        raise CensusFailure("packed", f"packed logits differ from each document alone by {res.logits:.3g}")
    res.grads = _grad_err(got_grads, want_grads) if grads else None
    if grads and not res.grads <= GRAD_TOL:
        raise CensusFailure("packed", f"packed gradients differ from each document alone by {res.grads:.3g}")
    res.passed += ["packed", "calls"]
    with SyncCounter() as plain_syncs:  # the same row as one plain sequence on the same patched model
        _step(patched, input_ids=ids)
    res.syncs = packed_syncs.total
    if packed_syncs.total > plain_syncs.total:
        raise CensusFailure("syncs", f"the packed step makes {packed_syncs.total} host syncs, the same row unpacked "
                                     f"{plain_syncs.total} ({dict(packed_syncs.by_op)})")
    res.passed.append("syncs")
    _check_banner(patched, row, self_verified)
    revert(patched)
    diff = _diff(before, fingerprint(patched))
    if diff:
        raise CensusFailure("revert", f"revert left the model changed: {diff}")
    with torch.no_grad():
        again = patched(input_ids=plain_ids, use_cache=False).logits.float()
    if not torch.equal(again, base_plain[0]):
        raise CensusFailure("revert", "after revert the logits are not the unpatched ones")
    res.passed += ["revert", "banner"]


def _run_moe_only(res: CensusResult, row: registry.ModelFacts, base) -> None:
    """A row with ``packing=False`` (its note says why): MoE parity, revert and banner only."""
    ids, _ = _batch(base.config.get_text_config().vocab_size)
    plain_ids = ids.view(2, -1)  # (2, T/2)
    want = _step(base, input_ids=plain_ids)
    patched = copy.deepcopy(base)
    before = fingerprint(patched)
    with _quiet():
        patch_with_facts(patched, row)
    if row.moe and registry.MOE not in active_patches(patched):
        raise CensusFailure("unpacked", "the row says moe=True but the moe patch did not apply")
    _check_same(_step(patched, input_ids=plain_ids), want, "unpacked")
    _check_banner(patched, row, False)
    revert(patched)
    diff = _diff(before, fingerprint(patched))
    if diff:
        raise CensusFailure("revert", f"revert left the model changed: {diff}")
    res.passed += ["unpacked", "banner", "revert"]
    raise CensusFailure("refused", f"packing off in the row: {row.note}")


def _check_same(got, want, check: str) -> None:
    err = _logit_err(got[0], want[0])
    if not err <= LOGIT_TOL:
        raise CensusFailure(check, f"{check} logits differ from unpatched by {err:.3g}")
    gerr = _grad_err(got[1], want[1])
    if not gerr <= GRAD_TOL:
        raise CensusFailure(check, f"{check} gradients differ from unpatched by {gerr:.3g}")


def check_family(model_type: str, config=None, row: registry.ModelFacts | None = None, *,
                 self_verified: bool = False, grads: bool = True) -> CensusResult:
    """Run every census check for ``model_type`` (its table row, else a plain candidate row).

    ``config`` is the twin's config (default: :func:`fastkit.families.twins.twin_config` of the row's type: the
    row's twin sizes, else the config class's defaults shrunk). Never raises for a family that fails:
    the result says which check and why.
    """
    from fastkit.families import twins

    start = time.perf_counter()
    res = CensusResult(model_type)
    row = row or registry.facts_for(model_type)
    if row is None and model_type in registry.REFUSED:
        res.status, res.failed, res.reason = "refused", "refused", registry.REFUSED[model_type]
        return res
    try:
        with _quiet():
            config = config if config is not None else twins.twin_config(model_type)
            text = row.text_config if row is not None else None
            if text:  # a composite checkpoint: the twin is its text model
                config = getattr(config, text)
            config = _census_window(config)
            if getattr(config, "is_encoder_decoder", False):
                raise CensusFailure("refused", "an encoder-decoder family (its decoder as a causal LM): not a "
                                               "decoder-only model fastkit packs")
            base, res.attention = twin_model(config, row.default_attn if row is not None else "sdpa")
        row = row or candidate_row(model_type, base, res.attention)
        if res.attention != row.default_attn:
            row = replace(row, default_attn=res.attention)
        res.moe = row.moe
        _run_checks(res, row, base, self_verified, grads)
        res.status = "exact"
    except CensusFailure as exc:
        res.status = "refused" if exc.check in ("refused", "calls") else "wrong"
        res.failed, res.reason = exc.check, str(exc)
    except Exception as exc:  # the twin does not build or run: not patched, say why
        res.failed, res.reason = "error", f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:160]}"
    res.seconds = time.perf_counter() - start
    return res


def self_check(config) -> tuple[registry.ModelFacts | None, str]:
    """``(row, verdict)`` for a family not in the table, from the census on a twin of ``config``.

    The row is the plain row the twin proved (None when a check failed); the verdict is the banner's
    line: "self-verified ..." or the check that failed and why.
    """
    from fastkit.families import twins

    model_type = config.model_type
    try:
        twin_config = twins.twin_of(config)
    except Exception as exc:  # a config whose sizes cannot be shrunk: no proof, no patch
        return None, f"self-check: no tiny twin of this config ({type(exc).__name__}: {exc})"
    result = check_family(model_type, twin_config, grads=True)
    if not result.exact:
        logger.warning("fastkit: %s is not in fastkit's table and failed the self-check (%s: %s); it loads "
                       "unpatched and packed batches are refused.", model_type, result.failed, result.reason)
        return None, f"self-check failed ({result.failed}): {result.reason}"
    with _quiet():
        base, attn = twin_model(twin_config, "sdpa")
    row = candidate_row(model_type, base, attn)
    return row, (f"self-verified on a tiny twin of its own config ({', '.join(result.passed)}; "
                 f"max |dlogits| {result.logits:.1e})")


__all__ = ["CHECKS", "CensusFailure", "CensusResult", "candidate_row", "check_family", "fingerprint", "layout_of",
           "self_check", "twin_model"]
