"""Multi-head latent attention (MLA): the lowering of `head_matmul` (references:
`ir/latent_attention.py`).

`head_matmul` (x [T,H,K], W [H,N,K] -> [T,H,N]: MLA's absorbed `attn_k_b` and `attn_v_b`) is the
expert matmul with expert h fixed to slot h: the ids [T, H] = h come from a one-line kernel and
the per-slot expert kernel of the weight's format (`quant.qmatmul_experts`, every block type,
GPU variants as for MoE experts) does the rest. The attention over the latent cache is the
ordinary `attention` op (its rows are keys and values).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tvm import te, tirx

from ggufc.codegen import kernel_keys as KK
from ggufc.codegen.formats.cpu_schedules import qmatmul_experts
from ggufc.codegen.kernels.prim_helpers import func, i64
from ggufc.codegen.lower_context import FunctionContext, weight_args
from ggufc.ir.graph import Node


def head_ids(n_head: int) -> tirx.PrimFunc:
    """`(ids [T, H] int32)`: ids[t, h] = h, the slot-to-matrix map of a per-head matmul."""
    n = tirx.Var("n", "int64")
    ids = te.compute((n, i64(n_head)), lambda t, h: h.astype("int32"), name="ids")
    return func([ids])


def _head_matmul(fc: FunctionContext, node: Node) -> list[Any]:
    x, w = node.inputs
    qtype, (n_head, n, k), arrays = weight_args(fc, w)
    t = fc.dim(x.shape[0])
    ids = fc.call_temp(KK.OpKernel("head_ids", n_head, ()), lambda: head_ids(n_head), [],
                       [([t, i64(n_head)], "int32")], f"{node.outputs[0].name}_ids")[0]
    key = KK.ExpertMatmul(qtype, n_head, n, k, n_head, True)
    return fc.call(key, lambda: qmatmul_experts(qtype, n_head, n, k, n_head, x_per_slot=True),
                   [fc.value(x), ids, *arrays], node.outputs, node.outputs[0].name)


LATENT_LOWERING: dict[str, Callable[[FunctionContext, Node], list[Any]]] = {
    "head_matmul": _head_matmul,
}
