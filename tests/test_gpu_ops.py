"""The per-op case table (tests/support/op_cases.py: every lowered op at odd sizes, decode variants,
stateful rows), compiled for the vulkan target and run on wgpu against the numpy reference.

Rows compile as one GPU module per group (WGSL + dispatch plan, exactly as `ggufc compile -t
vulkan` does) and run through the plan runtime. A kernel with no GPU version must fail to
compile with an error naming it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest

from ggufc.codegen.build import state_plan
from ggufc.codegen.formats.layout import repack
from ggufc.codegen.gpu import block_formats as QG
from ggufc.codegen.gpu.build import compile_plan_target, wgsl_bundle
from ggufc.codegen.gpu.schedules import GpuScheduleError
from ggufc.codegen.lower import ModuleBuilder
from ggufc.codegen.lower_context import plan_params
from ggufc.codegen.target import gpu_target
from ggufc.runtime.plan_runtime import PlanRunner
from tests.support import op_cases as C
from tests.support.gpu_support import need_vulkan

# 8-bit activation rounding is a CPU kernel strategy: GPU targets compile without the pass that
# inserts it (driver/stages.py) and without the 8-bit matmul rules, and lowering it for a GPU is an
# error (test below)
# cpu_rounding: llama.cpp CPU-backend roundings the GPU targets do not reproduce (f32 there)
CASES = [c for c in C.CASES if c.group not in ("act8", "int8", "cpu_rounding")]


class GpuCompiled:
    def __init__(self, built: Sequence[C.BuiltCase]) -> None:
        graphs = [bc.graph for bc in built]
        layouts = plan_params(graphs, QG.layout_spec)
        self.states = [s for g in graphs for s in state_plan(g)]
        tgt = gpu_target("vulkan")
        mb = ModuleBuilder(tgt, layouts, self.states)
        functions: list[tuple[str, int | None]] = []
        for bc in built:
            mb.add_function(C.fn_name(bc.case, False), bc.graph)
            functions.append((C.fn_name(bc.case, False), None))
            if bc.case.decode:
                mb.add_function(C.fn_name(bc.case, True), bc.graph, fixed_tokens=1)
                functions.append((C.fn_name(bc.case, True), 1))
        mod = mb.module()
        exe = compile_plan_target(mod, tgt, mb.kernel_names, n_params=len(mb.flat_params), n_states=len(self.states),
                                  max_chunk=C.MAX_TOKENS, n_ctx=C.N_CTX, functions=tuple(functions))
        data = {src: pd for bc in built for src, pd in bc.data.params.items()}
        self.weights = [QG.pack(lay.qtype, repack(lay.qtype, data[lay.source].storage, lay.shape), lay.shape)[f]
                        for lay in layouts for f, _, _ in lay.arrays]
        self.initial = [np.ascontiguousarray(self_init) for self_init in
                        ({n: a for bc in built for n, a in bc.data.states.items()}.get(name, np.zeros(shape, dtype))
                         for name, shape, dtype in self.states)]
        self.runner = PlanRunner.from_parts(exe.plan, wgsl_bundle(exe.kernels), self.weights,
                                            [(s, d) for _, s, d in self.states], C.MAX_TOKENS, C.N_CTX, "vulkan")

    def run(self, bc: C.BuiltCase, call: C.Call, tokens: np.ndarray) -> list[np.ndarray]:
        for buf, init in zip(self.runner.buffers["state"], self.initial, strict=True):
            self.runner.backend.write(buf, init)  # every call starts from the row's prefilled states
        return self.runner.call_all(C.fn_name(bc.case, call.decode), tokens, call.p)


@pytest.fixture(scope="module")
def compiled() -> dict[str, Any]:
    need_vulkan()
    names = {c.name for c in CASES}
    built = {c.name: C.build_case(c, i) for i, c in enumerate(C.CASES) if c.name in names}
    groups: dict[str, GpuCompiled | Exception] = {}
    return {"built": built, "groups": groups}


def test_quantize_act_is_refused_on_gpu() -> None:
    case = next(c for c in C.CASES if c.name == "quantize_act")
    with pytest.raises(NotImplementedError, match="quantize_act.*CPU kernel"):
        GpuCompiled([C.build_case(case, 0)])


def _group(state: dict[str, Any], case: C.Case) -> tuple[C.BuiltCase, GpuCompiled]:
    built, groups = state["built"], state["groups"]
    if case.group not in groups:
        try:
            groups[case.group] = GpuCompiled([built[c.name] for c in CASES if c.group == case.group])
        except Exception as exc:  # noqa: BLE001 - reported by each row of the group
            groups[case.group] = exc
    got = groups[case.group]
    if isinstance(got, Exception):  # name the row: compile it alone
        GpuCompiled([built[case.name]])
        raise got
    return built[case.name], got


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_gpu_op_matches_reference(case: C.Case, compiled: dict[str, Any]) -> None:
    bc, comp = _group(compiled, case)
    rng = np.random.default_rng(len(case.name))
    for call in case.calls:
        tokens = rng.integers(0, C.VOCAB, call.t).astype(np.int32)
        got, want = comp.run(bc, call, tokens), C.run_reference(bc, call, tokens)
        C.compare(case, got, want, f"vulkan {case.name} {call}")


def test_cpu_only_kernel_fails_clearly_on_gpu() -> None:
    """A hand-written CPU kernel (parallel loops, no blocks) reaching the GPU scheduler is named."""
    from ggufc.codegen.families import linear_attention as LA
    from ggufc.codegen.gpu.schedules import dlight_schedule
    from ggufc.codegen.kernel_keys import CausalConv

    with pytest.raises(GpuScheduleError, match="kernel 'ssm_conv' is a hand-written CPU kernel"):
        dlight_schedule(LA.ssm_conv(8, 4), gpu_target("vulkan"), CausalConv(8, 4, 1))
