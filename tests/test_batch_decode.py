"""Batched decode (`decode_batch`, codegen/batch_rows.py) and slot groups (runtime/slot_group.py):
B sequences at different positions, with different prompt lengths, stepped in one call, each row
compared with the logits that sequence gets alone; which graphs are refused, and why; one copy of
the weights for every slot; a group that released its memory and comes back."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ggufc.codegen.batch_rows import decode_batch_refusal
from ggufc.codegen.target import resolve_target
from ggufc.driver.compile import compile_model
from ggufc.frontend.load import load_model
from ggufc.ir.batch_rows import batch_refusal
from ggufc.runtime.session import ContextOverflowError, Session
from ggufc.runtime.slot_group import SlotGroup
from tests.support.fixture_spec import FixtureSize
from tests.support.fixtures import write_fixture

# head dim 32: attention runs the row-streaming kernel real models use (dims of 16 take the TE one)
SIZE = FixtureSize(n_head=2, n_head_kv=1, head_dim=32, n_ctx=64)
PROMPT_LENGTHS = (5, 17, 9)


def _compile(tmp: Path, arch: str, qtype: str, size: FixtureSize = SIZE) -> Path:
    gguf = write_fixture(arch, tmp / f"{arch}.gguf", qtype=qtype, size=size)
    compile_model(gguf, "llvm", tmp / arch, n_ctx=64)
    return tmp / arch


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Q4_0: every matmul on the 8-bit kernels where the CPU has them (their GEMM rows are the
    GEMV's arithmetic), else on the float ones (qmatmul_rows)."""
    return _compile(tmp_path_factory.mktemp("batch"), "llama", "Q4_0")


@pytest.fixture(scope="module")
def qwen3moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _compile(tmp_path_factory.mktemp("batch"), "qwen3moe", "Q8_0")


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """F32 weights, head dim 16: the float matmuls and the TE attention kernel."""
    return _compile(tmp_path_factory.mktemp("batch"), "qwen3", "F32", FixtureSize())


def _alone(artifact: Path, history: list[int], prompt: int) -> np.ndarray:
    """The logits of the last token of `history` in a fresh session fed as the slot was: its first
    `prompt` tokens in one call, then one token per call (a prompt's matmuls may sum their rows in
    another order than one-token calls, as llama.cpp's AVX2 build's do: tinyBLAS for float32
    weights, the repacked or tiled K-quant GEMMs)."""
    with Session(artifact) as session:
        session.forward(history[:prompt])
        for token in history[prompt:-1]:
            session.forward([token])
        return session.forward(history[-1:])


def _batched_vs_alone(artifact: Path, steps: int = 5, lengths: tuple[int, ...] = PROMPT_LENGTHS) -> tuple[float, int]:
    """(largest |batched - alone| over every row of every step, rows compared): slots at different
    positions, stepped in varying orders and subsets."""
    rng = np.random.default_rng(7)
    group = SlotGroup(artifact, len(lengths))
    assert group.batch_refused is None
    n_vocab = group.n_vocab
    histories = [[int(t) for t in rng.integers(0, n_vocab, n)] for n in lengths]
    for session, prompt in zip(group.sessions, histories, strict=True):
        session.forward(prompt)
    worst, rows = 0.0, 0
    orders = [[0, 1, 2], [2, 0, 1], [1, 2], [2, 1, 0], [0, 2]]
    for step in range(steps):
        order = orders[step % len(orders)]
        tokens = {slot: int(rng.integers(0, n_vocab)) for slot in order}
        out = group.decode_batch([(slot, tokens[slot]) for slot in order])
        assert out.shape == (len(order), n_vocab) and out.dtype == np.float32
        for row, slot in enumerate(order):
            histories[slot].append(tokens[slot])
            assert group.sessions[slot].n_past == len(histories[slot])
            alone = _alone(artifact, histories[slot], lengths[slot])
            worst = max(worst, float(np.abs(out[row] - alone).max()))
            rows += 1
    group.close()
    return worst, rows


def test_llama_batched_rows_equal_each_sequence_alone_bit_for_bit(llama: Path) -> None:
    worst, rows = _batched_vs_alone(llama)
    assert rows == 13 and worst == 0.0


def test_qwen3moe_batched_rows_equal_each_sequence_alone_bit_for_bit(qwen3moe: Path) -> None:
    worst, rows = _batched_vs_alone(qwen3moe)
    assert rows == 13 and worst == 0.0


def test_qwen3_f32_batched_rows_equal_each_sequence_alone_bit_for_bit(qwen3: Path) -> None:
    """F32 weights: the batched step's rows take each dot product's lanes in the one-token GEMV's
    order (formats.cpu_schedules.qmatmul_rows; at AVX2, kernels/lane_dot_matmul.py's vec_dot
    order)."""
    worst, rows = _batched_vs_alone(qwen3)
    assert rows == 13 and worst == 0.0


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Attention with a sink logit per head on every layer, a window of 4 on the even layers, the
    fused top-k-then-softmax routing; Q8_0, so the experts run the 8-bit kernels (F32 experts'
    batched rows are not yet their one-token GEMV's sums: qwen3moe F32 differs by 7e-7 too)."""
    return _compile(tmp_path_factory.mktemp("batch"), "gpt-oss", "Q8_0")


def test_gpt_oss_sinks_batched_rows_equal_each_sequence_alone_bit_for_bit(gpt_oss: Path) -> None:
    worst, rows = _batched_vs_alone(gpt_oss, lengths=(20, 9, 13))  # every prompt past the window
    assert rows == 13 and worst == 0.0


def test_slots_share_one_copy_of_the_weights_and_come_back_after_a_release(llama: Path) -> None:
    group = SlotGroup(llama, 3)
    params = [s._params for s in group.sessions]
    assert all(p is params[0] for p in params)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8], [9]]
    for session, prompt in zip(group.sessions, prompts, strict=True):
        session.forward(prompt)
    before = group.decode_batch([(0, 10), (1, 11), (2, 12)])
    group.release_device()
    shared = group.sessions[0]._weights
    assert all(s._params == () for s in group.sessions) and shared is not None and shared._loaded is None
    for session in group.sessions:
        session.truncate(session.n_past - 1)  # restores, then cuts the last token back
    group.restore_device()
    assert all(s._params is group.sessions[0]._params for s in group.sessions)
    again = group.decode_batch([(2, 12), (0, 10), (1, 11)])
    np.testing.assert_array_equal(again, before[[2, 0, 1]])
    group.close()


def test_bad_batched_steps_are_refused_and_change_nothing(llama: Path) -> None:
    group = SlotGroup(llama, 2)
    group.sessions[0].forward(list(range(1, 63)))  # 62 of 64 cells used
    group.sessions[1].forward([1, 2])
    with pytest.raises(ValueError, match="distinct slots"):
        group.decode_batch([(0, 1), (0, 2)])
    with pytest.raises(ValueError, match="distinct slots"):
        group.decode_batch([(2, 1)])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        group.decode_batch([(1, 3), (0, 10_000)])
    group.decode_batch([(0, 1), (1, 3)])
    group.decode_batch([(0, 1), (1, 4)])
    with pytest.raises(ContextOverflowError):
        group.decode_batch([(1, 5), (0, 1)])
    assert [s.n_past for s in group.sessions] == [64, 4]
    group.close()


def test_recurrent_and_gpu_graphs_are_refused_in_one_line(tmp_path: Path) -> None:
    hybrid = load_model(write_fixture("qwen35", tmp_path / "qwen35.gguf"), None).graphs["prefill_all"]
    reason = batch_refusal(hybrid)
    assert reason is not None and "not row-wise" in reason and "\n" not in reason
    plain = load_model(write_fixture("llama", tmp_path / "llama.gguf"), None).graphs["prefill_all"]
    assert batch_refusal(plain) is None
    gpu = decode_batch_refusal(plain, resolve_target("vulkan"))
    assert gpu is not None and "CPU" in gpu


def test_sinks_with_a_head_dim_off_the_32_step_are_refused_in_one_line(tmp_path: Path) -> None:
    """The per-row kernel with sinks is the 32-value-step one: gpt-oss with head dim 16 decodes one
    sequence per call, the reason named."""
    graph = load_model(write_fixture("gpt-oss", tmp_path / "gpt-oss.gguf", size=FixtureSize(head_dim=16)),
                       None).graphs["prefill_all"]
    assert batch_refusal(graph) is None
    reason = decode_batch_refusal(graph, resolve_target("llvm"))
    assert reason is not None and "sinks" in reason and "\n" not in reason
