"""Whole models on the vulkan target: a graph compiled and run through the plan runtime, and
artifacts compiled and run through `ggufc eval --target vulkan`, in the three call modes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ggufc.codegen.build import kernel_weights, state_plan, weight_key
from ggufc.codegen.gpu import block_formats as QG
from ggufc.codegen.gpu.build import compile_plan_target, wgsl_bundle
from ggufc.codegen.lower import ModuleBuilder
from ggufc.codegen.lower_context import plan_params
from ggufc.codegen.target import gpu_target
from ggufc.runtime.plan_runtime import PlanRunner
from tests.support.gpu_support import golden_fixture

MODES = {None: "logits_prefill", 1: "logits_decode", 7: "logits_chunk7"}  # --chunk: the golden's logits

class VulkanModel:
    """A graph compiled for vulkan (prefill_all and decode) and run through the plan runtime, every
    output of the graph returned (e.g. a selection exposed next to the logits)."""

    def __init__(self, model: object, graph: object, max_chunk: int = 64) -> None:
        target = gpu_target("vulkan")
        layouts = plan_params([graph], QG.layout_spec)
        self.states = state_plan(graph)
        mb = ModuleBuilder(target, layouts, self.states)
        mb.add_function("prefill_all", graph)
        mb.add_function("decode", graph, fixed_tokens=1)
        exe = compile_plan_target(mb.module(), target, mb.kernel_names, n_params=len(mb.flat_params),
                                  n_states=len(self.states), max_chunk=max_chunk, n_ctx=model.n_ctx,
                                  functions=(("prefill_all", None), ("decode", 1)))
        weights = kernel_weights(model, layouts)
        params = [weights[weight_key(lay.source, f)] for lay in layouts for f, _, _ in lay.arrays]
        self.runner = PlanRunner.from_parts(exe.plan, wgsl_bundle(exe.kernels), params,
                                            [(s, d) for _, s, d in self.states], max_chunk, model.n_ctx,
                                            "vulkan")

    def run(self, tokens: np.ndarray, chunk: int) -> list[np.ndarray]:
        for buf, (_, shape, dtype) in zip(self.runner.buffers["state"], self.states, strict=True):
            self.runner.backend.write(buf, np.zeros(shape, dtype))
        fn = "decode" if chunk == 1 else "prefill_all"
        parts: list[list[np.ndarray]] = []
        for start in range(0, len(tokens), chunk):
            outs = self.runner.call_all(fn, tokens[start:start + chunk].astype(np.int32), start)
            parts = parts or [[] for _ in outs]
            for i, out in enumerate(outs):
                parts[i].append(out)
        return [np.concatenate(p) for p in parts]


def eval_modes(artifact: Path, tokens: np.ndarray, tmp: Path) -> dict[str, np.ndarray]:
    from ggufc.cli import main

    np.save(tmp / "tokens.npy", tokens.astype(np.int32))
    out = {}
    for chunk, key in MODES.items():
        argv = ["eval", str(artifact), "--target", "vulkan", "--tokens", str(tmp / "tokens.npy"),
                "--out", str(tmp / "l.npy")] + (["--chunk", str(chunk)] if chunk else [])
        assert main(argv) == 0
        out[key] = np.load(tmp / "l.npy")
    return out


def compile_vulkan(model: Path, tmp: Path) -> Path:
    from ggufc.cli import main

    assert main(["compile", str(model), "-t", "vulkan", "-o", str(tmp / "art")]) == 0
    return tmp / "art"


def check_kernels(model: object, tokens: np.ndarray, tol: float) -> None:
    from ggufc.driver.gpu_verify import check_model_kernels

    for report in check_model_kernels(model, tokens):
        assert not report.unchecked, f"{report.function}: kernels never run: {sorted(report.unchecked)}"
        assert report.checks, report.function
        bad = [c for c in report.checks if c.rel > tol]
        assert not bad, f"{report.function}: {[(c.node, c.kernels, c.rel) for c in bad]}"


def cached_artifact(name: str, target: str, cache: dict[tuple[str, str], Path], tmp: pytest.TempPathFactory) -> Path:
    from ggufc.cli import main

    if (name, target) not in cache:
        out = tmp.mktemp(f"{name}-{target}") / "artifact"
        assert main(["compile", str(golden_fixture(name)), "-t", target, "-o", str(out)]) == 0
        cache[(name, target)] = out
    return cache[(name, target)]


def eval_logits(artifact: Path, target: str, tokens: np.ndarray, chunk: int | None, tmp: Path) -> np.ndarray:
    from ggufc.cli import main

    np.save(tmp / "tokens.npy", tokens)
    argv = ["eval", str(artifact), "--target", target, "--tokens", str(tmp / "tokens.npy"), "--out", str(tmp / "l.npy")]
    if chunk is not None:
        argv += ["--chunk", str(chunk)]
    assert main(argv) == 0
    return np.load(tmp / "l.npy")
