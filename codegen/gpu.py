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
from . import hyper_connections as HC
from . import kernel_keys as KK
from . import linear_attention as LA
from . import ngram_embedding as NG
from . import quant_gpu as QG
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


def gpu_kernel(key: KK.KernelKey, make: Callable[[], tirx.PrimFunc], target: tvm.target.Target) -> tirx.PrimFunc:
    """The GPU kernel for a lowering key: a kernel of ggufc's own where the table names one, else
    the TIR kernel `make` builds, scheduled by dlight."""
    table = POS_TENSOR_KERNELS if key.pos_in_memory else GPU_KERNELS
    own = table.get(key.kind)
    func = own(key, target) if own is not None else None
    if func is not None:
        return func
    if key.pos_in_memory:
        raise GpuScheduleError(f"kernel '{key.kind}' has no variant reading the position from device memory")
    return _schedule(make(), target, key)


def _weight_matmul(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    if key.gemv:
        return _mark(QG.gemv(key.qtype, key.n, key.k), "ggufc.row_dot")
    func, how, notes = apply_dlight(QG.gemm_compute(key.qtype, key.n, key.k), target, _dlight_rules()[:1])
    if func is None:
        return _mark(QG.rows(key.qtype, key.n, key.k), "ggufc.row_dot", notes or ["dlight.Matmul: no match"])
    return _mark(func, how, notes)


def _expert_matmul(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    return _mark(QG.experts(key.qtype, key.n_exp, key.n, key.k, key.slots, key.per_slot), "ggufc.row_dot")


def _weight_embed(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    return _schedule(QG.embed_compute(key.qtype, key.rows, key.k), target, key)


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
    return _mark(AG.attention(*_attention_sizes(key), a.scale, a.window, a.softcap, a.sinks),
                 "ggufc.attention_online_softmax")


def _sparse_attention(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    width = int(key.dims[3][1])  # dims of (q, k_cache, v_cache, sel)
    return _mark(AG.sparse_attention(*_attention_sizes(key), width, key.attrs.scale),
                 "ggufc.attention_online_softmax")


def _masked_attention(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    per_group = len(key.dims[3]) == 3  # dims of (q, k_cache, v_cache, mask): MSA's mask is one per KV group
    return _mark(AG.masked_attention(*_attention_sizes(key), key.attrs.scale, per_group),
                 "ggufc.attention_online_softmax")


def _block_sparse_attention(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    width = int(key.dims[3][2])  # dims of (q, k_cache, v_cache, sel [T, Hkv, K])
    return _mark(AG.block_sparse_attention(*_attention_sizes(key), width, key.attrs.block, key.attrs.scale),
                 "ggufc.attention_online_softmax")


def _cache_write(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    make = AG.cache_write_pos_tensor if key.pos_in_memory else AG.cache_write
    return _mark(make(tuple(int(d) for d in key.cache_shape), tuple(int(d) for d in key.x_dims[1:]), key.dtype),
                 "ggufc.cache_write")


def _causal_conv(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    return _mark(LA.ssm_conv_gpu(key.channels, key.width, key.dilation), "ggufc.scan_per_channel")


def _delta_net_scan(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    return _mark(LA.gated_delta_net_gpu(key.hv, key.dv, key.dk, key.hk, key.attrs.head_map, key.attrs.scale,
                                        key.attrs.key_decay),
                 "ggufc.scan_per_row")


def _lightning_scan(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    return _mark(LA.lightning_attention_gpu(key.h, key.dk, key.dv, key.attrs.slopes, key.attrs.layer_scale),
                 "ggufc.scan_per_column")


def _index_mask(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    neg_inf = tirx.reinterpret("float32", tirx.const(0xFF800000, "uint32"))  # WGSL has no infinity literal
    return _schedule(SI.index_mask(Symbols().shape(key.dims[0]), neg_inf), target, key)


def _block_mask(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    neg_inf = tirx.reinterpret("float32", tirx.const(0xFF800000, "uint32"))  # WGSL has no infinity literal
    return _schedule(SI.block_mask(Symbols().shape(key.dims[0]), key.attrs.block, neg_inf), target, key)


def _block_score(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    q_dims, cache_dims = key.dims[:2]
    return _mark(SI.block_score_gpu(int(q_dims[1]), int(q_dims[2]), int(cache_dims[0]), key.attrs.block),
                 "ggufc.max_dot_per_block")


def _compressor_pool(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    n_cells, wide = key.dims[0]
    return _mark(SI.compressor_pool_gpu(int(n_cells), int(wide), key.attrs.ratio, key.attrs.overlap),
                 "ggufc.pool_per_channel")


def _block_topk(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    a = key.attrs
    _, n_groups, nb = key.dims[0]
    return _mark(SI.block_topk_gpu(int(n_groups), int(nb), a.block, a.top_k, a.local), "ggufc.select_per_row")


def _ngram_hash(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    a = key.attrs
    return _mark(NG.ple_hash_gpu(key.cells, a.ngram, a.heads_per_ngram, a.multipliers, a.offsets, a.sizes, a.eos),
                 "ggufc.hash_per_token")


def _indexer_topk(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    a = key.attrs
    return _mark(SI.indexer_topk_gpu(key.blocks, a.ratio, a.width, key.cells), "ggufc.heap_select_per_row")


def _token_score(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    (_, n_head, dim), (n_cells, _) = key.dims[:2]
    return _mark(SI.token_score_gpu(int(n_head), int(dim), int(n_cells)), "ggufc.dot_per_cell")


def _token_topk(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    return _mark(SI.token_topk_gpu(key.attrs.width), "ggufc.heap_select_per_row")


def _compressed_score(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    a, n_rows = key.attrs
    _, n_head, dim = key.dims[0]  # dims of (q, w, rows)
    return _mark(SI.compressed_score_gpu(int(n_head), int(dim), n_rows, a.ratio), "ggufc.dot_per_row")


def _compressed_attention(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    a, n_cells, n_rows, n_sel = key.attrs
    _, n_head, dim = key.dims[0]  # dims of (q, cache, sinks[, rows[, sel]])
    return _mark(SI.compressed_attention_gpu(int(n_head), int(dim), n_cells, a, n_rows, n_sel),
                 "ggufc.attention_online_softmax")


def _hc_pre(key: Any, target: tvm.target.Target) -> tirx.PrimFunc | None:
    """The Sinkhorn mix's own kernel (None: the low-rank rule, its TE definition scheduled by dlight)."""
    if key.attrs.rule != "sinkhorn":
        return None
    _, n_hc, e = key.dims[0]  # dims of (R, fn, scale, base)
    return _mark(HC.hc_pre_sinkhorn_gpu(int(n_hc), int(e), key.attrs), "ggufc.mix_per_token")


def _hc_post(key: Any, target: tvm.target.Target) -> tirx.PrimFunc | None:
    """The comb-mixed scatter's own kernel (None: the plain scatter, dlight's)."""
    if not key.attrs:
        return None
    _, n_hc, e = key.dims[0]  # dims of (R, y, post, comb)
    return _mark(HC.hc_post_comb_gpu(int(n_hc), int(e)), "ggufc.mix_per_element")


def _attention_pos_tensor(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    a = key.attrs
    _no_sinks(a)
    return _mark(AG.attention_pos_tensor(*_attention_sizes(key), a.scale, a.window, a.softcap),
                 "ggufc.attention_online_softmax")


def _rope_pos_tensor(key: Any, target: tvm.target.Target) -> tirx.PrimFunc:
    x_dims, table_dims = key.dims
    shape = tuple(tirx.IntImm("int64", int(d)) for d in x_dims)
    tshape = tuple(tirx.IntImm("int64", int(d)) for d in table_dims)
    return _schedule(AG.rope_pos_tensor(shape, tshape, key.attrs), target, key)


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
    KK.CausalConv.kind: _causal_conv,
    KK.DeltaNetScan.kind: _delta_net_scan,
    KK.LightningScan.kind: _lightning_scan,
    "index_mask": _index_mask,
    KK.NgramHash.kind: _ngram_hash,
    KK.IndexerTopK.kind: _indexer_topk,
    "token_score": _token_score,
    "token_topk": _token_topk,
    "block_mask": _block_mask,
    "indexer_block_score": _block_score,
    "compressor_pool": _compressor_pool,
    "block_topk": _block_topk,
    "compressed_score": _compressed_score,
    "compressed_attention": _compressed_attention,
    "hc_pre": _hc_pre,
    "hc_post": _hc_post,
}
# cuda decode captured as one CUDA graph: the kernels that read the position from device memory
POS_TENSOR_KERNELS: dict[str, GpuKernel] = {
    "attention": _attention_pos_tensor,
    KK.CacheWrite.kind: _cache_write,
    "rope": _rope_pos_tensor,
}


# dlight rules worth trying per kernel kind (the full default list for kinds not named here): a rule
# that cannot apply to a kind only costs compile time and leaves a failure note
_SPATIAL = ("elementwise", "rope", "last_token", "slice", "concat", "gather", "embed", "topk", "swiglu_halves",
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


def _schedule(func: tirx.PrimFunc, target: tvm.target.Target, key: KK.KernelKey) -> tirx.PrimFunc:
    scheduled, how, notes = apply_dlight(func, target, _rules_for(key.kind))
    if scheduled is not None:
        return _mark(scheduled, how, notes)
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
