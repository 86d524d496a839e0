"""The compat layer for Python's standard library: its private names fastkit reads, each checked on the Pythons
fastkit supports (tests/test_hf_compat.py: the scan allows private names here, in fastkit/_hf.py and fastkit/_torch.py
only). Imports nothing beyond the standard library, so the CLI's light paths (--help, --print-config, plan) stay free
of torch."""

from __future__ import annotations

from typing import Any


def argparse_flags(parser) -> dict[str, tuple[Any, dict[str, str]]]:
    """Per subcommand of ``parser``: ``(its parser, {flag: destination})`` for the flags that take one value (not
    ``help``, not the ``append`` kinds, which may be repeated). argparse keeps both in private attributes
    (``parser._actions``, a subparser's ``_option_string_actions``); fastkit reads them to refuse two spellings of one
    option in one command (``--lr`` and ``--learning-rate``).

    checked: python 3.10, 3.11, 3.12, 3.13 (argparse's ``_SubParsersAction``, ``_AppendAction``, ``_AppendConstAction``,
    ``_ExtendAction``, ``_HelpAction``).
    Can go when argparse exposes the actions of a parser publicly.
    """
    import argparse

    repeatable = (argparse._AppendAction, argparse._AppendConstAction, argparse._HelpAction,
                  argparse._CountAction)
    found = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                flags = {flag: a.dest for flag, a in sub._option_string_actions.items()
                         if not isinstance(a, repeatable)}
                found[name] = (sub, flags)
    return found


__all__ = ["argparse_flags"]
