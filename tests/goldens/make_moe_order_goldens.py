"""Regenerate `moe-avx2-orders.npz` (qwen3moe) or `hybrid-avx2-orders.npz` (qwen35) with llama.cpp
(optional oracle, not run by the tests): `python -m tests.goldens.make_moe_order_goldens [ARCH]`.

For each file of tests/support/moe_order_fixtures.py of that architecture: `{qtype}_sha256` (the file's hash, so a
change of the fixture writer shows as such), `{qtype}_prefill` (llama.cpp's logits of the 64
tokens in one batch) and `{qtype}_decode` (one token per call), and `tokens`. f32 KV cache, no flash
attention, 2 threads. Needs `llama-cpp-python` built for AVX2 (0.3.36 wrote the file here:
-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON, AVX-512 and AMX off), run by the
Python that `GGUFC_LLAMA_PYTHON` names (its own virtual environment) or this one.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from benchmarks.llama_cpp_side import llama_python
from tests.support import moe_order_fixtures as M

HERE = Path(__file__).resolve().parent


# run under llama-cpp-python's Python: model, batch, out.npy, then the tokens
LOGITS = """
import sys, numpy as np, llama_cpp
model, batch, out, tokens = sys.argv[1], int(sys.argv[2]), sys.argv[3], [int(t) for t in sys.argv[4:]]
llm = llama_cpp.Llama(model_path=model, n_ctx=512, n_batch=batch, n_ubatch=batch, n_threads=2, n_threads_batch=2,
                      logits_all=True, verbose=False, type_k=llama_cpp.GGML_TYPE_F32, type_v=llama_cpp.GGML_TYPE_F32,
                      flash_attn=False)
llm.eval(tokens)
np.save(out, np.array(llm.scores[: len(tokens)], dtype=np.float32))
"""


def _logits(model: Path, batch: int, tmp: Path) -> np.ndarray:
    out = tmp / "logits.npy"
    subprocess.run([llama_python(), "-c", LOGITS, str(model), str(batch), str(out), *map(str, M.tokens())],
                   check=True)
    return np.load(out)


def main() -> None:
    arch = sys.argv[1] if len(sys.argv) > 1 else "qwen3moe"
    out: dict[str, np.ndarray] = {"tokens": M.tokens()}
    with tempfile.TemporaryDirectory() as tmp:
        for qtype in M.QTYPES:
            path = M.write(qtype, Path(tmp) / f"{arch}-{qtype}.gguf", arch)
            out[f"{qtype}_sha256"] = np.array(M.sha256(path))
            out[f"{qtype}_prefill"] = _logits(path, 512, Path(tmp))
            out[f"{qtype}_decode"] = _logits(path, 1, Path(tmp))
    np.savez_compressed(HERE / M.GOLDENS[arch], **out)
    print(f"wrote {HERE / M.GOLDENS[arch]}")


if __name__ == "__main__":
    main()
