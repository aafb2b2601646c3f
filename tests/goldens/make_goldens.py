"""Regenerate the Q4_1/Q5_1 goldens in this folder with llama.cpp (optional oracle, not run by the tests).

The fixtures are `../shared/golden/fixtures/llama-dense.gguf` quantized by llama.cpp's own
quantizer (ftype MOSTLY_Q4_1 / MOSTLY_Q5_1: q/k/v/o/ffn and token_embd in the named type, output
Q6_K), and the logits are llama.cpp's on the shared fixture tokens in the three feeding modes
(one batch, one token at a time, batches of 7), f32 KV cache and 2 threads like ../shared/golden.
Needs `llama-cpp-python` (0.3.36 wrote the files here): `python tests/goldens/make_goldens.py`.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SHARED = HERE.parents[2] / "shared" / "golden"
FTYPES = {"Q4_1": 3, "Q5_1": 9}  # llama_ftype: LLAMA_FTYPE_MOSTLY_Q4_1, LLAMA_FTYPE_MOSTLY_Q5_1


def quantize(src: Path, dst: Path, ftype: int) -> None:
    import llama_cpp

    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.nthread = ftype, 2
    if llama_cpp.llama_model_quantize(str(src).encode(), str(dst).encode(), ctypes.byref(params)) != 0:
        raise SystemExit(f"llama.cpp could not quantize {src}")


def logits(model: Path, tokens: np.ndarray, chunk: int | None) -> np.ndarray:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(model), n_ctx=256, n_threads=2, n_threads_batch=2, n_batch=512,
                          logits_all=True, verbose=False, type_k=llama_cpp.GGML_TYPE_F32,
                          type_v=llama_cpp.GGML_TYPE_F32)
    step = chunk or len(tokens)
    for i in range(0, len(tokens), step):
        llm.eval(tokens[i : i + step].tolist())
    out = np.array(llm.scores[: len(tokens)], dtype=np.float32)
    llm.close()
    return out


def main() -> None:
    tokens = np.load(SHARED / "logits" / "llama-dense.npz")["tokens"].astype(np.int32)
    manifest = {"_reference": {"engine": "llama.cpp via llama-cpp-python", "kv_cache": "f32", "threads": 2}}
    for qtype, ftype in FTYPES.items():
        name = f"llama-dense-{qtype}"
        model = HERE / f"{name}.gguf"
        quantize(SHARED / "fixtures" / "llama-dense.gguf", model, ftype)
        modes = {"logits_prefill": logits(model, tokens, None), "logits_decode": logits(model, tokens, 1),
                 "logits_chunk7": logits(model, tokens, 7)}
        np.savez(HERE / f"{name}.npz", tokens=tokens, **modes)
        manifest[name] = {"fixture_sha256": hashlib.sha256(model.read_bytes()).hexdigest(),
                          "max_abs_prefill_vs_decode": float(np.abs(modes["logits_prefill"]
                                                                    - modes["logits_decode"]).max())}
        print(name, manifest[name])
    (HERE / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
