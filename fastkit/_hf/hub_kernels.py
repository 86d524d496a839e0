"""The stateful layers' kernels: which function transformers resolved for each hub-kernel global of a hybrid
modeling module, and the kernel packages' versions. Part of :mod:`fastkit._hf` (its docstring says the rules); the
transformers range the varlen path was read on, and the check that combines them (``varlen_unavailable``), are the
package's own (``fastkit._hf.VARLEN_TRANSFORMERS``).
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import torch

# transformers 5.24 wraps each kernel function of a hybrid modeling module (``causal_conv1d_fn``,
# ``torch_chunk_gated_delta_rule``, ``mamba2_chunk_scan`` ...) in
# ``integrations.hub_kernels.use_kernel_func_from_hub_with_fallback(func_name, package)``: at import it resolves
# ``package``'s function (``implementation``) or keeps the torch reference (``torch_function``); every call
# filters the mixer's ``**kwargs`` down to the resolved function's parameters, and the torch reference
# *raises* when given ``cu_seqlens`` / ``seq_idx``. The mixers forward their ``**kwargs`` to these calls and
# feed the conv channel-last (``in_proj(x).transpose(1, 2)``). transformers 5.25 routes the conv through a new
# ``causal_conv1d_forward(conv1d, x, cache, layer_idx, activation, **kwargs)`` that, without a cache, calls
# ``causal_conv1d_fn(x, weight, bias, activation=, **kwargs)`` as the mixers did; mamba-2 mixers call
# ``mamba2_chunk_scan(..., **kwargs)`` from a new ``mamba2_scan_forward``; with ``kernels`` installed each global is
# a ``Func`` module (:func:`hub_function`), and a package's kernel on an input of a device it does not list
# (``_PACKAGE_SUPPORTED_DEVICES``: causal-conv1d and mamba-ssm "cuda") runs the torch reference. checked:
# transformers 5.24.0, 5.25.0 (modeling files of the ten families below, hub_kernels.py). Can go when transformers
# says which implementation it resolved (a public attribute on the wrapper) — then only the version table stays.
VARLEN_KERNELS: dict[str, tuple[tuple[str, str], ...]] = {
    "gated_delta": (("causal_conv1d_fn", "causal_conv1d"), ("torch_chunk_gated_delta_rule", "fla")),
    "short_conv": (("causal_conv1d_fn", "causal_conv1d"),),
    "mamba2": (("causal_conv1d_fn", "causal_conv1d"), ("mamba2_chunk_scan", "mamba_ssm"),
               ("mamba2_split_conv1d_scan_combined", "mamba_ssm")),
}
"""Per varlen kind (``ModelFacts.varlen``): ``(modeling-module global, package)`` of every kernel a packed
forward of that mixer calls (no cache); each must resolve to the package for the varlen path."""


VARLEN_PACKAGES: dict[str, tuple[tuple[str, ...], str, str]] = {
    # fla-core 0.6.0 (wheel read): chunk_gated_delta_rule(cu_seqlens=, cu_seqlens_cpu=, chunk_indices=), batch 1,
    # chunk_indices = [[doc, chunk-in-doc]] for chunk_size 64, taken as given by every kernel of the fwd and bwd.
    "fla": (("fla-core", "flash-linear-attention"), "0.6.0", "0.7"),
    # causal-conv1d 1.6.1 (github 0d2252d) and 1.7.0 (sdist): seq_idx int32 (B, T), channel-last x only
    # (TORCH_CHECK in csrc/causal_conv1d.cpp), no initial_states / final states with it.
    "causal_conv1d": (("causal-conv1d",), "1.6.1", "1.8"),
    # mamba-ssm 2.3.2.post1 (github e9594ce): mamba_chunk_scan_combined / mamba_split_conv1d_scan_combined(seq_idx=),
    # int32 (B, T); no host reads in ops/triton/ssd_*.py.
    "mamba_ssm": (("mamba-ssm",), "2.3.2", "2.4"),
}
"""Per package: distribution names, and the version range ``[lo, hi)`` whose varlen arguments were read."""


def _closure(fn: Callable) -> dict:
    """The free variables ``fn`` closes over ({} for a builtin or a callable object)."""
    import inspect

    try:
        return inspect.getclosurevars(fn).nonlocals
    except TypeError:
        return {}


def hub_function(fn: Any) -> Any:
    """The plain function behind a hub-kernel global: ``fn`` itself, or the one a ``kernels`` ``Func`` wraps.

    transformers 5.25 requires ``kernels`` 0.19.1 and, with it installed, its ``use_kernel_forward_from_hub``
    turns every decorated *function* of a modeling module into an instance of a per-function ``nn.Module``
    class ``Func`` whose ``forward`` closes over the function (``func``). 5.24 took ``kernels`` only in
    [0.18.2, 0.19.0) and otherwise left the function as it was. Reads ``Func.forward``'s closure.
    checked: transformers 5.24.0, 5.25.0; kernels 0.19.1 (``_internals/layer/layer.py`` ``_create_func_module``).
    Can go when ``kernels``' ``Func`` exposes the function it wraps (a public attribute).
    """
    if isinstance(fn, torch.nn.Module) and type(fn).__name__ == "Func":
        inner = _closure(type(fn).forward).get("func")
        return inner if callable(inner) else fn
    return fn


def kernel_global(module_cls: type, name: str) -> Callable | None:
    """transformers' fallback wrapper of the kernel ``name`` in ``module_cls``'s modeling module, unwrapped from
    ``kernels``' ``Func`` (:func:`hub_function`); None when that global is missing.
    checked: transformers 5.24.0, 5.25.0. Can go when :func:`hub_function` can (``Func`` exposing its function).
    """
    fn = hub_function(getattr(sys.modules.get(module_cls.__module__), name, None))
    return fn if callable(fn) else None


def kernel_reference(module_cls: type, name: str) -> Callable | None:
    """The torch reference behind the kernel ``name`` of ``module_cls``'s modeling module (the function the
    family wrote, before ``use_kernel_func_from_hub_with_fallback`` wrapped it; its ``functools.wraps``
    ``__wrapped__``). checked: transformers 5.24.0, 5.25.0. Can go when :func:`hub_function` can.
    """
    fn = kernel_global(module_cls, name)
    ref = _closure(fn).get("torch_function") if fn is not None else None
    return ref if callable(ref) else getattr(fn, "__wrapped__", None)


def resolved_kernel(module_cls: type, name: str) -> Callable | None:
    """The package function transformers resolved for the kernel ``name`` of ``module_cls``'s modeling module.

    None when that global is missing, is not transformers' fallback wrapper, or runs the torch reference.
    Reads the wrapper's closure (``implementation``, ``torch_function``), unwrapped from ``kernels``' ``Func``
    where 5.25 put it there (:func:`hub_function`). checked: transformers 5.24.0, 5.25.0.
    Can go when transformers says which implementation it resolved (a public attribute on the wrapper), as
    :data:`VARLEN_KERNELS` notes.
    """
    fn = kernel_global(module_cls, name)
    if fn is None:
        return None
    free = _closure(fn)
    impl, ref = free.get("implementation"), free.get("torch_function")
    return impl if callable(impl) and ref is not None and impl is not ref else None


def package_version(package: str) -> str | None:
    """The installed version of a kernel package (import name), or None when it cannot be told.
    checked: fla-core 0.6.0, causal-conv1d 1.6.1 / 1.7.0, mamba-ssm 2.3.2 (VARLEN_PACKAGES). Can go when
    transformers reports which kernel package and version it resolved (as for :data:`VARLEN_KERNELS`).
    """
    from importlib import metadata

    for dist in VARLEN_PACKAGES.get(package, ((package,),))[0]:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    module = sys.modules.get(package)
    version = getattr(module, "__version__", None)
    return version if isinstance(version, str) else None
