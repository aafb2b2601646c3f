"""The benchmark models' generator (benchmarks/make_bench_model.py) and the decode roofline's byte
count (benchmarks/bench_side_by_side.py), on narrow variants of the benchmark shapes."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import gguf
import numpy as np
import pytest

from benchmarks import make_bench_model as gen
from benchmarks.bench_side_by_side import decode_weight_bytes
from benchmarks.llama_cpp_side import llama_cpp_missing
from tests.support.fixture_spec import FixtureOptions
from tests.support.fixtures import plan_tensors

Written = dict[str, tuple[Path, gguf.GGUFReader]]


def narrow(shape: str) -> gen.Shape:
    """The benchmark shape with two layers and small widths (rows still whole K-quant blocks)."""
    s = gen.SHAPES[shape]
    return gen.Shape(s.arch, dataclasses.replace(s.size, n_embd=64, n_layer=2, n_head=2, n_head_kv=1,
                                                 head_dim=32, n_ff=128, n_expert=8, n_expert_used=2))


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, gguf.GGUFReader]]:
    """Each shape written and read back once (reading SmolLM2's 49152-token vocabulary takes seconds)."""
    out = tmp_path_factory.mktemp("bench_models")
    files = {}
    for shape in ("dense", "moe", "hybrid"):
        path = out / f"{shape}.gguf"
        gen.write_f16(narrow(shape), path, seed=0)
        files[shape] = (path, gguf.GGUFReader(path))
    return files


@pytest.mark.slow  # writing and reading SmolLM2's vocabulary three times: ~20 s of CPU
@pytest.mark.parametrize("shape", ["dense", "moe", "hybrid"])
def test_tensors_are_the_fixture_plan_with_smollm2_tokenizer(written: Written, shape: str) -> None:
    reader = written[shape][1]
    s = narrow(shape)
    assert reader.fields["general.architecture"].contents() == s.arch
    planned = {t.name: t.shape for t in plan_tensors(s.arch, s.size, FixtureOptions())}
    assert {t.name: tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors} == planned
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == gen.SMOLLM2_VOCAB
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
    matrices = [t for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.F16]
    assert matrices and all(np.isfinite(t.data).all() for t in reader.tensors)


@pytest.mark.slow
def test_matrices_keep_their_input_size(written: Written) -> None:
    """N(0, 1/fan_in): a row dotted with a unit-variance vector has unit variance."""
    reader = written["dense"][1]
    for t in reader.tensors:
        if t.name.endswith("ffn_down.weight") or t.name.endswith("attn_q.weight"):
            w = np.asarray(t.data, dtype=np.float32)
            assert abs(float(w.std()) * np.sqrt(w.shape[-1]) - 1.0) < 0.05, t.name


@pytest.mark.slow
def test_decode_bytes_count_one_embedding_row_and_the_used_experts(written: Written) -> None:
    path, reader = written["moe"]
    size = narrow("moe").size
    by_name = {t.name: int(t.n_bytes) for t in reader.tensors}
    experts = sum(n for name, n in by_name.items() if "_exps." in name)
    rest = sum(n for name, n in by_name.items() if "_exps." not in name and name != "token_embd.weight")
    embedding_row = by_name["token_embd.weight"] // size.vocab
    used = experts * size.n_expert_used // size.n_expert
    assert decode_weight_bytes(path) == rest + embedding_row + used


def test_missing_llama_cpp_is_one_line(tmp_path: Path) -> None:
    reason = llama_cpp_missing(str(tmp_path / "no-such-python"))
    assert reason is not None and "\n" not in reason and "llama-cpp-python" in reason


@pytest.mark.parametrize("prefetch", [False, True])
def test_stream_read_kernel_reads_every_word(prefetch: bool) -> None:
    """The stream-read roofline kernel (benchmarks/stream_read.py) xors every word of each task's part."""
    import tvm

    from benchmarks.stream_read import LANES, read_kernel
    from ggufc.codegen.target import cpu_target
    from ggufc.codegen.tvm_util import aligned_empty, to_tvm

    n_words, tasks = 1 << 14, 2
    src = aligned_empty(n_words, np.int32)
    src[:] = np.random.default_rng(0).integers(-(2**31), 2**31 - 1, n_words, dtype=np.int32)
    out = np.zeros((tasks, LANES), np.int32)
    lib = tvm.compile(tvm.IRModule({"stream_read": read_kernel(n_words, tasks, prefetch)}), target=cpu_target(2))
    lib["stream_read"](to_tvm(src), out_t := to_tvm(out))
    want = np.bitwise_xor.reduce(src.reshape(tasks, -1, LANES), axis=1)
    np.testing.assert_array_equal(np.from_dlpack(out_t), want)
