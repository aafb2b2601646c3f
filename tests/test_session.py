"""Session on a hand-built Relax module that follows codegen's calling convention.

The toy "model" appends each token's embedding to a cache (a state, updated in place) and scores
every vocabulary entry against the sum of the cache rows up to the token (causal), so logits
depend on earlier chunks only through the state, exactly like a KV cache.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from ggufc.runtime.artifact import ArtifactError
from ggufc.runtime.artifact_writer import finalize_artifact, make_staging_dir
from ggufc.runtime.session import ContextOverflowError, Session, reserve_cpu_threads

tvm = pytest.importorskip("tvm")
from tvm import relax, tirx  # noqa: E402
from tvm.script import tirx as T  # noqa: E402

VOCAB, DIM, CTX, MAX_CHUNK = 16, 8, 24, 5
I64 = T.int64


@T.prim_func(s_tir=True)
def write_cache(
    tokens_h: T.handle,
    emb: T.Buffer((I64(VOCAB), I64(DIM)), "float32"),
    pos: T.int64,
    cache: T.Buffer((I64(CTX), I64(DIM)), "float32"),
):
    n = T.int64()
    tokens = T.match_buffer(tokens_h, (n,), "int32")
    for i, d in T.grid(n, I64(DIM)):
        with T.sblock("write"):
            vi, vd = T.axis.remap("SS", [i, d])
            cache[pos + vi, vd] = emb[T.Cast("int64", tokens[vi]), vd]


@T.prim_func(s_tir=True)
def logits_all(
    cache: T.Buffer((I64(CTX), I64(DIM)), "float32"),
    emb: T.Buffer((I64(VOCAB), I64(DIM)), "float32"),
    scale: T.Buffer((I64(1),), "float32"),
    pos: T.int64,
    out_h: T.handle,
):
    n = T.int64()
    out = T.match_buffer(out_h, (n, I64(VOCAB)), "float32")
    for i, v, j, d in T.grid(n, I64(VOCAB), I64(CTX), I64(DIM)):
        with T.sblock("score"):
            vi, vv, vj, vd = T.axis.remap("SSRR", [i, v, j, d])
            with T.init():
                out[vi, vv] = T.float32(0)
            out[vi, vv] = out[vi, vv] + T.if_then_else(
                vj <= pos + vi, cache[vj, vd] * emb[vv, vd] * scale[0], T.float32(0)
            )


@T.prim_func(s_tir=True)
def logits_last(
    tokens_h: T.handle,
    cache: T.Buffer((I64(CTX), I64(DIM)), "float32"),
    emb: T.Buffer((I64(VOCAB), I64(DIM)), "float32"),
    scale: T.Buffer((I64(1),), "float32"),
    pos: T.int64,
    out: T.Buffer((I64(1), I64(VOCAB)), "float32"),
):
    n = T.int64()
    T.match_buffer(tokens_h, (n,), "int32")
    for v, j, d in T.grid(I64(VOCAB), I64(CTX), I64(DIM)):
        with T.sblock("score"):
            vv, vj, vd = T.axis.remap("SRR", [v, j, d])
            with T.init():
                out[0, vv] = T.float32(0)
            out[0, vv] = out[0, vv] + T.if_then_else(
                vj < pos + n, cache[vj, vd] * emb[vv, vd] * scale[0], T.float32(0)
            )


def toy_module() -> tvm.IRModule:
    bb = relax.BlockBuilder()
    g_write = bb.add_func(write_cache, "write_cache")
    g_all = bb.add_func(logits_all, "logits_all")
    g_last = bb.add_func(logits_last, "logits_last")
    cache_ty = relax.TensorType([CTX, DIM], "float32")
    param_tys = [relax.TensorType([VOCAB, DIM], "float32"), relax.TensorType([1], "float32")]
    for name, last_only, n_tokens in (
        ("prefill_all", False, None),
        ("prefill", True, None),
        ("decode", True, 1),
    ):
        n = tirx.Var("n", "int64") if n_tokens is None else n_tokens
        p = tirx.Var("p", "int64")
        tokens = relax.Var("tokens", relax.TensorType([n], "int32"))
        pos = relax.Var("pos", relax.ShapeType([p]))
        states = relax.Var("states", relax.TupleType([cache_ty]))
        emb = relax.Var("token_embd", param_tys[0])  # on the CPU each weight is an argument
        scale = relax.Var("scale", param_tys[1])
        with bb.function(name, [tokens, pos, states, emb, scale], attrs={"num_input": 3}):
            with bb.dataflow():
                cache = bb.emit(relax.TupleGetItem(states, 0))
                cache = bb.emit(
                    relax.call_tir_inplace(g_write, [tokens, emb, relax.prim_value(p), cache], 3, cache_ty)
                )
                if last_only:
                    out = relax.call_tir(
                        g_last,
                        [tokens, cache, emb, scale, relax.prim_value(p)],
                        relax.TensorType([1, VOCAB], "float32"),
                    )
                else:
                    out = relax.call_tir(
                        g_all,
                        [cache, emb, scale, relax.prim_value(p)],
                        relax.TensorType([n, VOCAB], "float32"),
                    )
                result = bb.emit_output(bb.emit(out))
            bb.emit_func_output(result)
    return bb.get()


def toy_manifest() -> dict:
    return {
        "arch": "toy",
        "hparams": {"n_embd": DIM},
        "n_ctx": CTX,
        "n_vocab": VOCAB,
        "target": {"kind": "llvm"},
        "target_key": "llvm",
        "functions": {"prefill_all": {"tokens": "T"}, "prefill": {"tokens": "T"}, "decode": {"tokens": 1}},
        "max_chunk": MAX_CHUNK,
        "params": [
            {
                "name": "token_embd.weight",
                "qtype": "F32",
                "arrays": [{"key": "token_embd.weight", "shape": [VOCAB, DIM], "dtype": "float32"}],
            },
            {"name": "scale", "qtype": "F32", "arrays": [{"key": "scale", "shape": [1], "dtype": "float32"}]},
        ],
        "states": [{"name": "cache", "shape": [CTX, DIM], "dtype": "float32"}],
        "tokenizer": {
            "file": None,
            "bos_id": 1,
            "eos_id": 2,
            "eot_ids": [],
            "add_bos": False,
            "chat_template": None,
            "model": "none",
        },
        "source": {"file": "toy.gguf", "sha256": "0" * 64},
        "passes": {},
        "kernels": ["write_cache", "logits_all", "logits_last"],
    }


def toy_weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {
        "token_embd.weight": rng.standard_normal((VOCAB, DIM)).astype(np.float32),
        "scale": np.array([0.5], dtype=np.float32),
    }


def reference_logits(tokens: np.ndarray) -> np.ndarray:
    """What the toy kernels compute, in numpy: row i scores against the sum of rows 0..i."""
    w = toy_weights()
    prefix = np.cumsum(w["token_embd.weight"][tokens].astype(np.float64), axis=0)
    return (prefix @ w["token_embd.weight"].T.astype(np.float64) * w["scale"][0]).astype(np.float32)


TOY_LETTERS = "abcdefghijklmnop"  # token i is letter i; 'p' (15) ends generation
TOY_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}k{% endif %}"
)


def toy_tokenizer_info() -> tuple[dict, str]:
    """Manifest tokenizer entry and tokenizer.json for a 16-letter byte-level BPE vocabulary."""
    from ggufc.frontend.tokenizer_build import build_tokenizer

    spec = build_tokenizer(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": "gpt-2",
            "tokenizer.ggml.tokens": list(TOY_LETTERS),
            "tokenizer.ggml.token_type": [1] * VOCAB,
            "tokenizer.ggml.merges": [],
            "tokenizer.ggml.bos_token_id": 0,
            "tokenizer.ggml.eos_token_id": VOCAB - 1,
            "tokenizer.ggml.add_bos_token": False,
            "tokenizer.chat_template": TOY_CHAT_TEMPLATE,
        }
    ).to_dict()
    tokenizer_json = spec.pop("tokenizer_json")
    return {**spec, "file": "tokenizer.json"}, tokenizer_json


def build_toy_artifact(out_dir: Path, *, with_tokenizer: bool = False) -> Path:
    from ggufc.codegen.build import with_layout_function
    from ggufc.codegen.target import cpu_target
    from ggufc.driver.compile import plain_target

    target = cpu_target()
    manifest = toy_manifest()
    executable = tvm.compile(
        with_layout_function(toy_module(), manifest), target=target,
        relax_pipeline=relax.pipeline.default_build_pipeline(),
    )
    staging = make_staging_dir(out_dir)
    executable.export_library(str(staging / "kernels.so"))
    save_file(toy_weights(), str(staging / "weights.safetensors"))
    manifest["target"] = plain_target(dict(target.export()))
    if with_tokenizer:
        manifest["tokenizer"], tokenizer_json = toy_tokenizer_info()
        (staging / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    finalize_artifact(staging, out_dir, manifest)
    return out_dir


def greedy_reference(prompt: list[int], max_new: int, stop: int = VOCAB - 1) -> list[int]:
    """What greedy generation on the toy model yields, from the numpy reference."""
    ids, new = list(prompt), []
    while len(new) < max_new:
        token = int(np.argmax(reference_logits(np.array(ids))[-1]))
        if token == stop:
            break
        new.append(token)
        if len(ids) == CTX:
            break
        ids.append(token)
    return new


@pytest.fixture(scope="module")
def toy_artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_toy_artifact(tmp_path_factory.mktemp("toy") / "artifact")


@pytest.fixture
def session(toy_artifact: Path):
    with Session(toy_artifact) as s:
        yield s


TOKENS = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2], dtype=np.int32)


def test_one_shot_matches_reference(session: Session) -> None:
    logits = session.forward(TOKENS, all_logits=True)
    assert logits.shape == (TOKENS.size, VOCAB) and logits.dtype == np.float32
    np.testing.assert_allclose(logits, reference_logits(TOKENS), rtol=1e-5, atol=1e-5)
    assert session.n_past == TOKENS.size


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, MAX_CHUNK])
def test_chunked_equals_one_shot(session: Session, chunk: int) -> None:
    one_shot = session.forward(TOKENS, all_logits=True)
    session.reset()
    rows = [session.forward(TOKENS[i : i + chunk], all_logits=True) for i in range(0, TOKENS.size, chunk)]
    np.testing.assert_array_equal(np.concatenate(rows), one_shot)


def test_decode_and_prefill_match_prefill_all(session: Session) -> None:
    full = session.forward(TOKENS, all_logits=True)
    session.reset()
    last = session.forward(TOKENS[:9])  # prefill: chunks of MAX_CHUNK, then the last row only
    assert last.shape == (VOCAB,)
    np.testing.assert_allclose(last, full[8], rtol=1e-6, atol=1e-6)
    for i in range(9, TOKENS.size):
        np.testing.assert_allclose(session.forward(TOKENS[i : i + 1]), full[i], rtol=1e-6, atol=1e-6)


def test_reset_starts_over(session: Session) -> None:
    first = session.forward(TOKENS[:4], all_logits=True)
    session.reset()
    assert session.n_past == 0
    np.testing.assert_array_equal(session.forward(TOKENS[:4], all_logits=True), first)


def test_truncate_on_an_artifact_without_state_kinds(toy_artifact: Path) -> None:
    """A manifest that does not say what its states are: every state is treated as recurrent
    (restored from a checkpoint and replayed), which is correct for any state."""
    with Session(toy_artifact, checkpoint_interval=4) as s:
        assert "kind" not in s.manifest["states"][0]
        full = s.forward(TOKENS, all_logits=True)
        s.truncate(10)  # checkpoint at 8, two tokens replayed
        np.testing.assert_allclose(s.forward(TOKENS[10:], all_logits=True), full[10:], rtol=1e-6, atol=1e-6)
        assert (s.stats.checkpoint_restores, s.stats.replayed_tokens) == (1, 2)
        np.testing.assert_array_equal(s.tokens, TOKENS)
        for bad in (-1, TOKENS.size + 1, True, 2.0):
            with pytest.raises(ValueError, match="truncate needs a token count"):
                s.truncate(bad)  # type: ignore[arg-type]
        assert s.n_past == TOKENS.size


def test_context_overflow_refused_before_running(session: Session) -> None:
    session.forward(np.arange(CTX - 2) % VOCAB)
    with pytest.raises(ContextOverflowError, match=f"{CTX - 2} tokens in context \\+ 3 new > n_ctx {CTX}"):
        session.forward([1, 2, 3])
    assert session.n_past == CTX - 2  # nothing ran
    session.forward([1, 2])
    assert session.n_past == CTX
    with pytest.raises(ContextOverflowError):
        session.forward([1])


@pytest.mark.parametrize("bad", [[VOCAB], [-1], [[1, 2]], [], [0.5]])
def test_bad_tokens_refused(session: Session, bad: list) -> None:
    with pytest.raises(ValueError):
        session.forward(np.array(bad))
    assert session.n_past == 0


def test_weights_are_aligned_and_states_zero_copy(session: Session) -> None:
    for array in session._state_arrays:
        assert array.ctypes.data % 64 == 0
    session.forward(TOKENS[:3])
    assert np.abs(session._state_arrays[0][:3]).sum() > 0  # the kernel wrote into our numpy buffer
    assert not session._state_arrays[0][3:].any()


def test_archive_runs_like_directory(toy_artifact: Path, tmp_path: Path, session: Session) -> None:
    import tarfile

    archive = tmp_path / "toy.tar"
    with tarfile.open(archive, "w") as tar:
        tar.add(toy_artifact, arcname="toy")
    with Session(archive) as from_tar:
        extracted = from_tar._artifact.path if from_tar._artifact else None
        np.testing.assert_array_equal(
            from_tar.forward(TOKENS, all_logits=True), session.forward(TOKENS, all_logits=True)
        )
    assert extracted is not None and not extracted.exists()  # the temporary copy is gone


def test_wrong_device_refused(toy_artifact: Path) -> None:
    with pytest.raises(ArtifactError, match="compiled for target 'llvm', not 'cuda'"):
        Session(toy_artifact, device="cuda")
    with pytest.raises(ArtifactError, match="unknown device"):
        Session(toy_artifact, device="tpu")


# --------------------------------------------------------------------------- generation


class LetterTokenizer:
    """Decode-only tokenizer (no stream()): exercises generate's fallback decoder."""

    def decode(self, ids: list[int]) -> str:
        return "".join(TOY_LETTERS[i] for i in ids)


def test_generate_greedy_matches_reference(session: Session) -> None:
    from ggufc.runtime.generate import generate
    from ggufc.runtime.sampling import Sampler

    prompt = [3, 1, 4]
    text = "".join(generate(session, LetterTokenizer(), prompt, max_new_tokens=6, sampler=Sampler()))
    assert text == "".join(TOY_LETTERS[i] for i in greedy_reference(prompt, 6))
    assert session.n_past == len(prompt) + len(text) - 1  # the last sampled token is not fed


def test_generate_stops_at_stop_id(session: Session) -> None:
    from ggufc.runtime.generate import generate
    from ggufc.runtime.sampling import Sampler

    prompt = [3, 1, 4]
    first = greedy_reference(prompt, 1)[0]
    pieces = list(
        generate(session, LetterTokenizer(), prompt, max_new_tokens=6, sampler=Sampler(), stop_ids={first})
    )
    assert pieces == []


def test_generate_stops_at_context_end(session: Session, capsys: pytest.CaptureFixture[str]) -> None:
    from ggufc.runtime.generate import generate
    from ggufc.runtime.sampling import Sampler

    prompt = list(np.arange(CTX - 2) % 8)
    text = "".join(
        generate(session, LetterTokenizer(), prompt, max_new_tokens=50, sampler=Sampler(), stop_ids=())
    )
    assert len(text) == 3  # two fit in the context, the third is sampled from the last logits
    assert session.n_past == CTX
    assert "context full (24 tokens)" in capsys.readouterr().err


def test_generate_refuses_oversized_prompt(session: Session) -> None:
    from ggufc.runtime.generate import generate
    from ggufc.runtime.sampling import Sampler

    with pytest.raises(ContextOverflowError, match="prompt is 30 tokens"):
        list(generate(session, LetterTokenizer(), [1] * 30, max_new_tokens=1, sampler=Sampler()))
    assert session.n_past == 0


def test_incremental_decoder_holds_split_characters() -> None:
    from ggufc.runtime.generate import IncrementalDecoder

    data = "héllo ✓".encode()
    decoder = IncrementalDecoder(lambda ids: bytes(data[i] for i in ids).decode("utf-8", errors="replace"))
    pieces = [decoder.feed(i) for i in range(len(data))]
    assert "".join(pieces) + decoder.flush() == "héllo ✓"
    assert all("\ufffd" not in p for p in pieces)


def test_thread_pool_is_sized_before_first_use(monkeypatch: pytest.MonkeyPatch) -> None:
    """TVM sizes its pool once, from TVM_NUM_THREADS (default: half the CPUs), and can later only
    use fewer workers; the runtime therefore sets it before any kernel runs, and a user's value wins."""
    monkeypatch.delenv("TVM_NUM_THREADS", raising=False)
    cpus = len(os.sched_getaffinity(0))
    assert reserve_cpu_threads(None) == cpus and os.environ["TVM_NUM_THREADS"] == str(cpus)
    monkeypatch.delenv("TVM_NUM_THREADS")
    assert reserve_cpu_threads(cpus + 3) == cpus + 3 and os.environ["TVM_NUM_THREADS"] == str(cpus + 3)
    monkeypatch.setenv("TVM_NUM_THREADS", "1")
    assert reserve_cpu_threads(2) == 2 and os.environ["TVM_NUM_THREADS"] == "1"
