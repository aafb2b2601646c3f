"""A MoE model compiled for haswell gives llama.cpp's AVX2 logits bit for bit: two small qwen3moe
files (every matrix Q4_K, every matrix Q6_K; tests/support/moe_order_fixtures.py) against the
logits llama.cpp 0.3.36's AVX2 build wrote for them (tests/goldens/moe-avx2-orders.npz), a 64-token
prompt in one call and one token per call. They take every MoE order llama.cpp's build takes there:
repacked Q4_K experts (one GEMV per token and expert), tiled Q6_K experts where an expert has >= 8
rows, the F32 router through tinyBLAS and ggml_vec_dot_f32, ggml_soft_max, the float64
renormalisation, the unfused weighted sum and the vector SwiGLU. (The kernels before these orders
were 0.1 apart on the Q6_K file, 3e-6..9e-3 on the Q4_K one.) Likewise two small qwen35 files
(tests/goldens/hybrid-avx2-orders.npz): the delta-net recurrence per token in ggml_vec_dot_f32's
order, the causal conv's products rounded, build_gdn_l2_norm's steps, the gated norm, Q4_K gate
projections in the tiled order (before: 0.09-0.12 apart, 17-25 of 64 positions equal)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ggufc.driver.compile import compile_model
from ggufc.runtime import Session
from tests.support import moe_order_fixtures as M

GOLDENS = Path(__file__).resolve().parent / "goldens"
HASWELL = {"kind": "llvm", "mcpu": "haswell", "num-cores": 2}


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(M.GOLDENS))
@pytest.mark.parametrize("qtype", M.QTYPES)
def test_file_compiled_for_avx2_gives_llama_cpps_logits(arch: str, qtype: str, tmp_path: Path) -> None:
    golden = np.load(GOLDENS / M.GOLDENS[arch])
    model = M.write(qtype, tmp_path / f"{arch}-{qtype}.gguf", arch)
    assert M.sha256(model) == str(golden[f"{qtype}_sha256"]), "the fixture writer changed: regenerate the golden"
    compile_model(model, HASWELL, tmp_path / "art")  # type: ignore[arg-type]
    tokens = golden["tokens"]
    with Session(tmp_path / "art") as session:
        prefill = np.asarray(session.forward(tokens, all_logits=True))
        session.reset()
        decode = np.stack([np.asarray(session.forward(tokens[i:i + 1], all_logits=True))[0]
                           for i in range(len(tokens))])
    np.testing.assert_array_equal(prefill, golden[f"{qtype}_prefill"])
    np.testing.assert_array_equal(decode, golden[f"{qtype}_decode"])
