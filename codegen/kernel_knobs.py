"""Knobs of the hand-written CPU kernels: the search spaces `ggufc tune` explores per workload.

MetaSchedule cannot search these kernels (they are written loop by loop in TVMScript, with LLVM
intrinsics), so each kernel family exposes a few parameters whose values `ggufc tune` times on the
workload's own shapes (driver/tune/, next to MetaSchedule, in the same database):

    8-bit GEMV groups (block32.int8_gemv_group)   prefetch_groups  row groups prefetched ahead
                                                                      (Q4_K interleaved: at most
                                                                      AHEAD_BYTES ahead, ~24 KiB)
                                                     groups_per_task  row groups per parallel task
                                                     unroll           a super-block's runs unrolled
                                                                      (0/1; Q4_K, Q5_K, Q6_K)
    vector SwiGLU (cpu_vector_math.swiglu)                   column_tasks     parallel tasks per token
    causal attention (attention.attention_rows)  rows_per_task  (token, head) rows per
                                                                     parallel task (not where a
                                                                     one-token call runs one task
                                                                     per KV head)

Every knob keeps each output value's float operations and their order: it moves work between
threads, or changes what is prefetched, never how a sum is split or associated. So a tuned kernel
gives bit-identical results to the default one (tests/test_kernel_knobs.py checks it), and the
bit-exactness against llama.cpp (tests/test_llama_order.py) holds with any database; a knob that
changed the order would need the user's consent and is not offered. The defaults are the values
the kernels are written with; a workload whose knobs all stay at their defaults builds exactly
today's kernel.

The 8-bit GEMV groups cover every decode matmul of an 8-bit model, K-quant ones and the output
layer included (lower.py lowers a one-token 8-bit matmul to a group of one); the RMSNorm before
them, the SwiGLU before the down matrix and the input's rounding to 8 bits (quantize_act) run in
their prologue, so they have no kernel of their own in a decode step. The attention kernel's cost
grows with the cache position, which a workload does not fix: it is timed at TIMING_POSITION.

`unroll`'s best value follows the timing regime as much as the machine: on the development VM a
super-block's runs unrolled (alone) made Q4_K GEMVs 1.00-1.06x as fast hot (weights in the caches)
and 0.94-1.00x as fast cold (weights streamed from memory), so the default keeps the loop rolled;
with other settings, a cold session still picked it for half of a model's GEMV groups.

No knobs yet: the row-group size (4 rows: the Q4_1 minimum terms of a group are one float32x4),
a KV block for attention (a row reads its cells once, in order; blocking them would only reorder
loads), the prompt GEMM's token tile (no prompt kernel is tuned: a session tunes the decode step),
and GPU workgroup shapes (only llvm kernels have knobs).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import tvm
from tvm import tirx

from ggufc.codegen.cpu_int8 import block32 as Q8
from ggufc.codegen.cpu_int8.isa import int8_isa
from ggufc.codegen.cpu_int8.kquant import UNROLLABLE
from ggufc.codegen.kernel_keys import Int8GemvGroup, KernelKey, OpKernel
from ggufc.codegen.kernels import attention as KA
from ggufc.codegen.kernels import cpu_vector_math as CV
from ggufc.codegen.target import target_cores

Knobs = dict[str, int]

GEMV_KNOBS: dict[str, tuple[int, ...]] = {
    "prefetch_groups": (Q8.PREFETCH_GROUPS, 1, 2, 8, 16),
    "groups_per_task": (1, 2, 4, 8),
}
UNROLL_KNOB: dict[str, tuple[int, ...]] = {"unroll": (0, 1)}  # GEMVs of kquant.UNROLLABLE types
SWIGLU_KNOBS: dict[str, tuple[int, ...]] = {"column_tasks": (1, 2, 4, 8, 16)}
ATTENTION_KNOBS: dict[str, tuple[int, ...]] = {"rows_per_task": (1, 2, 4, 8)}
TIMING_POSITION = 255  # the cache position attention is timed at (256 visible cells)


def family(key: KernelKey, target: tvm.target.Target) -> str | None:
    """The knob family of a kernel key on a target ('int8_gemv', 'swiglu', 'attention'), or None."""
    if target.kind.name != "llvm":
        return None
    if isinstance(key, Int8GemvGroup) and int8_isa(target) is not None:
        return "int8_gemv"
    if isinstance(key, OpKernel) and key.op == "swiglu" and isinstance(key.attrs, int):
        return "swiglu"
    if isinstance(key, OpKernel) and key.op == "attention" and (row := _row_attention(key)) is not None:
        attrs, _, heads, kv, _, _ = row
        one_token = key.dims[0][0] == 1
        if one_token and KA.heads_grouped(heads, kv, target_cores(target), attrs.f16_pv_below) and not attrs.sinks:
            return None  # one task per KV head: no rows to spread
        return "attention"
    return None


def _row_attention(key: OpKernel) -> tuple[Any, bool, int, int, int, int] | None:
    """(attrs, one_token_order, heads, kv heads, head dim, cells) of a causal attention key that
    lowering builds as `attention_rows` (lower.py), or None."""
    attrs, one_token = key.attrs, False
    if isinstance(attrs, tuple):  # (attrs, "one_token_order"); other tags are other kernels
        if attrs[1:] != ("one_token_order",):
            return None
        attrs, one_token = attrs[0], True
    if getattr(attrs, "mask", None) != "causal" or len(key.dims) != 3:
        return None
    (_, heads, dim), (cells, kv, _) = key.dims[0], key.dims[1]
    if not all(isinstance(d, int) for d in (heads, dim, cells, kv)):
        return None
    if dim % KA.STEP and not attrs.f16_pv_below:
        return None
    return attrs, one_token, int(heads), int(kv), int(dim), int(cells)


def defaults(key: KernelKey, target: tvm.target.Target) -> Knobs:
    grid = _grid(key, target)
    return {name: values[0] for name, values in grid.items()}


def space(key: KernelKey, target: tvm.target.Target) -> list[Knobs]:
    """Every knob setting of the workload but the default one, in a fixed order: settings that
    change one knob first (each value in turn), then the combinations."""
    grid = _grid(key, target)
    base = {name: values[0] for name, values in grid.items()}
    singles = [{**base, name: v} for name, values in grid.items() for v in values[1:]]
    combos = [dict(zip(grid, vs, strict=True)) for vs in itertools.product(*grid.values())]
    seen: list[Knobs] = []
    for knobs in singles + combos:
        if knobs != base and knobs not in seen:
            seen.append(knobs)
    return seen


def build(key: KernelKey, target: tvm.target.Target, knobs: Knobs) -> tirx.PrimFunc:
    """The kernel of `key` with `knobs` (missing ones at their defaults)."""
    fam = family(key, target)
    if fam is None:
        raise ValueError(f"{key!r} has no knobs on {target.kind.name}")
    settings = {**defaults(key, target), **knobs}
    return _BUILDERS[fam](key, target, settings)


def _grid(key: KernelKey, target: tvm.target.Target) -> dict[str, tuple[int, ...]]:
    fam = family(key, target)
    if fam == "int8_gemv":
        unrollable = isinstance(key, Int8GemvGroup) and key.qtype in UNROLLABLE
        return {**GEMV_KNOBS, **UNROLL_KNOB} if unrollable else GEMV_KNOBS
    if fam == "swiglu":
        vectors = int(key.attrs) // 8  # type: ignore[attr-defined]
        return {"column_tasks": tuple(v for v in SWIGLU_KNOBS["column_tasks"] if v <= max(1, vectors))}
    if fam == "attention":
        return ATTENTION_KNOBS
    raise ValueError(f"{key!r} has no knobs on {target.kind.name}")


def _build_gemv(key: Any, target: tvm.target.Target, knobs: Knobs) -> tirx.PrimFunc:
    return Q8.int8_gemv_group(key.qtype, key.ns, key.k, target, key.prologue, key.residual,
                              prefetch_groups=knobs["prefetch_groups"], groups_per_task=knobs["groups_per_task"],
                              unroll=bool(knobs.get("unroll", 0)))


def _build_swiglu(key: Any, target: tvm.target.Target, knobs: Knobs) -> tirx.PrimFunc:
    return CV.swiglu(int(key.attrs), column_tasks=knobs["column_tasks"])


def _build_attention(key: Any, target: tvm.target.Target, knobs: Knobs) -> tirx.PrimFunc:
    attrs, one_token, heads, kv, dim, cells = _row_attention(key)  # type: ignore[misc]
    return KA.attention_rows(heads, kv, dim, cells, attrs.scale, one_token, attrs.f16_pv_below,
                             rows_per_task=knobs["rows_per_task"], threads=target_cores(target),
                             window=attrs.window, softcap=attrs.softcap, sinks=attrs.sinks)


_BUILDERS: dict[str, Callable[[Any, tvm.target.Target, Knobs], tirx.PrimFunc]] = {
    "int8_gemv": _build_gemv,
    "swiglu": _build_swiglu,
    "attention": _build_attention,
}


def decode_args(key: KernelKey, func: tirx.PrimFunc) -> list[tuple[str, tuple[int, ...]]] | None:
    """(dtype, shape) of the kernel's arguments at one token (a decode step), or None when they
    are not known: the GEMV groups' arguments are all static; SwiGLU's lead with the token count;
    attention's are (q, k cache, v cache, pos, out), pos an int64 scalar (shape ()) that the timer
    sets to TIMING_POSITION."""
    if isinstance(key, OpKernel) and key.op == "swiglu" and isinstance(key.attrs, int):
        return [("float32", (1, int(key.attrs)))] * 3
    if isinstance(key, OpKernel) and key.op == "attention":
        row = _row_attention(key)
        if row is None or row[5] <= TIMING_POSITION:
            return None
        _, _, heads, kv, dim, cells = row
        q, cache = ("float32", (1, heads, dim)), ("float32", (cells, kv, dim))
        return [q, cache, cache, ("int64", ()), q]
    from tvm.s_tir import meta_schedule as ms

    try:
        infos = ms.arg_info.ArgInfo.from_prim_func(func)
    except Exception:  # noqa: BLE001 - a symbolic shape or a scalar argument
        return None
    out = []
    for info in infos:
        kind, dtype, shape = info.as_json()
        if kind != "TENSOR":
            return None
        out.append((str(dtype), tuple(int(d) for d in shape)))
    return out
