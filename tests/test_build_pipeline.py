"""The CPU build pipeline (codegen/build.py): the host shape functions VMShapeLower writes take
symbols that sort before the kernels', so no kernel is compiled with its noalias compute function
inlined into its packed wrapper (TVM 0.27 does that to a kernel whose symbol sorts before a shape
function's, and its loops lose their vector form: prompt GEMMs ran up to 3x slower)."""

from __future__ import annotations

import numpy as np
import pytest
import tvm
from tvm import relax, tirx

from ggufc.codegen.build import SHAPE_FUNCTION_PREFIX, cpu_build_pipeline
from ggufc.codegen.cpu_int8 import block32 as Q8
from ggufc.codegen.formats.layout import layout_spec, repack
from ggufc.codegen.target import cpu_target
from ggufc.codegen.tvm_util import to_tvm

TARGET = cpu_target()
QTYPE, N, K = "Q8_0", 64, 256


def _module() -> tvm.IRModule:
    """One prompt GEMM called on T tokens: its output's size needs a shape function."""
    spec = layout_spec(QTYPE, (N, K))
    bb = relax.BlockBuilder()
    kernel = bb.add_func(Q8.int8_gemm(QTYPE, N, K, TARGET).with_attr("global_symbol", "k000_gemm"), "k000_gemm")
    t = tirx.Var("t", "int64")
    x = relax.Var("x", relax.TensorType([t, K], "float32"))
    weights = [relax.Var(name, relax.TensorType(list(shape), dtype)) for name, shape, dtype in spec]
    with bb.function("main", [x, *weights]):
        y = bb.emit(relax.call_tir(kernel, [x, *weights], relax.TensorType([t, N], "float32")))
        bb.emit_func_output(y)
    return bb.get()


def _assembly(module: tvm.runtime.Module) -> str:
    for m in [module, *module.imports]:
        try:
            text = str(m.inspect_source("asm"))
        except Exception:  # noqa: BLE001 - modules without assembly (the VM's own)
            continue
        if "k000_gemm" in text:
            return text
    return ""


@pytest.mark.skipif(Q8.int8_isa(TARGET) is None, reason="no 8-bit dot product on this CPU")
def test_shape_functions_sort_before_the_kernels_and_leave_them_uninlined() -> None:
    with TARGET:
        lowered = cpu_build_pipeline()(_module())
    host = [str(f.attrs["global_symbol"]) for f in lowered.functions.values()
            if isinstance(f, tirx.PrimFunc) and "tirx.is_host_func" in (f.attrs or {})]
    assert host and all(s.startswith(SHAPE_FUNCTION_PREFIX) and s < "k000_gemm" for s in host)
    ex = tvm.compile(_module(), target=TARGET, relax_pipeline=cpu_build_pipeline())
    assert "k000_gemm_compute_:" in _assembly(ex.mod)  # the compute function kept (noalias arguments)
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, size=(N, K // 32 * 34), dtype=np.uint8)
    raw.reshape(N, K // 32, 34)[..., :2] = np.array([0.01], np.float16).view(np.uint8)
    arrays = repack(QTYPE, raw, (N, K))
    x = rng.standard_normal((5, K)).astype(np.float32)
    vm = relax.VirtualMachine(ex, tvm.cpu())
    y = vm["main"](to_tvm(x), *(to_tvm(arrays[f]) for f, _, _ in layout_spec(QTYPE, (N, K)))).numpy()
    direct = tvm.compile(tvm.IRModule({"main": Q8.int8_gemm(QTYPE, N, K, TARGET).with_attr("global_symbol", "main")}),
                         target=TARGET)["main"]
    want = tvm.runtime.tensor(np.zeros((5, N), np.float32))
    direct(to_tvm(x), *(to_tvm(arrays[f]) for f, _, _ in layout_spec(QTYPE, (N, K))), want)
    np.testing.assert_array_equal(y, want.numpy())
