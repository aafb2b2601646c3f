"""GPU targets (cuda, vulkan, metal) and the GPU schedule of every kernel.

One IR, one lowering table (`lower.py`); on a GPU target `ModuleBuilder.kernel` asks
`gpu_kernel(key, make, target)` for each kernel instead of the CPU schedule:

* matmuls, embeddings and expert matmuls read weights in the packed GPU layout of
  `codegen/gpu/block_formats.py`; decode GEMVs and selected-expert matmuls get ggufc's row-dot schedule
  (workgroup per row tile, threads split K, cross-thread reduction); prefill matmuls get
  dlight's Matmul rule with the dequantisation inlined into its tiles (ggufc's row-dot schedule
  where that rule does not apply, recorded as such);
* attention over the KV cache and the in-place cache write are TIR kernels of their own
  (`codegen/gpu/attention.py`);
* every other kernel (elementwise chains, norms, rope, softmax, top-k, ...) is the same TE
  definition as on CPU, scheduled by the dlight rules in the default order; a rule that raises is
  skipped and its error kept (`ggufc.schedule_notes`).

A kernel that no rule schedules is an error naming it: an unscheduled kernel would run on one
GPU thread (or fail later with TVM's "did you forget to bind?"). Each kernel records the
schedule that produced it in the `ggufc.schedule` function attribute (listed in the manifest).

Target names: `vulkan` is TVM's `webgpu` codegen (WGSL, run through wgpu on Vulkan); `metal` is
TVM's `metal` codegen (MSL); `cuda` takes `arch` (one or more `sm_XY`) and its host code is
generic x86-64/aarch64, since it runs on whatever CPU drives the GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import tvm
import tvm_ffi
from tvm import tirx

from ggufc.codegen import kernel_keys as KK
from ggufc.codegen.gpu import attention as AG
from ggufc.codegen.gpu import block_formats as QG
from ggufc.codegen.gpu import device_info as DI


class GpuScheduleError(RuntimeError):
    """No GPU schedule for a kernel (the message names the kernel and why)."""


# ---------------------------------------------------------------------------------------------
# targets


# ---------------------------------------------------------------------------------------------
# schedules


def _dlight_rules() -> list[tuple[str, Any]]:
    from tvm.s_tir import dlight as dl

    return [("dlight.Matmul", dl.gpu.Matmul()), ("dlight.GEMV", dl.gpu.GEMV()),
            ("dlight.LowBatchGEMV", dl.gpu.LowBatchGEMV()), ("dlight.Reduction", dl.gpu.Reduction()),
            ("dlight.GeneralReduction", dl.gpu.GeneralReduction()), ("dlight.Transpose", dl.gpu.Transpose()),
            ("dlight.Fallback", dl.gpu.Fallback())]


def _first_line(exc: BaseException) -> str:
    for line in str(exc).strip().splitlines():
        if line.strip():
            return line.strip()[:200]
    return type(exc).__name__


def apply_dlight(func: tirx.PrimFunc, target: tvm.target.Target,
                 rules: Sequence[tuple[str, Any]] | None = None) -> tuple[tirx.PrimFunc | None, str, list[str]]:
    """(scheduled func or None, rule name, notes on rules that raised)."""
    notes: list[str] = []
    for name, rule in rules if rules is not None else _dlight_rules():
        try:
            with target, _no_simdgroup_matmul(target):
                sch = rule.apply(func, target, False)
        except Exception as exc:  # noqa: BLE001 - a failing rule is recorded and skipped
            notes.append(f"{name} failed: {_first_line(exc)}")
            continue
        if sch is None:
            continue
        if isinstance(sch, list):
            sch = sch[0]
        problem = launch_problem(sch.mod["main"], target)
        if problem is not None:  # e.g. a batch loop left on the host: one launch per token
            notes.append(f"{name} rejected: {problem}")
            continue
        return sch.mod["main"], name, notes
    return None, "", notes


@contextlib.contextmanager
def _no_simdgroup_matmul(target: tvm.target.Target) -> Iterator[None]:
    """On metal, dlight's Matmul first tries MetalMatmul (simdgroup tensorization, f16 only). Every
    ggufc matmul is f32, so it can only fail, after importing all of TVM's tensor intrinsics
    (30-40 s per process); it is skipped and the SIMT matmul schedule applies directly."""
    if target.kind.name != "metal":
        yield
        return
    from tvm.s_tir.dlight.gpu import matmul as dl_matmul

    original = dl_matmul.MetalMatmul.apply
    dl_matmul.MetalMatmul.apply = lambda self, func, target, tunable: None  # type: ignore[method-assign]
    try:
        yield
    finally:
        dl_matmul.MetalMatmul.apply = original  # type: ignore[method-assign]


def launch_problem(func: tirx.PrimFunc, target: tvm.target.Target) -> str | None:
    """Why a scheduled kernel is not a straight sequence of device launches (None if it is):
    host-side loops around launches, or an unbound statement that would run on the host."""
    try:
        host, device = DI.lower(func, target, "check")
        DI.read_launches(next(iter(host.functions.values())), device, "check")
    except DI.DeviceCodegenError as exc:
        return str(exc).removeprefix("check: ")
    return None


def _is_cpu_kernel(func: tirx.PrimFunc) -> bool:
    """A hand-written CPU kernel (parallel or vectorised loops) that dlight cannot schedule."""
    found = []

    def visit_for(node: tirx.For) -> None:
        if node.kind in (tirx.ForKind.PARALLEL, tirx.ForKind.VECTORIZED):
            found.append(node)

    tvm_ffi.structural_walk(func.body, [(tirx.For, visit_for)], order="post")
    return bool(found)


def mark_schedule(func: tirx.PrimFunc, how: str, notes: Sequence[str] = ()) -> tirx.PrimFunc:
    func = func.with_attr("ggufc.schedule", how).with_attr("tirx.is_scheduled", True)
    if notes:
        func = func.with_attr("ggufc.schedule_notes", "; ".join(notes))
    return func.with_attr("tirx.noalias", True)


DECODE_IO_STATES = (("decode_token", (1,), "int32"), ("decode_pos", (1,), "int32"))


def decode_io_supported(graph: Any) -> bool:
    """Whether every kernel of the decode step can read the position from device memory (then a
    cuda decode is captured whole as one CUDA graph): the ops taking the position are rope,
    attention and the cache write, which have such variants."""
    for node in graph.nodes:
        if any(v.shape == () for v in node.inputs):
            if node.op not in ("rope", "attention", "cache_write"):
                return False
            if node.op == "rope" and node.attrs.mode not in ("norm", "neox", "imrope"):
                return False
    return True


def gpu_kernel(key: KK.KernelKey, make: Callable[[], tirx.PrimFunc], target: tvm.target.Target,
               own_kernels: dict[str, GpuKernel] | None = None) -> tirx.PrimFunc:
    """The GPU kernel for a lowering key: a kernel of ggufc's own where the table names one
    (`own_kernels`: GPU_KERNELS and the op families' tables, as lower.py merges them), else the TIR
    kernel `make` builds, scheduled by dlight."""
    table = POS_TENSOR_KERNELS if key.pos_in_memory else (GPU_KERNELS if own_kernels is None else own_kernels)
    own = table.get(key.kind)
    func = own(key, target) if own is not None else None
    if func is not None:
        return func
    if key.pos_in_memory:
        raise GpuScheduleError(f"kernel '{key.kind}' has no variant reading the position from device memory")
    return dlight_schedule(make(), target, key)


def _weight_matmul(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    if key.gemv:
        return mark_schedule(QG.gemv(key.qtype, key.n, key.k), "ggufc.row_dot")
    func, how, notes = apply_dlight(QG.gemm_compute(key.qtype, key.n, key.k), target, _dlight_rules()[:1])
    if func is None:
        return mark_schedule(QG.rows(key.qtype, key.n, key.k), "ggufc.row_dot", notes or ["dlight.Matmul: no match"])
    return mark_schedule(func, how, notes)


def _expert_matmul(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    return mark_schedule(QG.experts(key.qtype, key.n_exp, key.n, key.k, key.slots, key.per_slot), "ggufc.row_dot")


def _weight_embed(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    return dlight_schedule(QG.embed_compute(key.qtype, key.rows, key.k), target, key)


def _no_sinks(a: Any) -> None:
    if a.sinks:
        raise ValueError("attention sinks (gpt-oss) are not compiled for the position-in-memory (CUDA graph) "
                         "decode step yet")


def _attention_sizes(key: Any) -> tuple[int, int, int, int]:
    """(heads, kv heads, head dim, cache cells) of an attention key's q and k-cache dims."""
    q_dims, cache_dims = key.dims[:2]
    return int(q_dims[1]), int(cache_dims[1]), int(q_dims[2]), int(cache_dims[0])


def _attention(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    a = key.attrs
    return mark_schedule(AG.attention(*_attention_sizes(key), a.scale, a.window, a.softcap, a.sinks),
                 "ggufc.attention_online_softmax")


def _sparse_attention(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    width = int(key.dims[3][1])  # dims of (q, k_cache, v_cache, sel)
    return mark_schedule(AG.sparse_attention(*_attention_sizes(key), width, key.attrs.scale),
                 "ggufc.attention_online_softmax")


def _masked_attention(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    per_group = len(key.dims[3]) == 3  # dims of (q, k_cache, v_cache, mask): MSA's mask is one per KV group
    return mark_schedule(AG.masked_attention(*_attention_sizes(key), key.attrs.scale, per_group),
                 "ggufc.attention_online_softmax")


def _block_sparse_attention(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    width = int(key.dims[3][2])  # dims of (q, k_cache, v_cache, sel [T, Hkv, K])
    return mark_schedule(AG.block_sparse_attention(*_attention_sizes(key), width, key.attrs.block, key.attrs.scale),
                 "ggufc.attention_online_softmax")


def _cache_write(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    make = AG.cache_write_pos_tensor if key.pos_in_memory else AG.cache_write
    return mark_schedule(make(tuple(int(d) for d in key.cache_shape), tuple(int(d) for d in key.x_dims[1:]), key.dtype),
                 "ggufc.cache_write")






















def _attention_pos_tensor(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    a = key.attrs
    _no_sinks(a)
    return mark_schedule(AG.attention_pos_tensor(*_attention_sizes(key), a.scale, a.window, a.softcap),
                 "ggufc.attention_online_softmax")


def _rope_pos_tensor(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    x_dims, table_dims = key.dims
    shape = tuple(tirx.IntImm("int64", int(d)) for d in x_dims)
    tshape = tuple(tirx.IntImm("int64", int(d)) for d in table_dims)
    return dlight_schedule(AG.rope_pos_tensor(shape, tshape, key.attrs), target, key)


GpuKernel = Callable[[Any, tvm.target.Target], tirx.PrimFunc | None]
# the GPU targets' lowering table: kernels of ggufc's own by key kind (all others, and keys for which
# the entry gives None: dlight schedules)
GPU_KERNELS: dict[str, GpuKernel] = {
    KK.WeightMatmul.kind: _weight_matmul,
    KK.ExpertMatmul.kind: _expert_matmul,
    KK.WeightEmbed.kind: _weight_embed,
    "attention": _attention,
    "sparse_attention": _sparse_attention,
    "masked_attention": _masked_attention,
    "block_sparse_attention": _block_sparse_attention,
    KK.CacheWrite.kind: _cache_write,
}
# cuda decode captured as one CUDA graph: the kernels that read the position from device memory
POS_TENSOR_KERNELS: dict[str, GpuKernel] = {
    "attention": _attention_pos_tensor,
    KK.CacheWrite.kind: _cache_write,
    "rope": _rope_pos_tensor,
}


# dlight rules worth trying per kernel kind (the full default list for kinds not named here): a rule
# that cannot apply to a kind only costs compile time and leaves a failure note
_SPATIAL = ("elementwise", "rope", "last_token", "slice", "concat", "gather", "embed", "topk", "moe_topk_softmax",
            "swiglu_halves",
            "hc_post", "act_halves", "shared_add", "take_along")
_REDUCTION = ("reduce", "rms_norm", "softmax", "moe_normalize", "weighted_sum", "l2_norm", "rms_norm_gated")


def _rules_for(kind: str) -> list[tuple[str, Any]]:
    rules = dict(_dlight_rules())
    if kind in _SPATIAL:
        names = ["dlight.Fallback"]
    elif kind == "transpose":
        names = ["dlight.Transpose", "dlight.Fallback"]
    elif kind in _REDUCTION:
        names = ["dlight.Reduction", "dlight.GeneralReduction", "dlight.Fallback"]
    else:
        return list(rules.items())
    return [(n, rules[n]) for n in names]


def dlight_schedule(func: tirx.PrimFunc, target: tvm.target.Target, key: KK.KernelKey) -> tirx.PrimFunc:
    scheduled, how, notes = apply_dlight(func, target, _rules_for(key.kind))
    if scheduled is not None:
        return mark_schedule(scheduled, how, notes)
    if _is_cpu_kernel(func):
        raise GpuScheduleError(
            f"kernel '{key.kind}' is a hand-written CPU kernel (parallel/vectorised TIR loops, no blocks for a "
            f"GPU schedule); it has no {target.kind.name} version yet")
    why = "; ".join(notes) if notes else "no dlight rule matched"
    raise GpuScheduleError(f"no {target.kind.name} schedule for kernel '{key.kind}' ({why})")


# ---------------------------------------------------------------------------------------------
# reporting


def schedule_of(func: Any) -> str:
    attrs = getattr(func, "attrs", None)
    return str(attrs["ggufc.schedule"]) if attrs is not None and "ggufc.schedule" in attrs else "cpu"


def schedule_table(mod: tvm.IRModule, names: Sequence[str]) -> dict[str, str]:
    """kernel name -> the schedule that produced it (for the manifest)."""
    out = {}
    for name in names:
        for gv, func in mod.functions.items():
            if gv.name_hint == name:
                how = schedule_of(func)
                attrs = func.attrs
                if attrs is not None and "ggufc.schedule_notes" in attrs:
                    how += f" ({attrs['ggufc.schedule_notes']})"
                out[name] = how
    return out
