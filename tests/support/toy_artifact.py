"""The toy artifact: a hand-built Relax module that follows codegen's calling convention, with its
numpy reference.

The toy "model" appends each token's embedding to a cache (a state, updated in place) and scores
every vocabulary entry against the sum of the cache rows up to the token (causal), so logits
depend on earlier chunks only through the state, exactly like a KV cache.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tvm
from safetensors.numpy import save_file
from tvm import relax, tirx
from tvm.script import tirx as T

from ggufc.runtime.artifact_writer import finalize_artifact, make_staging_dir

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


TOKENS = np.array([3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2], dtype=np.int32)
