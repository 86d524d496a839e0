"""The checks an evaluation runs on each generated answer: built-in (exact match, contains) and the user's.

A check is a function ``(answer, reference, prompt) -> bool``. Users name theirs as the reward functions are named
(``--check json``, ``--check 'regex:^\\{'``, ``--check path/to/file.py:fn`` or ``module:fn``); a user function may
take fewer arguments (``fn(answer)`` or ``fn(answer, reference)``) and return a bool or a number (above 0 passes).
Every name is resolved before any model runs, so a typo fails in a second, not after an hour of generation.
"""

from __future__ import annotations

import inspect
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fastkit.checks import user_function
from fastkit.errors import FastkitError


@dataclass(frozen=True)
class Check:
    """One named check of a generated answer."""

    name: str
    """Its name in the report (``exact``, ``contains``, ``json``, ``regex:...``, ``file.py:fn``)."""
    fn: Callable[[str, str, str], bool]
    """``(answer, reference, prompt) -> bool``."""


def normalize(text: str) -> str:
    """Lower-cased, whitespace collapsed, a final '.' dropped: "The answer is Paris. " -> "the answer is paris"."""
    return " ".join(text.lower().split()).rstrip(".")


def exact(answer: str, reference: str, prompt: str = "") -> bool:
    """The answer equals the reference after :func:`normalize`."""
    return normalize(answer) == normalize(reference)


def contains(answer: str, reference: str, prompt: str = "") -> bool:
    """The reference (normalized) appears in the answer (normalized); an empty reference never passes."""
    want = normalize(reference)
    return bool(want) and want in normalize(answer)


def valid_json(answer: str, reference: str = "", prompt: str = "") -> bool:
    """The whole answer parses as JSON."""
    try:
        json.loads(answer)
    except ValueError:
        return False
    return True


BUILT_IN = (Check("exact", exact), Check("contains", contains))
"""Run on every answer with a reference."""


def parse_checks(specs: Any, flag: str = "checks") -> list[Check]:
    """The user's checks by name: ``json``, ``regex:PATTERN``, ``path/to/file.py:function`` or ``module:function``
    (one string, comma-separated names, or a list). A FastkitError names a spec that cannot be resolved."""
    if specs is None:
        return []
    names = [s.strip() for s in specs.split(",")] if isinstance(specs, str) else list(specs)
    out = []
    for spec in names:
        if not isinstance(spec, str) or not spec.strip():
            raise FastkitError(f"{flag}: {spec!r} is not a check; name one as json, regex:PATTERN, "
                               "path/to/file.py:function or module:function.")
        out.append(_check(spec.strip(), flag))
    return out


def _check(spec: str, flag: str) -> Check:
    if spec == "json":
        return Check("json", valid_json)
    if spec in ("exact", "contains"):
        raise FastkitError(f"{flag}: {spec!r} runs on every answer already; name only your own checks.")
    if spec.startswith("regex:"):
        try:
            pattern = re.compile(spec[6:])
        except re.error as exc:
            raise FastkitError(f"{flag} {spec}: not a regular expression ({exc}).") from exc
        return Check(spec, lambda answer, reference="", prompt="": pattern.search(answer) is not None)
    if ":" not in spec:
        raise FastkitError(f"{flag}: unknown check {spec!r}; name one as json, regex:PATTERN, "
                           "path/to/file.py:function or module:function.")
    return Check(spec, _user_check(user_function(spec, flag), spec))


def _user_check(fn: Callable, spec: str) -> Callable[[str, str, str], bool]:
    """``fn`` called with as many of (answer, reference, prompt) as it takes; its result a bool (a number: > 0)."""
    try:
        params = inspect.signature(fn).parameters.values()
        takes = 3 if any(p.kind == p.VAR_POSITIONAL for p in params) else sum(
            p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)
    except (TypeError, ValueError):  # a builtin without a signature: give it the answer only
        takes = 1
    if takes < 1:
        raise FastkitError(f"check {spec}: the function takes no argument; it is called as fn(answer), "
                           "fn(answer, reference) or fn(answer, reference, prompt).")

    def run(answer: str, reference: str, prompt: str) -> bool:
        result = fn(*(answer, reference, prompt)[:min(takes, 3)])
        if isinstance(result, bool):
            return result
        if isinstance(result, (int, float)) and result == result:  # NaN is no answer
            return result > 0
        raise FastkitError(f"check {spec} returned {result!r:.60} ({type(result).__name__}); a check returns "
                           "True/False (or a number: above 0 passes).")

    return run


__all__ = ["BUILT_IN", "Check", "contains", "exact", "normalize", "parse_checks", "valid_json"]
