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

import numpy as np

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
