"""How ggufc speaks to its user: one-line errors (never a traceback) and progress on stderr."""

from __future__ import annotations

import sys


class GgufcError(Exception):
    """A user-facing problem (bad input, a model or artifact that cannot be used): one line."""


def progress(message: str) -> None:
    print(f"ggufc: {message}", file=sys.stderr, flush=True)


def one_line(exc: BaseException, limit: int = 300) -> str:
    if isinstance(exc, OSError) and exc.strerror and exc.filename:
        return f"{exc.filename}: {exc.strerror}"
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])  # str(KeyError) adds quotes
    lines = str(exc).strip().splitlines()
    return lines[0][:limit] if lines else type(exc).__name__


class ArgumentError(GgufcError, ValueError):
    """An argument's value ggufc refuses (a bad target, a context of 0 tokens): checked before any work."""
