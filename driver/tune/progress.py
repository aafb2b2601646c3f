"""The progress line a session prints per workload round."""


from __future__ import annotations

import sys
from typing import IO


class ProgressBar:
    """One line per workload round: trials done, default and best time so far, speedup.

    On a terminal the current workload's line is rewritten in place; in a log, one line per round.
    """

    def __init__(self, stream: IO[str] | None = None, width: int = 20) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._open = False

    def message(self, text: str) -> None:
        self._end_line()
        print(f"ggufc: {text}", file=self.stream, flush=True)

    def workload(self, i: int, n: int, label: str, trials: int, goal: int, default_us: float | None,
                 best_us: float | None, note: str = "", final: bool = False) -> None:
        filled = 0 if goal <= 0 else min(self.width, round(self.width * trials / goal))
        bar = "#" * filled + "-" * (self.width - filled)
        speed = f" ({default_us / best_us:.2f}x)" if default_us and best_us else ""
        text = (f"ggufc: tune [{i}/{n}] {label[:34]:<34} [{bar}] {trials:>4}/{goal:<4} trials  "
                f"default {_us(default_us)}  best {_us(best_us)}{speed}{('  ' + note) if note else ''}")
        if self.tty:
            print("\r\x1b[2K" + text, end="" if not final else "\n", file=self.stream, flush=True)
            self._open = not final
        else:
            print(text, file=self.stream, flush=True)

    def _end_line(self) -> None:
        if self._open:
            print(file=self.stream, flush=True)
            self._open = False


def _us(v: float | None) -> str:
    return "      -   " if v is None else f"{v:8.1f} us"
