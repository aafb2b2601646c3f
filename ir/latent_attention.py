"""Multi-head latent attention (MLA, absorbed form): numpy references.

The latent cache holds one row `[kv_lora | rope]` per token and layer (not expanded K/V). The
absorbed form folds `attn_k_b` into the query (q_nope [T,H,NOPE] -> [T,H,kv_lora]) and applies
`attn_v_b` to the attention's latent output ([T,H,kv_lora] -> [T,H,Dv]): both are per-head
matrices, `head_matmul`. Attention itself is the ordinary op over the latent cache, whose rows are
both the keys and (their first kv_lora columns) the values.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .op_def import NoAttrs, OpDef, ShapeDtype
from .op_def import one_output as _one


def head_matmul_ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [T,H,K], w [H,N,K] -> [T,H,N]: head h multiplies by its own matrix (x[:, h] @ w[h].T)."""
    return np.einsum("thk,hnk->thn", x, w.astype(x.dtype))


# ----------------------------------------------------------------------------------------------
# the family's ops: records (attributes), shape rules and OpDefs, merged into ir/ops.py's OPS


def _head_matmul_shape(ins: Sequence[ShapeDtype], a: Any) -> list[ShapeDtype]:
    (xs, _), (ws, _) = ins
    if len(xs) != 3 or len(ws) != 3 or xs[1] != ws[0] or xs[2] != ws[2]:
        raise ValueError(f"head_matmul: x {xs} [T, H, K] and weight {ws} [H, N, K] disagree")
    return [((xs[0], xs[1], ws[1]), "float32")]


LATENT_OPS: dict[str, OpDef] = {
    op.name: op
    for op in [
        # MLA: the absorbed per-head projections (attn_k_b into q, attn_v_b on the latent output)
        OpDef("head_matmul", NoAttrs, _head_matmul_shape, _one(lambda i, a, c: head_matmul_ref(i[0], i[1]))),
    ]
}
