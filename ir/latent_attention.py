"""Multi-head latent attention (MLA, absorbed form): numpy references.

The latent cache holds one row `[kv_lora | rope]` per token and layer (not expanded K/V). The
absorbed form folds `attn_k_b` into the query (q_nope [T,H,NOPE] -> [T,H,kv_lora]) and applies
`attn_v_b` to the attention's latent output ([T,H,kv_lora] -> [T,H,Dv]): both are per-head
matrices, `head_matmul`. Attention itself is the ordinary op over the latent cache, whose rows are
both the keys and (their first kv_lora columns) the values.
"""

from __future__ import annotations

import numpy as np


def head_matmul_ref(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """x [T,H,K], w [H,N,K] -> [T,H,N]: head h multiplies by its own matrix (x[:, h] @ w[h].T)."""
    return np.einsum("thk,hnk->thn", x, w.astype(x.dtype))
