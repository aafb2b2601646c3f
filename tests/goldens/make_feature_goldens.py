"""Regenerate llama.cpp's logits for the project fixtures that reach what llama.cpp's own random
fixtures cannot (optional oracle, not run by the tests): an 8-layer smollm3 (NoPE layers 3 and 7),
a mistral3 with YaRN (factor 4 over an original context of 8, log multiplier 1) and the query
temperature 0.5, a phi3 with fused attn_qkv, rope over 3/4 of the head and the long LongRoPE
factors with attn_factor 1.19, a gpt-oss with YaRN 32 over an original context of 8 keeping its
magnitude (1 + 0.1 ln 32 on q and k) and a 4-cell window on even layers. The fixtures are written
by `tests/support/fixtures.py` (deterministic: the sha256 is kept with the logits, and the test refuses a
fixture that differs); the logits are llama.cpp's on 48 tokens in the three feeding modes, f32 KV
cache, 2 threads, as ../shared/golden.
Needs `llama-cpp-python` (0.3.36 wrote the files here): `python -m
tests.goldens.make_feature_goldens [NAME ...]` from the repository root (default: every one).
"""

from __future__ import annotations

import hashlib
import sys
import tempfile
from pathlib import Path

import numpy as np

from tests.support.feature_fixtures import FEATURE_FIXTURES, feature_tokens, write_feature_fixture

HERE = Path(__file__).resolve().parent


def logits(model: Path, tokens: list[int], chunk: int) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model), n_ctx=64, n_threads=2, n_threads_batch=2, n_batch=chunk,
                          n_ubatch=chunk, logits_all=True, verbose=False, type_k=llama_cpp.GGML_TYPE_F32,
                          type_v=llama_cpp.GGML_TYPE_F32)
    llm.eval(tokens)
    out = np.array(llm.scores[: len(tokens)], dtype=np.float32)
    llm.close()
    return out


def main() -> None:
    tokens = feature_tokens()
    with tempfile.TemporaryDirectory() as tmp:
        for name in sys.argv[1:] or FEATURE_FIXTURES:
            path = write_feature_fixture(name, Path(tmp))
            modes = {"logits_prefill": len(tokens), "logits_decode": 1, "logits_chunk7": 7}
            np.savez_compressed(HERE / f"{name}.npz", tokens=tokens,
                                sha256=np.array(hashlib.sha256(path.read_bytes()).hexdigest()),
                                **{k: logits(path, tokens.tolist(), n) for k, n in modes.items()})
            print("wrote", name)


if __name__ == "__main__":
    main()
