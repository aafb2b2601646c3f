"""Quantised GGUF weights in TVM kernels: load-time repack, numpy reference decode, CPU kernels.

Weights stay in GGUF block format: `repack` only de-interleaves each block's fields into separate
dense arrays (same bytes; Q4_K/Q5_K's packed 6-bit scales become one byte each: +2-3 %), because
TVM buffers are dense typed arrays and an 18/34/144-byte block stride leaves the fields misaligned.
Kernels decode those arrays in registers. Kernel layout for a row-major `[..., N, K]` tensor
(`...` = leading dims such as MoE experts, written as `N` below):

    F32/F16   w f32/f16 [N, K]                 BF16  w uint16 [N, K] (raw bits)
    Q8_0      d f16 [N, K/32], qs int8 [N, K/32, 32]
    Q4_0      d f16 [N, K/32], qs uint8 [N, K/32, 16]             (+ m f16 [N, K/32] for Q4_1)
    Q5_0      d, qh uint32 [N, K/32], qs uint8 [N, K/32, 16]      (+ m for Q5_1, order d m qh qs)
    Q4_K      d, dmin f16 [N, K/256], sc, mn uint8 [N, K/32], qs uint8 [N, K/64, 32]
    Q5_K      as Q4_K plus qh uint8 [N, K/256, 32] before qs
    Q6_K      ql uint8 [N, K/128, 64], qh uint8 [N, K/128, 32], sc int8 [N, K/16], d f16 [N, K/256]
    Q2_K      sc uint8 [N, K/16], qs uint8 [N, K/128, 32], d, dmin f16 [N, K/256]
    Q3_K      hmask uint8 [N, K/256, 32], qs uint8 [N, K/128, 32], scales uint8 [N, K/256, 12], d f16
    IQ4_NL    d f16 [N, K/32], qs uint8 [N, K/32, 16]             (MXFP4: e uint8 [N, K/32] for d)
    IQ4_XS    d f16, sh uint16 [N, K/256], sl uint8 [N, K/256, 4], qs uint8 [N, K/32, 16]

Every format is described to the kernels by one geometry: the K axis of a row is cut into groups
of `G = planes * lanes` elements, and element `g*G + h*lanes + p` (group g, plane h, position p)
is decoded from bytes indexed by `p`, so a vector over `p` reads contiguous bytes and each plane
(e.g. the low/high nibble) is a *constant* shift once the plane loop is unrolled: the
"split-nibble" form of the TVM notes, 5-7x faster than a variable shift on CPU.

The modules: `format_spec` (how a format is described: fields, geometry, shared helpers),
`float_formats`, `block32_formats`, `kquant_formats`, `lookup_formats` (each format's split,
numpy reference and decode), `table` (the formats by GGUF name), `layout` (load time: kernel
layout, repack, reference decode), `compute` (TE compute of the matmuls), `cpu_schedules` (their
CPU schedules and the scheduled kernels the lowering asks for).
"""
