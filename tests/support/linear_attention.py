"""Linear attention's compiled delta-rule kernels held to the float64 sequential reference."""

from __future__ import annotations

from typing import Any

import numpy as np
import tvm

from ggufc.ir import linear_attention as R


def worst_error_over_calls(fn: Any, state: np.ndarray, inputs: tuple[np.ndarray, ...], head_map: str,
                           scale: float) -> float:
    """Largest relative error of a compiled delta-net kernel's outputs and carried state against the
    float64 sequential reference, over calls of 70, 1 and 3 tokens on the carried state."""
    s_ref, s_dev = state, tvm.runtime.tensor(state.astype(np.float32))
    worst = 0.0
    for t0, t1 in ((0, 70), (70, 71), (71, 74)):
        part = [x[t0:t1] for x in inputs]
        s_ref, o_ref = R.gated_delta_net_ref(s_ref, *part, head_map, scale)
        out = tvm.runtime.tensor(np.zeros(o_ref.shape, np.float32))
        fn(s_dev, *(tvm.runtime.tensor(x.astype(np.float32)) for x in part), out)
        worst = max(worst, float(np.max(np.abs(out.numpy() - o_ref)) / np.max(np.abs(o_ref))),
                    float(np.max(np.abs(s_dev.numpy() - s_ref)) / np.max(np.abs(s_ref))))
    return worst
