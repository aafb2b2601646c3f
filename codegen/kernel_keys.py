"""What a compiled kernel is specialised on, one frozen record per kernel family.

Lowering makes a key for every kernel it calls; equal keys share one compiled kernel, the GPU side
picks its kernel by the key's type (`gpu.py`), tuning databases identify workloads by the key's
repr (`driver/tune/workloads.py`), and the kernel's name in the artifact is `k<index>_<kind>`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

from ggufc.ir.graph import Dim

Dims = tuple[Dim, ...]


@dataclass(frozen=True)
class KernelKey:
    """Base of every key. `pos_in_memory`: the cuda decode variant that reads the position from a
    device tensor instead of a scalar argument (so the step can be one CUDA graph)."""

    kind: ClassVar[str] = ""
    pos_in_memory: bool = field(default=False, kw_only=True)

    def reading_pos_from_memory(self) -> KernelKey:
        return dataclasses.replace(self, pos_in_memory=True)


@dataclass(frozen=True)
class OpKernel(KernelKey):
    """One IR op as one kernel: the op's attributes (or another static parameter) and the dims of
    its tensor inputs (`T` stays symbolic in prefill functions, 1 in decode)."""

    op: str
    attrs: Any
    dims: tuple[Dims, ...]

    @property
    def kind(self) -> str:  # type: ignore[override]  # a per-instance kind: the op's name
        return self.op


@dataclass(frozen=True)
class WeightMatmul(KernelKey):
    """x @ W.T for a weight in a block format (`gemv`: one token)."""

    kind: ClassVar[str] = "matmul"
    qtype: str
    n: int
    k: int
    gemv: bool


@dataclass(frozen=True)
class LaneDotMatmul(KernelKey):
    """x @ W.T for a float32 weight in llama.cpp's AVX2 orders (kernels/lane_dot_matmul.py);
    `one_token_order`: every row as a one-token call sums it."""

    kind: ClassVar[str] = "matmul_lanes"
    n: int
    k: int
    one_token_order: bool = False


@dataclass(frozen=True)
class WeightMatmulRows(KernelKey):
    """x @ W.T for a weight in a block format, every row summed as the one-token GEMV sums it
    (batched decode: each row equals that sequence's own step)."""

    kind: ClassVar[str] = "matmul_rows"
    qtype: str
    n: int
    k: int


@dataclass(frozen=True)
class Int8GemvGroup(KernelKey):
    """One decode kernel for the 8-bit GEMVs that read the same rounded input (a layer's q/k/v, its
    gate/up), with the input's RMSNorm or SwiGLU in its prologue and a residual add in its epilogue."""

    kind: ClassVar[str] = "matmul_int8"
    qtype: str
    ns: tuple[int, ...]
    k: int
    prologue: tuple[Any, ...]  # (), ("rms_norm", eps) or ("swiglu",)
    residual: bool


@dataclass(frozen=True)
class Int8Gemm(KernelKey):
    """A prompt's matmul on 8-bit dot products, rounding its input per token as llama.cpp does."""

    kind: ClassVar[str] = "matmul_int8_gemm"
    qtype: str
    n: int
    k: int
    tiles: bool = False  # on AMX tiles (codegen/cpu_int8/amx_gemm.py): float order not a one-token call's
    one_token_order: bool = False  # every row summed as a one-token call sums it (verify, batched decode)


@dataclass(frozen=True)
class BlockMinimumFix(KernelKey):
    """q8_1 inputs: each block's minimum term moved from sum(x) to the block sum s."""

    kind: ClassVar[str] = "q8_1_min_fix"
    n: int
    k: int


@dataclass(frozen=True)
class WeightEmbed(KernelKey):
    """Rows of an embedding table in a block format."""

    kind: ClassVar[str] = "embed"
    qtype: str
    rows: int
    k: int


@dataclass(frozen=True)
class ExpertMatmul(KernelKey):
    """The selected experts' matmuls: `slots` experts per token of `n_exp` (`per_slot`: each slot
    has its own input row, as the down projection does)."""

    kind: ClassVar[str] = "experts"
    qtype: str
    n_exp: int
    n: int
    k: int
    slots: int
    per_slot: bool


@dataclass(frozen=True)
class Int8ExpertMatmul(KernelKey):
    """The selected experts' matmuls on 8-bit dot products, rounding their input rows as
    llama.cpp's mul_mat_id does (q8_K) and grouping the rows by expert."""

    kind: ClassVar[str] = "experts_int8"
    qtype: str
    n_exp: int
    n: int
    k: int
    slots: int
    per_slot: bool
    one_token_order: bool = False  # every row as a one-token call sums it (verify, batched decode)


@dataclass(frozen=True)
class CacheWrite(KernelKey):
    """A call's rows written into a cache at the position."""

    kind: ClassVar[str] = "cache_write"
    cache_shape: tuple[int, ...]
    x_dims: Dims
    dtype: str


@dataclass(frozen=True)
class CausalConv(KernelKey):
    """The short depthwise causal convolution with its carried state."""

    kind: ClassVar[str] = "ssm_conv"
    channels: int
    width: int
    dilation: int


@dataclass(frozen=True)
class DeltaNetScan(KernelKey):
    """The gated delta rule over a call's tokens, per head, carrying the state."""

    kind: ClassVar[str] = "gated_delta_net"
    hv: int
    dv: int
    dk: int
    hk: int
    attrs: Any


@dataclass(frozen=True)
class LightningScan(KernelKey):
    """Lightning attention over a call's tokens (one block), per head, carrying the state."""

    kind: ClassVar[str] = "lightning_attention"
    h: int
    dk: int
    dv: int
    attrs: Any


@dataclass(frozen=True)
class IndexerTopK(KernelKey):
    """The indexer's top-k cells per query (`blocks`: score columns, `cells`: selectable cells)."""

    kind: ClassVar[str] = "indexer_topk"
    attrs: Any
    blocks: int
    cells: int


@dataclass(frozen=True)
class NgramHash(KernelKey):
    """The n-gram embedding rows of a call's tokens, from the token history of `cells` positions."""

    kind: ClassVar[str] = "ple_hash"
    attrs: Any
    cells: int
