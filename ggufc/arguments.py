"""Checks of argument values, shared by the command line and the Python API: the same refusal in
the same words, made before any work. Each takes the value and the name the caller knows it by
(`n_ctx` in the API; argparse prefixes the option itself, so the CLI passes none) and returns the
value, or raises an ArgumentError (a GgufcError and a ValueError)."""

from __future__ import annotations

import math
import operator
import os
from typing import Any

from ggufc.messages import ArgumentError
from ggufc.runtime.targets import device_for


def refuse(name: str | None, problem: str) -> ArgumentError:
    return ArgumentError(f"{name}: {problem}" if name else problem)


def integer(value: Any, name: str | None) -> int:
    if isinstance(value, bool):
        raise refuse(name, f"expected an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise refuse(name, f"expected an integer, got {value!r}") from None


def number(value: Any, name: str | None) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise refuse(name, f"expected a number, got {value!r}")
    return float(value)


def positive_int(value: Any, name: str | None = None) -> int:
    n = integer(value, name)
    if n <= 0:
        raise refuse(name, f"must be a positive integer, got {value}")
    return n


def non_negative_int(value: Any, name: str | None = None) -> int:
    n = integer(value, name)
    if n < 0:
        raise refuse(name, f"must be >= 0, got {value}")
    return n


def non_negative_float(value: Any, name: str | None = None) -> float:
    x = number(value, name)
    if not 0.0 <= x < math.inf:
        raise refuse(name, f"must be a finite number >= 0, got {value}")
    return x


def positive_float(value: Any, name: str | None = None) -> float:
    x = number(value, name)
    if not 0.0 < x < math.inf:
        raise refuse(name, f"must be a finite number > 0, got {value}")
    return x


def probability(value: Any, name: str | None = None) -> float:
    x = number(value, name)
    if not 0.0 < x <= 1.0:
        raise refuse(name, f"must be in (0, 1], got {value}")
    return x


def port_number(value: Any, name: str | None = None) -> int:
    n = integer(value, name)
    if not 0 <= n <= 65535:
        raise refuse(name, f"must be a TCP port (0 to 65535), got {value}")
    return n


def available_cpus() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def thread_count(value: Any, name: str | None = None) -> int:
    n = positive_int(value, name)
    available = available_cpus()
    if n > available:
        raise refuse(name, f"{n} threads, but this process may run on {available} CPUs")
    return n


def target(value: Any, name: str | None = None) -> str:
    """A target ggufc compiles for (runtime.targets holds the list)."""
    if not isinstance(value, str):
        raise refuse(name, f"expected a target name, got {value!r}")
    try:
        device_for(value)
    except ArgumentError as exc:
        raise refuse(name, str(exc)) from None
    return value


def optional(check: Any, value: Any, name: str) -> Any:
    """`check(value, name)`, letting None (the default) through."""
    return None if value is None else check(value, name)
