"""Helpers shared by the tests: one training step with its gradients, gradient comparison, a fake clock."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Step(NamedTuple):
    """What one forward + backward produced."""

    loss: torch.Tensor
    """The loss, detached."""
    logits: torch.Tensor
    """The logits, detached."""
    grads: dict[str, torch.Tensor | None]
    """Gradient of every parameter that requires one (None where backward did not reach it)."""


def grads_of(model: torch.nn.Module) -> dict[str, torch.Tensor | None]:
    """``{name: grad}`` for every parameter of ``model`` that requires a gradient."""
    return {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def forward_backward(model: torch.nn.Module, ids: torch.Tensor | None = None, **inputs) -> Step:
    """Zero the gradients, run ``model`` and backward its loss; returns loss, logits and gradients.

    ``ids`` are both the inputs and the labels (``model(ids, labels=ids)``); or pass the batch as
    keyword arguments (``forward_backward(model, **batch)``).
    """
    model.zero_grad(set_to_none=True)
    if ids is not None:
        inputs = {"input_ids": ids, "labels": ids, **inputs}
    out = model(**inputs)
    out.loss.backward()
    return Step(out.loss.detach(), out.logits.detach(), grads_of(model))


def _as_tensors(x) -> dict[str, torch.Tensor | None]:
    return grads_of(x) if isinstance(x, torch.nn.Module) else dict(x)


def assert_tensors_close(got: dict, want: dict, *, atol: float, rtol: float, what: str = "gradient",
                         per: str = "element") -> None:
    """Every tensor of ``got`` close to the one of the same name in ``want``; names the worst one if not.

    ``per="element"``: ``|got - want| <= atol + rtol * |want|`` element by element (``torch.isclose``,
    like ``torch.testing.assert_close``). ``per="tensor"``: ``max|got - want| <= atol + rtol * max|want|``
    for the whole tensor (a tolerance relative to the tensor's scale). Both dicts must have the same
    names, none missing (None); the error message gives the worst-matching name, its max error and how
    many tensors failed.
    """
    assert got.keys() == want.keys(), (f"{what}s differ in names: only got {sorted(got.keys() - want.keys())}, "
                                       f"only want {sorted(want.keys() - got.keys())}")
    assert len(want) > 0, f"no {what}s to compare"
    failed = []  # (how far over the tolerance, name, max abs error, tolerance at the worst element)
    for name, w in want.items():
        g = got[name]
        assert w is not None and g is not None, (
            f"{what} of {name} is missing (got {g is not None}, want {w is not None})")
        assert g.shape == w.shape and g.dtype == w.dtype, (
            f"{what} of {name}: got {tuple(g.shape)} {g.dtype}, want {tuple(w.shape)} {w.dtype}")
        err = (g.detach() - w.detach()).abs().double()
        if per == "tensor":
            tol = atol + rtol * w.detach().abs().max().item()
            worst = err.max().item() if err.numel() else 0.0
            if not worst <= tol:  # NaN fails too
                failed.append((worst / tol if tol else float("inf"), name, worst, tol))
            continue
        close = torch.isclose(g.detach(), w.detach(), rtol=rtol, atol=atol)
        if bool(close.all()):
            continue
        tol = atol + rtol * w.detach().abs().double()
        over = torch.nan_to_num(err / tol, nan=float("inf"), posinf=float("inf")).masked_fill(close, 0.0)
        i = int(over.flatten().argmax())
        failed.append((over.flatten()[i].item(), name, err.flatten()[i].item(), tol.flatten()[i].item()))
    if failed:
        ratio, name, err, tol = max(failed)
        raise AssertionError(f"{len(failed)} of {len(want)} {what}s differ; worst: {name}: max error {err:.3g} "
                             f"where {tol:.3g} is allowed ({ratio:.3g}x the tolerance; atol={atol}, rtol={rtol}, "
                             f"per {per})")


def assert_grads_close(a, b, *, atol: float, rtol: float, per: str = "element") -> None:
    """Gradients of ``a`` close to those of ``b``; models (their ``.grad``) or ``{name: grad}`` dicts.

    On failure the message names the worst-matching parameter and its max error; see
    :func:`assert_tensors_close` for ``per``.
    """
    assert_tensors_close(_as_tensors(a), _as_tensors(b), atol=atol, rtol=rtol, per=per)


def assert_params_close(a: torch.nn.Module, b: torch.nn.Module, *, atol: float, rtol: float) -> None:
    """Weights of ``a`` close to those of ``b`` (after training), worst parameter named on failure."""
    assert_tensors_close(dict(a.named_parameters()), dict(b.named_parameters()), atol=atol, rtol=rtol, what="weight")


class FakeClock:
    """A clock the test moves by hand (``clock.now += dt``): exact, machine-independent timings."""

    def __init__(self, start: float = 0.0):
        self.now = start

    def __call__(self) -> float:
        return self.now


def train_lora_steps(model: torch.nn.Module, steps: int, lr: float = 1e-2, seed: int = 0) -> torch.nn.Module:
    """A few AdamW steps on random byte-token rows (twin vocabulary), then ``model.eval()``."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    g = torch.Generator().manual_seed(seed)
    model.train()
    for _ in range(steps):
        ids = torch.randint(3, 259, (2, 16), generator=g)
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return model.eval()


def save_twin(model: torch.nn.Module, path) -> str:
    """Write ``model`` as a local checkpoint (safetensors + the in-process twin tokenizer); returns the path."""
    from fastkit.families.twins import twin_tokenizer

    model.save_pretrained(path, safe_serialization=True)
    twin_tokenizer().save_pretrained(path)
    return str(path)


def require_llama_cpp():
    """The llama_cpp module (the real GGUF client); fails in CI (CI=true: .ci/run installs the ``llamacpp``
    extra), skips elsewhere when llama-cpp-python is not installed."""
    import os

    import pytest

    try:
        import llama_cpp
    except ImportError:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("llama_cpp is not importable in CI: .ci/run must install fastkit-llm[llamacpp]")
        pytest.skip("llama-cpp-python is not installed (pip install 'fastkit-llm[llamacpp]')")
    return llama_cpp


def saved_vlm_twin(tmp_path_factory) -> str:
    """A Qwen2.5-VL twin saved as a checkpoint folder (weights, config, processor): a module fixture's folder."""
    from fastkit import FastModel

    folder = tmp_path_factory.mktemp("vlm")
    model, processor = FastModel.from_pretrained("qwen2_5_vl", twin=True, max_seq_length=256)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return str(folder)
