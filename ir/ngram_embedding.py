"""The per-layer n-gram embedding's hash (`ple_hash`): numpy reference of llama.cpp's host-side
`set_input`.

PLE hash (`ple_hash`): the n-gram rows of llama.cpp's host-side `set_input`: for token t at
position p, the context is [tok, tok(p-1), ..., tok(p-n+1)] where a missing predecessor (p-s < 0)
or an EOS cuts it and everything older reads as EOS (the token itself is never cut); for each
n-gram size g in 2..n, mixed = XOR_j (ctx[j] * m[j]) in uint64 wrap-around arithmetic, and head
h of that size gets row mixed % size[h] + offset[h]. The token history is a state [C] of token ids
by position, written before the hash reads it, so chunked prefill and decode hash like one shot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .op_def import OpDef, ShapeDtype
from .op_def import one_output as _one

U64 = (1 << 64) - 1


def ple_contexts(hist: np.ndarray, tokens: np.ndarray, p0: int, ngram: int, eos: int) -> np.ndarray:
    """[T, n] n-gram contexts (the token, then its predecessors, EOS from the first cut on)."""
    t = len(tokens)
    ctx = np.empty((t, ngram), dtype=np.int64)
    for i in range(t):
        p = p0 + i
        ctx[i, 0] = int(tokens[i])
        cut = False
        for s in range(1, ngram):
            tok = -1 if cut or p - s < 0 else int(hist[p - s])
            cut = cut or tok < 0 or tok == eos
            ctx[i, s] = eos if cut else tok
    return ctx


def ple_hash_ref(hist: np.ndarray, tokens: np.ndarray, p0: int, ngram: int, heads_per_ngram: int,
                 multipliers: Sequence[int], offsets: Sequence[int], sizes: Sequence[int], eos: int) -> np.ndarray:
    """rows [T, (n-1)*heads_per_ngram] int32 into per_layer_token_embd."""
    ctx = ple_contexts(hist, tokens, p0, ngram, eos)
    n_heads = (ngram - 1) * heads_per_ngram
    rows = np.empty((len(tokens), n_heads), dtype=np.int32)
    for i in range(len(tokens)):
        for g in range(2, ngram + 1):
            mixed = 0
            for j in range(g):
                mixed ^= (int(ctx[i, j]) * int(multipliers[j])) & U64
            for k in range(heads_per_ngram):
                h = (g - 2) * heads_per_ngram + k
                rows[i, h] = mixed % int(sizes[h]) + int(offsets[h])
    return rows


# ----------------------------------------------------------------------------------------------
# the family's ops: records (attributes), shape rules and OpDefs, merged into ir/ops.py's OPS


@dataclass(frozen=True)
class PleHash:
    """PLE n-gram rows: (token history [C] int32, tokens [T], pos) -> [T, (n-1)*heads] int32."""

    ngram: int
    heads_per_ngram: int
    multipliers: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    eos: int


def _ple_hash_shape(ins: Sequence[ShapeDtype], a: PleHash) -> list[ShapeDtype]:
    (hs, hdt), (ts, _), _pos = ins
    n_heads = (a.ngram - 1) * a.heads_per_ngram
    if hdt != "int32" or len(hs) != 1 or len(a.offsets) < n_heads or len(a.sizes) < n_heads:
        raise ValueError(f"ple_hash: history {hdt}{list(hs)} or head tables do not fit {n_heads} heads")
    return [((ts[0], n_heads), "int32")]


NGRAM_OPS: dict[str, OpDef] = {
    op.name: op
    for op in [
        OpDef("ple_hash", PleHash, _ple_hash_shape,
              _one(lambda i, a, c: ple_hash_ref(i[0], i[1], int(i[2]), a.ngram, a.heads_per_ngram, a.multipliers,
                                                a.offsets, a.sizes, a.eos))),
    ]
}
