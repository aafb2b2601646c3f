"""F16 rounding by the target's own conversion (F16C's vcvtps2ph on the CPU, as ggml's CPU backend
does it) against the integer form that WGSL and CPUs without F16C take, and against numpy: bit for
bit on a few million float32 inputs that cover every F16 value, every tie between neighbours, each of
them +-1 float32 ulp, F16 subnormals, overflow to inf and NaN."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import tvm
from tvm import te

from ggufc.codegen.kernels.elementwise import elementwise, rounds_to_f16
from ggufc.codegen.kernels.prim_helpers import i64, with_root_block
from ggufc.codegen.schedule import schedule_cpu
from ggufc.codegen.target import cpu_target, gpu_target, named_cpu_target, native_f16_rounding
from ggufc.codegen.tvm_util import to_tvm
from ggufc.ir import ops as O

TARGET = cpu_target()
pytestmark = pytest.mark.skipif(not native_f16_rounding(TARGET), reason="this CPU has no F16C conversion")

N_RANDOM = 4_000_000


def f16_boundaries() -> np.ndarray:
    """Every F16 value and every midpoint between neighbours (the ties; 65520 rounds to inf, 2^-25
    to zero), as float32, each with its neighbours one float32 ulp below and above, both signs."""
    halves = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    finite = np.unique(np.abs(halves[np.isfinite(halves)]).astype(np.float64))
    ties = (finite[:-1] + finite[1:]) / 2  # 12 significant bits: exact in float32
    grid = np.concatenate([finite, ties, [65520.0, 2.0**-25]]).astype(np.float32)
    bits = grid.view(np.uint32)
    near = np.concatenate([bits, bits + np.uint32(1), bits[bits > 0] - np.uint32(1)])
    return np.concatenate([near, near | np.uint32(0x80000000)]).view(np.float32)


def special_inputs() -> np.ndarray:
    """Infinities, quiet and signalling NaNs with payloads, float32 subnormals, the extremes."""
    bits = [0x7F800000, 0x7F800001, 0x7FC00000, 0x7FFFFFFF, 0x7FA00000, 0x7F802000, 0x00000001, 0x007FFFFF,
            0x00800000, 0x7F7FFFFF, 0x33000000, 0x33000001, 0x32FFFFFF, 0x387FE000, 0x387FF000, 0x38800000]
    u = np.array(bits, np.uint32)
    return np.concatenate([u, u | np.uint32(0x80000000)]).view(np.float32)


def random_inputs(n: int) -> np.ndarray:
    """Random bit patterns: half over all of float32, half with exponents in F16's range."""
    rng = np.random.default_rng(16)
    anywhere = rng.integers(0, 1 << 32, n // 2, dtype=np.uint64).astype(np.uint32)
    in_range = rng.integers(0x33000000, 0x47800000, n - n // 2, dtype=np.uint32)
    signs = rng.integers(0, 2, n - n // 2, dtype=np.uint32) << np.uint32(31)
    return np.concatenate([anywhere, in_range | signs]).view(np.float32)


INPUTS = np.concatenate([f16_boundaries(), special_inputs(), random_inputs(N_RANDOM)])


def compiled(fn: str, native: bool) -> Callable[[np.ndarray], np.ndarray]:
    """The elementwise kernel of unary `fn` as lowering builds it for the CPU (vectorised)."""
    program = O.FusedElementwise((("unary", O.Unary(fn), (0,)),), 1)
    func = with_root_block(schedule_cpu(elementwise([(i64(len(INPUTS)),)], program, native_f16=native)))
    kernel = tvm.compile(tvm.IRModule({"main": func.with_attr("global_symbol", "main")}), target=TARGET)["main"]

    def run(x: np.ndarray) -> np.ndarray:
        out = to_tvm(np.zeros_like(x))
        kernel(to_tvm(x), out)
        return out.numpy()

    return run


def assert_same_bits(got: np.ndarray, want: np.ndarray, what: str) -> None:
    """Bit for bit where the input is a number; NaN for NaN (F16C quiets a NaN and drops the low bits
    of its payload, the integer form keeps them, as ggml's two forms differ)."""
    nan = np.isnan(INPUTS)
    assert np.isnan(got[nan]).all() and np.isnan(want[nan]).all(), what
    differ = np.flatnonzero(got[~nan].view(np.uint32) != want[~nan].view(np.uint32))
    inputs = INPUTS[~nan][differ[:5]]
    assert differ.size == 0, f"{what}: {differ.size} of {got.size} differ, e.g. at {inputs.tolist()}"


@pytest.fixture(scope="module")
def numpy_rounded() -> np.ndarray:
    with np.errstate(over="ignore"):
        return O.UNARY_FNS["round_f16"](INPUTS)


def test_inputs_cover_millions_of_patterns() -> None:
    assert INPUTS.size > 4_000_000
    assert np.isnan(INPUTS).sum() > 1000 and np.isinf(INPUTS).any()


def test_native_rounding_equals_numpy_bit_for_bit(numpy_rounded: np.ndarray) -> None:
    assert_same_bits(compiled("round_f16", native=True)(INPUTS), numpy_rounded, "native")


def test_integer_rounding_equals_numpy_bit_for_bit(numpy_rounded: np.ndarray) -> None:
    assert_same_bits(compiled("round_f16", native=False)(INPUTS), numpy_rounded, "integer")


def test_native_gelu_equals_the_reference() -> None:
    """Within two F16 steps plus |x| 2^-22 of numpy's table: for negative x, 1 + tanh cancels, and a
    float32 ulp of tanh (the compiled one's or numpy's) moves the result by up to |x| 2^-24; the integer
    form differs from numpy on the same inputs by the same amounts."""
    got = compiled("gelu_tanh_f16", native=True)(INPUTS)
    with np.errstate(over="ignore", invalid="ignore"):
        want = O.UNARY_FNS["gelu_tanh_f16"](INPUTS)
    number = ~np.isnan(want)
    assert np.array_equal(np.isnan(got), ~number)
    x, got, want = INPUTS[number], got[number], want[number]
    with np.errstate(over="ignore", invalid="ignore"):
        step = np.spacing(np.abs(want).astype(np.float16)).astype(np.float64)
        bound = 2 * step + np.abs(x.astype(np.float64)) * 2.0**-22
        far = np.flatnonzero((got != want) & ~(np.abs(got.astype(np.float64) - want) <= bound))
    assert far.size == 0, f"{far.size} values off, e.g. at x = {x[far[:5]].tolist()}"


@pytest.mark.slow  # the integer form's GELU kernel takes TVM ~30 s to lower
def test_native_gelu_equals_the_integer_form_bit_for_bit() -> None:
    native = compiled("gelu_tanh_f16", native=True)(INPUTS)
    assert_same_bits(native, compiled("gelu_tanh_f16", native=False)(INPUTS), "gelu")


def test_the_native_form_is_for_targets_whose_conversion_rounds_as_ggml() -> None:
    assert native_f16_rounding(named_cpu_target("haswell"))
    assert not native_f16_rounding(named_cpu_target("x86-64"))  # no F16C: a library call
    assert native_f16_rounding(gpu_target("cuda"))
    assert not native_f16_rounding(gpu_target("vulkan"))  # WGSL has no f16 type


def test_only_the_native_form_converts_to_float16() -> None:
    program = O.FusedElementwise((("unary", O.Unary("gelu_tanh_f16"), (0,)), ("unary", O.Unary("neg"), (1,))), 1)
    assert rounds_to_f16(program)
    assert not rounds_to_f16(O.FusedElementwise((("unary", O.Unary("tanh"), (0,)),), 1))
    x = te.placeholder((4,), "float32")
    native = elementwise([x.shape], program, native_f16=True).script()
    integer = elementwise([x.shape], program).script()
    assert "float16" in native and "float16" not in integer
