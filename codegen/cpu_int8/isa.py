"""The x86 instruction sets of the 8-bit kernels: one table row each, holding the steps that differ.

Every 8-bit kernel of this package (block32.py, kquant.py, kquant_lowbit.py, experts.py) is written
once; what changes with the CPU is

  - how a u8 x s8 dot product of four values reaches an int32 lane (`dot4`): `vpdpbusd` with VNNI
    (AVX512-VNNI+VL, or AVX-VNNI's VEX form: LLVM encodes the same intrinsic as AVX-VNNI where
    AVX-512 is missing, as clang's _mm256_dpbusd_avx_epi32), else AVX2's `vpmaddubsw` (adjacent
    products summed to int16, SATURATING) and `vpmaddwd` by ones, as llama.cpp's
    mul_sum_us8_pairs_float;
  - how int16 pairs times int16 scales reach an int32 lane (`pair_dot`): `vpdpwssds`, or `vpmaddwd`
    and an add;
  - Q8_0's signed weights (`q8_dot`): with VNNI, the byte's sign bit flipped (q + 128, unsigned)
    and -128 times the lane's activation sum as the lane's start; on AVX2, llama.cpp's sign trick
    (|q| unsigned, the activation's sign flipped where q < 0), since q + 128 would saturate
    vpmaddubsw (2 * 255 * 127 > 32767);
  - whether 512-bit token-pair GEMMs exist (`wide`), and AMX tiles (`tiles`);
  - whether llama.cpp's build for the CPU repacks a Q4_K weight of n % 8 == 0 rows 8x8 and
    multiplies it in the repacked GEMV's and GEMM's float order (`repacks_q4k`): its AVX2,
    AVX-VNNI and AVX-512 builds do (the AVX-512 GEMM takes two 8-row groups per register, lane by
    lane the same steps; its GEMV is the AVX2 one), so those artifacts store such weights 8 rows
    side by side (q4k_interleaved.py); on AMX CPUs Q4_K prompts go to tiles;
  - whether the 256-bit Q4_K/Q6_K prompt GEMMs unpack a row group's codes and scales once, before
    its token tiles (`unpacked`): without VNNI every 32-value product costs three vector
    instructions (vpmaddubsw, vpmaddwd, vpaddd) on 16 registers, and the nibble masks, shifts and
    scale broadcasts each tile redid came on top (benchmarks/kquant_int8.py).

The integer lane sums are exact in every row of the table, so the float steps after them, and
the results, are the same bit for bit: llama.cpp's AVX2 order, as in its AVX2, AVX-VNNI and
AVX512-VNNI builds of mul_sum_i8_pairs_float.

vpmaddubsw cannot saturate here: an int16 pair is c0 a0 + c1 a1 with activation codes |a| <= 127
(q8_0/q8_1: rint(127 x / amax); q8_K: rint(-127 x / x_max), capped at 127) and weight codes
c <= 31 (Q4/Q5 nibbles with their fifth bit, the K-quants' codes <= 63: 2 * 63 * 127 = 16002), or
Q8_0's |q| <= 128 by the sign trick: 2 * 128 * 127 = 32512 <= 32767.
"""

from __future__ import annotations

from dataclasses import dataclass

import tvm
from tvm import tirx
from tvm.script import tirx as T

# the saturating form: no sum of these kernels comes near int32's limits, so its values are the
# plain one's, and LLVM keeps it one instruction where its machine combiner splits the plain
# vpdpwssd of an accumulator chain into vpmaddwd + vpaddd (Q4_K GEMV 1.08-1.19x hot)
VPDPWSSDS = "llvm.x86.avx512.vpdpwssds.256"
PMADDUBSW = "llvm.x86.avx2.pmadd.ub.sw"
PMADDWD = "llvm.x86.avx2.pmadd.wd"
PSIGNB = "llvm.x86.avx2.psign.b"


def _bytes(v: tirx.PrimExpr) -> tirx.PrimExpr:
    """A 256-bit vector as int8x32 (the intrinsics' operand type; an int8x32 stays itself)."""
    return T.reinterpret("int8x32", v)


def per_zmm(intrin: str, out: str, *args: tuple[tirx.PrimExpr, int]) -> tirx.PrimExpr:
    """A 512-bit intrinsic over 1024-bit operands `(vector, lanes)`: once per half, the halves
    joined into one `out` vector (LLVM keeps them two zmm registers)."""
    kind, lanes = out.split("x")
    half = int(lanes) // 2
    parts = [T.call_llvm_pure_intrin(f"{kind}x{half}", intrin,
                                     *(T.Shuffle([v], list(range(h * n // 2, h * n // 2 + n // 2))) for v, n in args))
             for h in range(2)]
    return T.Shuffle(parts, list(range(int(lanes))))


def vpdpbusd(acc: tirx.PrimExpr, codes: tirx.PrimExpr, acts: tirx.PrimExpr, lanes: int = 8) -> tirx.PrimExpr:
    """acc + in int32 lane j the sum of products 4j..4j+3 of u8 `codes` and s8 `acts`, over 8 lanes
    (a ymm register), 16 (a zmm) or 32 (two zmm)."""
    if lanes == 32:
        return per_zmm("llvm.x86.avx512.vpdpbusd.512", "int32x32", (acc, 32),
                       (T.reinterpret("int8x128", codes), 128), (T.reinterpret("int8x128", acts), 128))
    return T.call_llvm_pure_intrin(f"int32x{lanes}", f"llvm.x86.avx512.vpdpbusd.{32 * lanes}", acc,
                                   T.reinterpret(f"int8x{4 * lanes}", codes), T.reinterpret(f"int8x{4 * lanes}", acts))


def pmaddwd(a: tirx.PrimExpr, b: tirx.PrimExpr, lanes: int = 8) -> tirx.PrimExpr:
    """int16 a . b in adjacent pairs, one int32 lane each, over 8, 16 or 32 lanes (vpmaddwd)."""
    if lanes == 32:
        return per_zmm("llvm.x86.avx512.pmaddw.d.512", "int32x32", (a, 64), (b, 64))
    intrin = PMADDWD if lanes == 8 else "llvm.x86.avx512.pmaddw.d.512"
    return T.call_llvm_pure_intrin(f"int32x{lanes}", intrin, a, b)


def pairs16(codes: tirx.PrimExpr, acts: tirx.PrimExpr, lanes: int = 16) -> tirx.PrimExpr:
    """u8 codes x s8 activations, adjacent products summed to int16 lanes, 16 (ymm) or 32 (zmm)
    (vpmaddubsw, saturating: the callers' codes keep every sum inside int16, module docstring)."""
    if lanes == 32:
        return T.call_llvm_pure_intrin("int16x32", "llvm.x86.avx512.pmaddubs.w.512", T.reinterpret("int8x64", codes),
                                       T.reinterpret("int8x64", acts))
    return T.call_llvm_pure_intrin("int16x16", PMADDUBSW, _bytes(codes), _bytes(acts))


@dataclass(frozen=True)
class Int8Isa:
    """One instruction set's row of the table (module docstring)."""

    name: str
    vnni: bool  # 256-bit vpdpbusd / vpdpwssds
    wide: bool  # 512-bit vectors with VNNI: the token-pair prompt GEMMs
    tiles: bool  # AMX-INT8 tiles for prompt GEMMs
    repacks_q4k: bool  # Q4_K of n % 8 == 0 rows in llama.cpp's repacked order (and layout)
    unpacked: bool = False  # 256-bit K-quant prompt GEMMs read codes unpacked once per row group

    def dot4(self, acc: tirx.PrimExpr, codes: tirx.PrimExpr, acts: tirx.PrimExpr) -> tirx.PrimExpr:
        """acc (int32x8) + in lane j the sum of products 4j..4j+3 of u8 `codes` and s8 `acts`."""
        if self.vnni:
            return vpdpbusd(acc, codes, acts)
        return acc + pmaddwd(pairs16(codes, acts), T.broadcast(T.int16(1), 16))

    def pair_dot(self, acc: tirx.PrimExpr, pairs: tirx.PrimExpr, scales: tirx.PrimExpr) -> tirx.PrimExpr:
        """acc (int32x8) + in lane j pairs[2j] scales[2j] + pairs[2j+1] scales[2j+1] (int16 operands)."""
        if self.vnni:
            return T.call_llvm_pure_intrin("int32x8", VPDPWSSDS, acc, pairs, scales)
        return acc + T.call_llvm_pure_intrin("int32x8", PMADDWD, pairs, scales)

    @property
    def q8_offset(self) -> int:
        """What q8_dot's lane start must hold, times minus the lane's activation sum."""
        return 128 if self.vnni else 0

    def q8_dot(self, start: tirx.PrimExpr, weights: tirx.PrimExpr, acts: tirx.PrimExpr) -> tirx.PrimExpr:
        """Q8_0: start + in lane j the sum of products 4j..4j+3 of s8 `weights` and s8 `acts`,
        where start holds -q8_offset times the lane's activation sum."""
        w = weights
        if self.vnni:  # q + 128: the byte's sign bit flipped
            flipped = T.bitwise_xor(T.reinterpret("int32x8", w), T.broadcast(T.int32(-2139062144), 8))  # 0x80808080
            return self.dot4(start, flipped, acts)
        # llama.cpp's sign trick: |q| (-128 wraps to 0x80, i.e. 128 unsigned) times sign(q) a
        magnitude = T.max(w, T.broadcast(T.int8(0), 32) - w)
        return self.dot4(start, magnitude, T.call_llvm_pure_intrin("int8x32", PSIGNB, _bytes(acts), w))


AVX2 = Int8Isa("avx2", vnni=False, wide=False, tiles=False, repacks_q4k=True,  # Haswell .. Zen 3, client to 11th gen
               unpacked=True)
AVX_VNNI = Int8Isa("avx-vnni", vnni=True, wide=False, tiles=False, repacks_q4k=True)  # Alder Lake and later clients
AVX512_VNNI = Int8Isa("avx512-vnni", vnni=True, wide=True, tiles=False, repacks_q4k=True)  # Cascade Lake .. Zen 5
AMX = Int8Isa("amx", vnni=True, wide=True, tiles=True, repacks_q4k=False)  # Sapphire Rapids and later
ISAS = (AVX2, AVX_VNNI, AVX512_VNNI, AMX)


def int8_isa(target: tvm.target.Target) -> Int8Isa | None:
    """The table row of `target`'s CPU; None where it has no AVX2 and FMA (no 8-bit kernels)."""
    if target.kind.name != "llvm":
        return None
    has = lambda feature: bool(tvm.target.codegen.target_has_features(feature, target))  # noqa: E731
    if not (has("avx2") and has("fma")):
        return None
    wide = has("avx512vnni") and has("avx512bw") and has("avx512vl")
    if wide and has("amx-int8") and has("amx-tile"):
        return AMX
    if wide:
        return AVX512_VNNI
    return AVX_VNNI if has("avxvnni") or (has("avx512vnni") and has("avx512vl")) else AVX2
