"""How ggufc speaks to its user: one-line errors (never a traceback) and progress on stderr."""

from __future__ import annotations

import sys


class GgufcError(Exception):
    """A user-facing problem (bad input, a model or artifact that cannot be used): one line."""


def progress(message: str) -> None:
    print(f"ggufc: {message}", file=sys.stderr, flush=True)


def one_line(exc: BaseException, limit: int = 300) -> str:
    """The first line of an exception's message; a library's long one shortened at a word (ggufc's
    own are one line already, their hints at the end, and are kept whole)."""
    if isinstance(exc, OSError) and exc.strerror and exc.filename:
        return f"{exc.filename}: {exc.strerror}"
    if isinstance(exc, KeyError) and exc.args:
        return str(exc.args[0])  # str(KeyError) adds quotes
    lines = str(exc).strip().splitlines()
    if not lines:
        return type(exc).__name__
    return lines[0] if isinstance(exc, GgufcError) else shorten(lines[0], limit)


def shorten(text: str, limit: int) -> str:
    """`text` in at most `limit` characters, cut after a whole word (" ..." marks the cut)."""
    if len(text) <= limit:
        return text
    cut = text[: limit - len(" ...") + 1].rsplit(" ", 1)[0].rstrip(" ,;:")
    return f"{cut} ..."


class ArgumentError(GgufcError, ValueError):
    """An argument's value ggufc refuses (a bad target, a context of 0 tokens): checked before any work."""
