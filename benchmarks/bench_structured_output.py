"""The per-token cost of grammar-constrained decoding on SmolLM2-135M-Instruct Q4_1: xgrammar's
bitmask fill, its unpacking onto the logits (numpy) and the matcher's advance, against the plain
decode step (one `Session.forward` of one token), over the greedy tokens of a JSON-schema answer.

Run: python -m benchmarks.bench_structured_output [--tokens N]
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("TVM_NUM_THREADS", "2")

import numpy as np  # noqa: E402

import ggufc  # noqa: E402
from ggufc.runtime.prompting import encode_prompt, render_messages, stop_ids  # noqa: E402
from ggufc.runtime.structured_output import Grammars  # noqa: E402

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 40},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}},
                                           "score": {"type": "number", "minimum": 0, "maximum": 10}},
          "required": ["name", "tags", "score"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=96)
    args = parser.parse_args()
    with ggufc.load(n_ctx=512) as model:
        grammars = Grammars(model.tokenizer, model.n_vocab, stop_ids(model._info))
        started = time.perf_counter()
        make = grammars.json_schema(SCHEMA)
        compile_s = time.perf_counter() - started
        messages = [{"role": "user", "content": "Describe a film as JSON with a name, tags and a score."}]
        ids = encode_prompt(model.tokenizer, model._info, render_messages(model.tokenizer, model._info, messages),
                            templated=True)
        stops = stop_ids(model._info)
        constraint = make()
        model.session.reset()
        logits = model.session.forward(ids)
        step_s, fill_s, apply_s, accept_s = [], [], [], []
        for _ in range(args.tokens):
            t0 = time.perf_counter()
            allowed = constraint.allowed()
            t1 = time.perf_counter()
            scores = np.array(logits, dtype=np.float32, copy=True)
            if allowed is not None:
                np.putmask(scores, ~allowed, -np.inf)
            token = int(np.argmax(scores))
            t2 = time.perf_counter()
            if token in stops:
                break
            constraint.accept(token)
            t3 = time.perf_counter()
            logits = model.session.forward([token])
            t4 = time.perf_counter()
            fill_s.append(t1 - t0)
            apply_s.append(t2 - t1)
            accept_s.append(t3 - t2)
            step_s.append(t4 - t3)
    us = {name: float(np.median(v)) * 1e6 for name, v in
          (("fill", fill_s), ("unpack_and_mask", apply_s), ("accept", accept_s), ("decode_step", step_s))}
    grammar_us = us["fill"] + us["unpack_and_mask"] + us["accept"]
    print(json.dumps({"tokens": len(step_s), "grammar_compile_ms": round(compile_s * 1e3, 2),
                      **{f"{k}_us_median": round(v, 1) for k, v in us.items()},
                      "grammar_us_per_token": round(grammar_us, 1),
                      "grammar_share_of_step": round(grammar_us / us["decode_step"], 4)}))


if __name__ == "__main__":
    main()
