"""Teacher-forced logits: the model's prediction at every position of a known token sequence, as
`ggufc eval` and `Model.eval` compute them (perplexity, comparisons with llama.cpp's goldens)."""

from __future__ import annotations

from typing import Any

import numpy as np


def teacher_forced_logits(session: Any, tokens: Any, chunk: int) -> Any:
    """Logits at every position from an empty context, fed `chunk` tokens per call.

    chunk 1 goes through "decode", the path generation uses; larger chunks through "prefill_all".
    """
    session.reset()
    rows = []
    for start in range(0, tokens.size, chunk):
        piece = tokens[start : start + chunk]
        if chunk == 1:
            rows.append(session.forward(piece)[None, :])
        else:
            rows.append(session.forward(piece, all_logits=True))
    return np.concatenate(rows)
