"""How ggufc speaks to its user: one-line errors (never a traceback) and progress on stderr."""

from __future__ import annotations

import os
import sys


class GgufcError(Exception):
    """A user-facing problem (bad input, a model or artifact that cannot be used): one line."""


class _Output:
    line_open = False  # generated text on stdout whose last line has no newline yet
    ended_by_status = False  # ... and whose line a status line ended since


def reset_output() -> None:
    _Output.line_open = _Output.ended_by_status = False


def write_output(text: str) -> None:
    """Generated text to stdout (flushed at once), remembering whether it ended its line."""
    sys.stdout.write(text)
    sys.stdout.flush()
    if text:
        _Output.line_open = not text.endswith("\n")
        _Output.ended_by_status = False


def end_output_line() -> None:
    """The newline after generated text, unless a status line has already begun a new one."""
    if not _Output.ended_by_status:
        write_output("\n")


def status_line(text: str) -> None:
    """One line on stderr; where stdout is the same terminal or pipe and its text did not end its
    line, the status starts a line of its own instead of being glued to the text."""
    if _Output.line_open and _same_destination():
        text = f"\n{text}"
        _Output.line_open, _Output.ended_by_status = False, True
    print(text, file=sys.stderr, flush=True)


def _same_destination() -> bool:
    try:
        out, err = os.fstat(sys.stdout.fileno()), os.fstat(sys.stderr.fileno())
    except (OSError, ValueError, AttributeError):  # captured or closed streams have no file
        return False
    return (out.st_dev, out.st_ino, out.st_rdev) == (err.st_dev, err.st_ino, err.st_rdev)


def progress(message: str) -> None:
    status_line(f"ggufc: {message}")


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
