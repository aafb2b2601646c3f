"""GPU targets (cuda, vulkan, metal) and the GPU schedule of every kernel.

One IR, one lowering table (`lower.py`); on a GPU target `ModuleBuilder.kernel` asks
`gpu_kernel(key, make, target)` for each kernel instead of the CPU schedule:

* matmuls, embeddings and expert matmuls read weights in the packed GPU layout of
  `quant_gpu.py`; decode GEMVs and selected-expert matmuls get ggufc's row-dot schedule
  (workgroup per row tile, threads split K, cross-thread reduction); prefill matmuls get
  dlight's Matmul rule with the dequantisation inlined into its tiles (ggufc's row-dot schedule
  where that rule does not apply, recorded as such);
* attention over the KV cache and the in-place cache write are TIR kernels of their own
  (`attention_gpu.py`);
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

from . import attention_gpu as AG
from . import device_info as DI
from . import ngram_embedding as NG
from . import quant_gpu as QG
from . import recurrent_gpu as RG
from . import sparse_indexers as SI
from .kernels import Symbols


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


def _mark(func: tirx.PrimFunc, how: str, notes: Sequence[str] = ()) -> tirx.PrimFunc:
    func = func.with_attr("ggufc.schedule", how).with_attr("tirx.is_scheduled", True)
    if notes:
        func = func.with_attr("ggufc.schedule_notes", "; ".join(notes))
    return func.with_attr("tirx.noalias", True)


POS_TENSOR = "pos_tensor"
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


def gpu_kernel(key: tuple[Any, ...], make: Callable[[], tirx.PrimFunc], target: tvm.target.Target) -> tirx.PrimFunc:
    """The GPU kernel for a lowering-table key (see `lower.py` for the key of each op)."""
    kind = key[0]
    if key[-1] == POS_TENSOR:
        return _pos_tensor_kernel(key[:-1], target)
    if kind == "matmul":
        _, qtype, n, k, gemv = key
        if gemv:
            return _mark(QG.gemv(qtype, n, k), "ggufc.row_dot")
        func, how, notes = apply_dlight(QG.gemm_compute(qtype, n, k), target, _dlight_rules()[:1])
        if func is None:
            return _mark(QG.rows(qtype, n, k), "ggufc.row_dot", notes or ["dlight.Matmul: no match"])
        return _mark(func, how, notes)
    if kind == "experts":
        _, qtype, n_exp, n, k, slots, per_slot = key
        return _mark(QG.experts(qtype, n_exp, n, k, slots, per_slot), "ggufc.row_dot")
    if kind == "embed":
        _, qtype, rows, k = key
        return _schedule(QG.embed_compute(qtype, rows, k), target, key)
    if kind == "attention":
        (q_dims, cache_dims, _) = key[2]
        n_head, dim = int(q_dims[1]), int(q_dims[2])
        n_cells, n_kv = int(cache_dims[0]), int(cache_dims[1])
        return _mark(AG.attention(n_head, n_kv, dim, n_cells, key[1].scale), "ggufc.attention_online_softmax")
    if kind == "cache_write":
        cshape, xdims = key[1], key[2]
        dtype = key[3] if len(key) > 3 else "float32"
        return _mark(AG.cache_write(tuple(int(d) for d in cshape), tuple(int(d) for d in xdims[1:]), dtype),
                     "ggufc.cache_write")
    if kind == "ssm_conv":  # ("ssm_conv", channels, width, dilation)
        return _mark(RG.ssm_conv(int(key[1]), int(key[2]), int(key[3])), "ggufc.scan_per_channel")
    if kind == "gated_delta_net":  # ("gated_delta_net", hv, dv, dk, hk, attrs)
        _, hv, dv, dk, hk, attrs = key
        return _mark(RG.gated_delta_net(int(hv), int(dv), int(dk), int(hk), attrs.head_map, attrs.scale),
                     "ggufc.scan_per_row")
    if kind == "sparse_attention":  # ("sparse_attention", attrs, (q, k_cache, v_cache, sel) dims)
        q_dims, cache_dims, _, sel_dims = key[2]
        return _mark(AG.sparse_attention(int(q_dims[1]), int(cache_dims[1]), int(q_dims[2]), int(cache_dims[0]),
                                         int(sel_dims[1]), key[1].scale), "ggufc.attention_online_softmax")
    if kind == "masked_attention":  # ("masked_attention", attrs, (q, k_cache, v_cache, mask) dims)
        q_dims, cache_dims = key[2][:2]
        return _mark(AG.masked_attention(int(q_dims[1]), int(cache_dims[1]), int(q_dims[2]), int(cache_dims[0]),
                                         key[1].scale), "ggufc.attention_online_softmax")
    if kind == "index_mask":  # -inf as its bit pattern: WGSL has no infinity literal
        neg_inf = tirx.reinterpret("float32", tirx.const(0xFF800000, "uint32"))
        return _schedule(SI.index_mask(Symbols().shape(key[1][0]), neg_inf), target, key)
    if kind == "ple_hash":  # ("ple_hash", attrs, cells)
        a, n_cells = key[1], int(key[2])
        return _mark(NG.ple_hash_gpu(n_cells, a.ngram, a.heads_per_ngram, a.multipliers, a.offsets, a.sizes, a.eos),
                     "ggufc.hash_per_token")
    if kind == "indexer_topk":  # ("indexer_topk", attrs, blocks + 1, cells)
        a, nb1, n_cells = key[1], int(key[2]), int(key[3])
        return _mark(SI.indexer_topk_gpu(nb1, a.ratio, a.width, n_cells), "ggufc.heap_select_per_row")
    return _schedule(make(), target, key)


def _pos_tensor_kernel(key: tuple[Any, ...], target: tvm.target.Target) -> tirx.PrimFunc:
    kind = key[0]
    if kind == "attention":
        (q_dims, cache_dims, _) = key[2]
        return _mark(AG.attention_pos_tensor(int(q_dims[1]), int(cache_dims[1]), int(q_dims[2]), int(cache_dims[0]),
                                             key[1].scale), "ggufc.attention_online_softmax")
    if kind == "cache_write":
        cshape, xdims = key[1], key[2]
        dtype = key[3] if len(key) > 3 else "float32"
        return _mark(AG.cache_write_pos_tensor(tuple(int(d) for d in cshape), tuple(int(d) for d in xdims[1:]), dtype),
                     "ggufc.cache_write")
    if kind == "rope":
        x_dims, table_dims = key[2]
        shape = tuple(tirx.IntImm("int64", int(d)) for d in x_dims)
        tshape = tuple(tirx.IntImm("int64", int(d)) for d in table_dims)
        return _schedule(AG.rope_pos_tensor(shape, tshape, key[1]), target, key)
    raise GpuScheduleError(f"kernel '{kind}' has no variant reading the position from device memory")


# dlight rules worth trying per kernel kind (the full default list for kinds not named here): a rule
# that cannot apply to a kind only costs compile time and leaves a failure note
_SPATIAL = ("elementwise", "rope", "last_token", "slice", "concat", "gather", "embed", "topk", "swiglu_halves",
            "hc_post")
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


def _schedule(func: tirx.PrimFunc, target: tvm.target.Target, key: tuple[Any, ...]) -> tirx.PrimFunc:
    scheduled, how, notes = apply_dlight(func, target, _rules_for(str(key[0])))
    if scheduled is not None:
        return _mark(scheduled, how, notes)
    if _is_cpu_kernel(func):
        raise GpuScheduleError(
            f"kernel '{key[0]}' is a hand-written CPU kernel (parallel/vectorised TIR loops, no blocks for a "
            f"GPU schedule); it has no {target.kind.name} version yet")
    why = "; ".join(notes) if notes else "no dlight rule matched"
    raise GpuScheduleError(f"no {target.kind.name} schedule for kernel '{key[0]}' ({why})")


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
