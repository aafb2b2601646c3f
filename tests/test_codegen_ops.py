"""Per-op case table: every op the codegen lowers, compiled for llvm, against the numpy reference.

Each row builds a one- or few-node graph. Float inputs are params (fixed shapes) or rows of a param
table picked by the call's tokens (so they have T rows). The graph is compiled as a dynamic-T entry
point and, where the row asks, a decode-specialised one (`fixed_tokens=1`), run at odd sizes, and
compared with `run_graph` in float64 on the same weights (quantized weights as the interpreter sees
them: dequantized by gguf-py). Rows of a group compile as one module; if a group fails to build,
its rows are compiled one by one so each failure names its own row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import tvm
from tvm import relax

from ggufc.codegen.build import state_plan
from ggufc.codegen.formats.layout import repack
from ggufc.codegen.formats.table import QTYPES
from ggufc.codegen.kernels.elementwise import BINARY, SCALAR, UNARY
from ggufc.codegen.lower import LOWERING, ModuleBuilder
from ggufc.codegen.lower_context import plan_params
from ggufc.codegen.target import resolve_target
from ggufc.codegen.tvm_util import to_tvm
from ggufc.ir import ops as O
from tests.support.op_cases import (
    CASES,
    HAS_INT8,
    MAX_TOKENS,
    N_CTX,
    SCALAR_FNS,
    VOCAB,
    BuiltCase,
    Call,
    Case,
    build_case,
    compare,
    fn_name,
    run_reference,
)

# ---------------------------------------------------------------------------------------------
# compiling


@dataclass
class Compiled:
    vm: Any
    layouts: list[Any]
    states: list[tuple[str, tuple[int, ...], str]]
    params: list[Any]
    initial_states: dict[str, np.ndarray] = field(default_factory=dict)


def compile_cases(built: Sequence[BuiltCase]) -> Compiled:
    graphs = [bc.graph for bc in built]
    layouts = plan_params(graphs)
    states = [s for g in graphs for s in state_plan(g)]
    mb = ModuleBuilder(resolve_target("llvm"), layouts, states)
    names = []
    for bc in built:
        mb.add_function(fn_name(bc.case, False), bc.graph)
        names.append(fn_name(bc.case, False))
        if bc.case.decode:
            mb.add_function(fn_name(bc.case, True), bc.graph, fixed_tokens=1)
            names.append(fn_name(bc.case, True))
    mod = mb.module()
    for name in names:
        gv = mod.get_global_var(name)
        mod[gv] = mod[gv].with_attr("tir_var_upper_bound", {"n": MAX_TOKENS, "p": N_CTX})
    ex = tvm.compile(mod, target=mb.target, relax_pipeline=relax.pipeline.default_build_pipeline())
    data = {src: pd for bc in built for src, pd in bc.data.params.items()}
    params = [
        to_tvm(repack(lay.qtype, data[lay.source].storage, lay.shape)[f])
        for lay in layouts
        for f, _, _ in lay.arrays
    ]
    initial = {n: a for bc in built for n, a in bc.data.states.items()}
    return Compiled(tvm.runtime.vm.VirtualMachine(ex, tvm.cpu()), layouts, states, params, initial)


class CaseCompiler:
    """Compiles a whole group on first use; a group that fails falls back to one module per row."""

    def __init__(self) -> None:
        self.built = {c.name: build_case(c, i) for i, c in enumerate(CASES)}
        self.groups: dict[str, Compiled | Exception] = {}
        self.solo: dict[str, Compiled | Exception] = {}

    def get(self, case: Case) -> tuple[BuiltCase, Compiled]:
        bc = self.built[case.name]
        members = [self.built[c.name] for c in CASES if c.group == case.group]
        group = self._once(self.groups, case.group, lambda: compile_cases(members))
        if isinstance(group, Compiled):
            return bc, group
        solo = self._once(self.solo, case.name, lambda: compile_cases([bc]))
        if isinstance(solo, Exception):
            if case.may_xfail and "Schedule" in f"{type(solo).__name__}: {solo}":
                pytest.xfail(
                    f"quantized prefill kernel does not schedule (codegen/formats/cpu_schedules.py): {_short(solo)}"
                )
            raise solo
        return bc, solo

    @staticmethod
    def _once(
        cache: dict[str, Compiled | Exception], key: str, make: Callable[[], Compiled]
    ) -> Compiled | Exception:
        if key not in cache:
            try:
                cache[key] = make()
            except Exception as exc:  # noqa: BLE001 - reported by the rows that need this module
                cache[key] = exc
        return cache[key]


def _short(exc: Exception) -> str:
    lines = [ln for ln in str(exc).splitlines() if ln.strip()]
    return f"{type(exc).__name__}: {lines[-1][:300] if lines else ''}"


@pytest.fixture(scope="module")
def compiler() -> CaseCompiler:
    return CaseCompiler()


# ---------------------------------------------------------------------------------------------
# running and comparing


def run_compiled(bc: BuiltCase, comp: Compiled, call: Call, tokens: np.ndarray) -> list[np.ndarray]:
    states = [
        to_tvm(comp.initial_states.get(name, np.zeros(shape, dtype)).copy())
        for name, shape, dtype in comp.states
    ]
    fn = comp.vm[fn_name(bc.case, call.decode)]
    out = fn(to_tvm(tokens), tvm.runtime.ShapeTuple([call.p]), states, *comp.params)
    outs = [out] if len(bc.graph.outputs) == 1 else [out[i] for i in range(len(bc.graph.outputs))]
    return [o.numpy() for o in outs]


@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_compiled_op_matches_reference(case: Case, compiler: CaseCompiler) -> None:
    if case.group == "int8" and not HAS_INT8:
        pytest.skip("this CPU has no 8-bit dot products: compiles for it never use the 8-bit kernels")
    bc, comp = compiler.get(case)
    rng = np.random.default_rng(len(case.name))
    for call in case.calls:
        tokens = rng.integers(0, VOCAB, call.t).astype(np.int32)
        got, want = run_compiled(bc, comp, call, tokens), run_reference(bc, call, tokens)
        compare(case, got, want, f"{case.name} {call}")


# ---------------------------------------------------------------------------------------------
# coverage


def test_every_lowered_op_has_a_row() -> None:
    covered = {c.op for c in CASES}
    missing = sorted(set(LOWERING) - covered)
    assert not missing, f"ops lowered by codegen with no row in the case table: {missing}"


def test_elementwise_function_tables_agree() -> None:
    """Every unary/binary function of the IR has a kernel expression (and nothing more)."""
    assert set(UNARY) == set(O.UNARY_FNS)
    assert set(BINARY) == set(O.BINARY_FNS)
    assert set(SCALAR) == set(SCALAR_FNS)


def test_every_qtype_has_matmul_rows() -> None:
    for qtype in QTYPES:
        names = {c.name for c in CASES}
        assert {f"matmul-{qtype}-prefill", f"matmul-{qtype}-gemv", f"gather-{qtype}"} <= names
