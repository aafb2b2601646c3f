"""What an op is: its OpDef (attributes record, shape rule, numpy reference, effects), the
shape/dtype pairs shape rules map, and the helpers every op table uses.

ir/ops.py holds the generic ops and merges the op families' tables (each family's
ir/<family>.py defines its ops' records, shape rules and OpDefs); both build on this module.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .graph import Shape

ShapeDtype = tuple[Shape, str]


@dataclass(frozen=True)
class NoAttrs:
    pass


@dataclass(frozen=True)
class OpDef:
    name: str
    attrs: type
    infer: Callable[[Sequence[ShapeDtype], Any], list[ShapeDtype]]
    ref: Callable[..., Any]  # (inputs, attrs, ctx) -> list of outputs
    fused: bool = False
    effects: bool = False
    # input positions (given the input count) whose weight's block minimums the reference reads;
    # the interpreter appends them to the inputs (ir/interp.py)
    block_mins: Callable[[int, Any], tuple[int, ...]] = lambda n_inputs, attrs: ()


def one_output(f: Callable[..., np.ndarray]) -> Callable[..., list[np.ndarray]]:
    """A reference of one output as the (inputs, attrs, ctx) -> list of outputs an OpDef holds
    (wrapped: it keeps f's module, where tests/test_layering.py looks for the op's family)."""

    @functools.wraps(f)
    def ref(ins: Sequence[np.ndarray], a: Any, ctx: Any) -> list[np.ndarray]:
        return [f(ins, a, ctx)]

    return ref


def same_shape(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    """The shape rule of an op whose output is its first input's shape and dtype."""
    return [ins[0]]
