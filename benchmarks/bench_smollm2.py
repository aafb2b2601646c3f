"""SmolLM2-135M-Instruct Q4_1 side by side: ggufc and llama.cpp (when `llama_cpp` is importable).

Prefill tokens/s for a P-token prompt and decode tokens/s for G tokens, best of 3, 2 threads,
measured in one run so the ratios compare like with like. Run: python -m benchmarks.bench_smollm2
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TVM_NUM_THREADS", "2")

import numpy as np  # noqa: E402

from ggufc.driver.models import cached_artifact_dir, compile_gguf, default_model  # noqa: E402
from ggufc.runtime.bench import bench_session  # noqa: E402
from ggufc.runtime.session import Session  # noqa: E402


def ggufc_figures(model: str, prompt_tokens: int, gen_tokens: int) -> dict[str, float]:
    artifact = cached_artifact_dir(model, "llvm", None)
    if not (artifact / "manifest.json").exists():
        compile_gguf(model, "llvm", artifact, None)
    with Session(artifact) as session:
        r = bench_session(session, prompt_tokens=prompt_tokens, gen_tokens=gen_tokens)
    return {"prefill_tok_s": r.prefill_tok_s, "decode_tok_s": r.decode_tok_s}


def llama_cpp_figures(model: str, prompt_tokens: int, gen_tokens: int, threads: int) -> dict[str, float] | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=str(model), n_ctx=2048, n_threads=threads, n_threads_batch=threads, n_batch=512,
                verbose=False, logits_all=False)
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, llm.n_vocab(), size=prompt_tokens).tolist()
    best_p = best_d = float("inf")
    for _ in range(3):
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(prompt)
        best_p = min(best_p, time.perf_counter() - t0)
        t1 = time.perf_counter()
        for _ in range(gen_tokens):
            # with logits_all=False `llm.scores` is never filled: read the last row's logits
            tok = int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits(), shape=(llm.n_vocab(),))))
            llm.eval([tok])
        best_d = min(best_d, time.perf_counter() - t1)
    return {"prefill_tok_s": prompt_tokens / best_p, "decode_tok_s": gen_tokens / best_d}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--gen-tokens", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    model = default_model()
    rows = {"ggufc": ggufc_figures(model, args.prompt_tokens, args.gen_tokens)}
    ref = llama_cpp_figures(model, args.prompt_tokens, args.gen_tokens, args.threads)
    if ref is not None:
        rows["llama.cpp"] = ref
    print(f"{'engine':<10} {'prefill tok/s':>14} {'decode tok/s':>13}")
    for name, r in rows.items():
        print(f"{name:<10} {r['prefill_tok_s']:>14.1f} {r['decode_tok_s']:>13.1f}")
    if ref is not None:
        g = rows["ggufc"]
        print(f"{'ratio':<10} {g['prefill_tok_s'] / ref['prefill_tok_s']:>13.2f}x "
              f"{g['decode_tok_s'] / ref['decode_tok_s']:>12.2f}x")
    else:
        print("llama.cpp: llama_cpp not importable (pip install llama-cpp-python to compare)")
    print(json.dumps({"prompt_tokens": args.prompt_tokens, "gen_tokens": args.gen_tokens, **rows}))


if __name__ == "__main__":
    main()
