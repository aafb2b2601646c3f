"""A numpy model of llama.cpp's CPU float order (its x86 AVX2 + FMA build, the one the goldens
come from), operation by operation, to test the CPU kernels bit for bit.

Each function names the ggml routine it follows. The model itself was checked against
llama.cpp's own intermediate tensors on SmolLM2 (llama-cpp-python 0.3.36, eval callback):
every matmul, rope, score, softmax and attention output identical.
"""

from __future__ import annotations

import numpy as np

F32 = np.float32


def fma(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 fused multiply-add, correctly rounded: a*b is exact in float64; where the float64
    sum lands exactly between two float32 values, its rounding error (TwoSum) picks the side."""
    a64, b64, c64 = (np.asarray(v, F32).astype(np.float64) for v in (a, b, c))
    p = a64 * b64
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + c64
        bp = s - c64
        err = (p - bp) + (c64 - (s - bp))
        out = s.astype(F32)
        above = out.astype(np.float64) >= s
        lo = np.where(above, np.nextafter(out, F32(-np.inf)), out)
        hi = np.where(above, out, np.nextafter(out, F32(np.inf)))
        tie = (lo.astype(np.float64) + hi.astype(np.float64)) / 2 == s
        out = np.where(tie & (err > 0), hi, np.where(tie & (err < 0), lo, out))
    return np.asarray(out, F32)


def hsum_float_8(v: np.ndarray) -> np.ndarray:
    """hsum_float_8 / tinyBLAS hsum(__m256) over the last axis (8): ((0+4)+(2+6)) + ((1+5)+(3+7))."""
    r = (v[..., 4:8] + v[..., 0:4]).astype(F32)
    r2 = (r[..., 0:2] + r[..., 2:4]).astype(F32)
    return (r2[..., 0] + r2[..., 1]).astype(F32)


def quantize_q8(x: np.ndarray, with_sums: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """quantize_row_q8_0 / q8_1 (AVX): codes [.., nb, 32] int32, d (f16 as f32), s = f16(d * sum)."""
    xb = np.asarray(x, F32).reshape(*np.shape(x)[:-1], -1, 32)
    amax = np.abs(xb).max(-1)
    d = (amax / F32(127)).astype(F32)
    with np.errstate(divide="ignore"):
        inv = np.where(amax != 0, F32(127) / amax, F32(0)).astype(F32)
    q = np.rint((xb * inv[..., None]).astype(F32)).astype(np.int32)
    s = (d * q.sum(-1).astype(F32)).astype(F32).astype(np.float16).astype(F32) if with_sums else np.zeros_like(d)
    return q, d.astype(np.float16).astype(F32), s


def weight_blocks(qtype: str, raw: np.ndarray, n: int, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """GGUF blocks of a Q4_0/Q4_1/Q5_0/Q5_1/Q8_0 [n, k] weight -> (d, m, codes [n, nb, 32] in value
    order, Q4_0's and Q5_0's offsets applied)."""
    size = {"Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q5_1": 24, "Q8_0": 34}[qtype]
    blk = np.asarray(raw).view(np.uint8).reshape(n, k // 32, size)
    d = blk[..., 0:2].copy().view(np.float16)[..., 0].astype(F32)
    if qtype == "Q8_0":
        return d, np.zeros_like(d), blk[..., 2:].copy().view(np.int8).astype(np.int32)
    qs = blk[..., -16:]
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.int32)
    if qtype in ("Q5_0", "Q5_1"):  # bit v of the little-endian qh word: the fifth bit of code v
        qh = blk[..., size - 20:size - 16].copy().view(np.uint32).astype(np.int64)
        codes = codes | (((qh >> np.arange(32)) & 1) << 4).astype(np.int32)
    if qtype in ("Q4_0", "Q5_0"):
        return d, np.zeros_like(d), codes - (8 if qtype == "Q4_0" else 16)
    return d, blk[..., 2:4].copy().view(np.float16)[..., 0].astype(F32), codes


def matmul_q(qtype: str, raw: np.ndarray, n: int, k: int, x: np.ndarray) -> np.ndarray:
    """x [T, K] @ W.T as ggml_vec_dot_{q4_0,q4_1,q5_0,q5_1,q8_0}_q8_{0,1} (and tinyBLAS, same order):
    per block acc_j = fma(d_w d_a, lane j's integer dot, acc_j), then hsum_float_8 (+ sum_b m_w s_b)."""
    dw, mw, qw = weight_blocks(qtype, raw, n, k)
    with_min = qtype in ("Q4_1", "Q5_1")
    qa, da, sa = quantize_q8(x, with_sums=with_min)
    t, nb = qa.shape[0], k // 32
    lanes = np.einsum("nbjc,tbjc->tnbj", qw.reshape(n, nb, 8, 4), qa.reshape(t, nb, 8, 4)).astype(F32)
    acc = np.zeros((t, n, 8), F32)
    summs = np.zeros((t, n), F32)
    for b in range(nb):
        scale = (dw[None, :, b] * da[:, None, b]).astype(F32)
        acc = fma(np.broadcast_to(scale[..., None], acc.shape), lanes[:, :, b], acc)
        summs = (summs + (mw[None, :, b] * sa[:, None, b]).astype(F32)).astype(F32)
    out = hsum_float_8(acc)
    return (out + summs).astype(F32) if with_min else out


def expf(x: np.ndarray) -> np.ndarray:
    """ggml_v_expf, AVX2 + FMA form."""
    x = np.asarray(x, F32)

    def c(v: str) -> np.ndarray:
        return np.full_like(x, F32(float.fromhex(v)))

    with np.errstate(over="ignore", invalid="ignore"):
        r = c("0x1.8p23")
        z = fma(x, c("0x1.715476p+0"), r)
        n = (z - r).astype(F32)
        b = fma(-n, c("0x1.7f7d1cp-20"), fma(-n, c("0x1.62e4p-1"), x))
        u = (b * b).astype(F32)
        j = fma(fma(fma(c("0x1.0e4020p-7"), b, c("0x1.573e2ep-5")), u, fma(c("0x1.555e66p-3"), b, c("0x1.fffdb6p-2"))),
                u, (c("0x1.ffffecp-1") * b).astype(F32))
        e = z.view(np.int32) << 23
        k = (e + np.int32(0x3F800000)).view(F32)
        g = np.where(n <= 0, np.int32(-0x7E000000), np.int32(0))
        s1 = (g + np.int32(0x7F000000)).view(F32)
        s2 = (e - g).view(F32)
        out = np.where(np.abs(n) > 192, (s1 * s1).astype(F32),
                       np.where(np.abs(n) > 126, (fma(s2, j, s2) * s1).astype(F32), fma(k, j, k)))
    return np.asarray(out, F32)


def vec_dot_f32(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """ggml_vec_dot_f32 (AVX) over the last axis (a multiple of 32, zero-padded by the caller):
    4 x 8 accumulators per 32 values, (0+2) + (1+3), then 4 + 4 and two pairwise adds."""
    k = a.shape[-1]
    s = np.zeros(np.broadcast_shapes(a.shape, b.shape)[:-1] + (4, 8), F32)
    for i in range(k // 32):
        s = fma(a[..., i * 32:(i + 1) * 32].reshape(*a.shape[:-1], 4, 8),
                b[..., i * 32:(i + 1) * 32].reshape(*b.shape[:-1], 4, 8), s)
    x = ((s[..., 0, :] + s[..., 2, :]).astype(F32) + (s[..., 1, :] + s[..., 3, :]).astype(F32)).astype(F32)
    t0 = (x[..., 0:4] + x[..., 4:8]).astype(F32)
    return ((t0[..., 0] + t0[..., 1]).astype(F32) + (t0[..., 2] + t0[..., 3]).astype(F32)).astype(F32)


def tinyblas_dot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """tinyBLAS<8, __m256> over the last axis (a multiple of 8): lane i takes values i mod 8."""
    k = a.shape[-1]
    acc = np.zeros(np.broadcast_shapes(a.shape, b.shape)[:-1] + (8,), F32)
    for i in range(k // 8):
        acc = fma(a[..., i * 8:(i + 1) * 8], b[..., i * 8:(i + 1) * 8], acc)
    return hsum_float_8(acc)


def soft_max(scores: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """ggml_compute_forward_soft_max_f32 (AVX2) over the last axis (a multiple of 8) with the cells
    past `visible` masked: exp in 8-chunks summed by hsum_float_8 into a float64 total."""
    masked = np.where(np.arange(scores.shape[-1]) < visible[..., None], scores, F32(-np.inf)).astype(F32)
    e = expf((masked - masked.max(-1, keepdims=True)).astype(F32))
    total = np.zeros(scores.shape[:-1], np.float64)
    for i in range(scores.shape[-1] // 8):
        total = total + hsum_float_8(e[..., i * 8:(i + 1) * 8]).astype(np.float64)
    return (e * (1.0 / total).astype(F32)[..., None]).astype(F32)


def attention(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, pos: int, scale: float) -> np.ndarray:
    """llama.cpp's non-flash attention over an f32 cache for a ubatch of T tokens at `pos`:
    KQ by ggml_vec_dot_f32, scaled softmax, KQV by tinyBLAS (T >= 2) or ggml_vec_dot_f32 (T = 1)."""
    t, h, d = q.shape
    group = h // kc.shape[1]
    cells = -(-(pos + t) // 32) * 32  # llama.cpp pads the cache view; padded cells add nothing
    k = np.zeros((cells, h, d), F32)
    v = np.zeros((cells, h, d), F32)
    k[:pos + t] = np.repeat(kc[:pos + t], group, axis=1)
    v[:pos + t] = np.repeat(vc[:pos + t], group, axis=1)
    kq = vec_dot_f32(k.transpose(1, 0, 2)[:, None], q.transpose(1, 0, 2)[:, :, None])  # [H, T, cells]
    p = soft_max((kq * F32(scale)).astype(F32), np.broadcast_to((pos + np.arange(t) + 1)[None, :], (h, t)))
    vt = v.transpose(1, 2, 0)[:, None]  # [H, 1, D, cells]
    dot = vec_dot_f32 if t == 1 else tinyblas_dot
    return dot(vt, p[:, :, None, :]).transpose(1, 0, 2)  # [T, H, D]


def quantize_q8_K(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """quantize_row_q8_K: codes [.., nb, 256] int32 and d [.., nb] (f32) per 256 values; the first
    value of largest magnitude sets iscale = -127 / max."""
    xb = np.asarray(x, F32).reshape(*np.shape(x)[:-1], -1, 256)
    first = np.argmax(np.abs(xb), axis=-1)[..., None]
    peak = np.take_along_axis(xb, first, axis=-1)[..., 0]
    with np.errstate(divide="ignore"):
        iscale = np.where(peak != 0, F32(-127) / peak, F32(0)).astype(F32)
        d = np.where(peak != 0, F32(1) / iscale, F32(0)).astype(F32)
    q = np.minimum(np.rint((xb * iscale[..., None]).astype(F32)), F32(127)).astype(np.int32)
    return q, d


def _scale_min_k4(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """get_scale_min_k4 for j = 0..7 of 12-byte packed fields [.., 12] -> (sc, mn) [.., 8] int32."""
    q = scales.astype(np.int32)
    sc = np.concatenate([q[..., 0:4] & 63, (q[..., 8:12] & 0xF) | ((q[..., 0:4] >> 6) << 4)], axis=-1)
    mn = np.concatenate([q[..., 4:8] & 63, (q[..., 8:12] >> 4) | ((q[..., 4:8] >> 6) << 4)], axis=-1)
    return sc, mn


def _low_bit_blocks(qtype: str, blk: np.ndarray) -> dict[str, np.ndarray]:
    """Q2_K / Q3_K blocks [n, nb, size]: element 128a + 32c + l takes bits 2c..2c+1 of qs[32a + l]
    (Q3_K: minus 4 unless bit 4a + c of hmask[l] is set), sub-block (16 values) 8a + 2c + l // 16."""
    f16 = lambda at: blk[..., at:at + 2].copy().view(np.float16)[..., 0].astype(F32)  # noqa: E731
    at = 16 if qtype == "Q2_K" else 32
    qs = blk[..., at:at + 64].astype(np.int32).reshape(*blk.shape[:2], 2, 1, 32)
    codes = ((qs >> (2 * np.arange(4)[:, None])) & 3).reshape(*blk.shape[:2], 256)
    if qtype == "Q2_K":
        sc = blk[..., 0:16].astype(np.int32)
        return {"d": f16(80), "dmin": f16(82), "codes": codes, "scales": np.repeat(sc & 15, 16, axis=-1),
                "mn16": sc >> 4}
    hm = blk[..., 0:32].astype(np.int32)
    high = np.stack([(hm >> b) & 1 for b in range(8)], axis=-2).reshape(*blk.shape[:2], 256)
    aux = blk[..., 96:108].astype(np.int32)
    low = np.concatenate([aux[..., 0:8] & 15, aux[..., 0:8] >> 4], axis=-1)
    top = np.concatenate([(aux[..., 8:12] >> (2 * s)) & 3 for s in range(4)], axis=-1)
    return {"d": f16(108), "codes": codes - 4 * (1 - high), "scales": np.repeat((low | top << 4) - 32, 16, axis=-1)}


def k_blocks(qtype: str, raw: np.ndarray, n: int, k: int) -> dict[str, np.ndarray]:
    """GGUF blocks of a Q2_K..Q6_K [n, k] weight -> d, dmin [n, nb] f32, codes [n, nb, 256] int32
    in value order (Q6_K's with its -32, Q3_K's with its -4), the scale of each value's sub-block
    [n, nb, 256], Q4_K/Q5_K's sub-block minimums mn [n, nb, 8] and Q2_K's mn16 [n, nb, 16]."""
    size = {"Q2_K": 84, "Q3_K": 110, "Q4_K": 144, "Q5_K": 176, "Q6_K": 210}[qtype]
    blk = np.asarray(raw).view(np.uint8).reshape(n, k // 256, size)
    if qtype in ("Q2_K", "Q3_K"):
        return _low_bit_blocks(qtype, blk)
    f16 = lambda at: blk[..., at:at + 2].copy().view(np.float16)[..., 0].astype(F32)  # noqa: E731
    if qtype == "Q6_K":
        ql, qh = blk[..., 0:128].astype(np.int32), blk[..., 128:192].astype(np.int32)
        codes = np.empty((n, k // 256, 256), np.int32)
        for a in range(2):
            for c in range(4):
                low = (ql[..., 64 * a + 32 * (c % 2):64 * a + 32 * (c % 2) + 32] >> (4 * (c // 2))) & 15
                high = (qh[..., 32 * a:32 * a + 32] >> (2 * c)) & 3
                codes[..., 128 * a + 32 * c:128 * a + 32 * c + 32] = (low | high << 4) - 32
        scales = np.repeat(blk[..., 192:208].view(np.int8).astype(np.int32), 16, axis=-1)
        return {"d": f16(208), "codes": codes, "scales": scales}
    qs = blk[..., size - 128:].astype(np.int32).reshape(n, k // 256, 4, 32)
    codes = np.concatenate([qs & 15, qs >> 4], axis=-1).reshape(n, k // 256, 256)
    if qtype == "Q5_K":
        qh = blk[..., 16:48].astype(np.int32)
        codes = codes | np.concatenate([(qh >> b) & 1 for b in range(8)], axis=-1) << 4
    sc, mn = _scale_min_k4(blk[..., 4:16])
    return {"d": f16(0), "dmin": f16(2), "codes": codes, "scales": np.repeat(sc, 32, axis=-1), "mn": mn}


def matmul_k(qtype: str, raw: np.ndarray, n: int, k: int, x: np.ndarray,
             q6_offset_in_products: bool = False) -> np.ndarray:
    """x [T, K] @ W.T as ggml_vec_dot_{q4,q5,q6}_K_q8_K (AVX2): per super-block, the integer lane
    sums sumi_j (lane j: values 4j..4j+3 of every 32-value run, times their sub-block scales;
    Q6_K's offset 32 taken from the q8_K block sums in lanes of their own: q6_K_block_sum_lanes,
    or with `q6_offset_in_products` in the products' lanes, an order llama.cpp does not take),
    acc_j = fma(d_a d_w, sumi_j, acc_j), then hsum_float_8; plus the minimum terms (Q4_K: four
    lanes prod_p = sum of two sub-blocks' mn * code sum, m_p = fma(-d_a dmin, prod_p, m_p), added
    as (m0 + m2) + (m1 + m3); Q5_K: m = m + (-d_a dmin) * sum_p prod_p). Q2_K and Q3_K as Q6_K
    (ggml_vec_dot_q{2,3}_K_q8_K), Q2_K's minimums first into the same lanes: lane p gains
    fma(-d_a dmin, mn_2p B_2p + mn_2p+1 B_2p+1, .) (B_s: the code sum of 16-value sub-block s)."""
    w = k_blocks(qtype, raw, n, k)
    qa, da = quantize_q8_K(x)
    t, nb = qa.shape[0], k // 256
    if qtype == "Q6_K" and not q6_offset_in_products:
        sumi = q6_K_block_sum_lanes(w, qa).astype(F32)
    else:
        prods = np.einsum("nbv,tbv->tnbv", w["codes"] * w["scales"], qa)  # exact in int64
        sumi = prods.reshape(t, n, nb, 8, 8, 4).sum(axis=(3, 5)).astype(F32)  # [t, n, nb, lane]
    acc = np.zeros((t, n, 8), F32)
    accm = np.zeros((t, n, 4), F32)
    summs = np.zeros((t, n), F32)
    for i in range(nb):
        if qtype == "Q2_K":
            sums16 = qa[:, i].reshape(t, 16, 16).sum(-1)  # [t, 16]
            prod16 = (w["mn16"][None, :, i] * sums16[:, None]).reshape(t, n, 8, 2).sum(-1).astype(F32)
            dmin16 = (-da[:, None, i] * w["dmin"][None, :, i]).astype(F32)
            acc = fma(np.broadcast_to(dmin16[..., None], acc.shape), prod16, acc)
        scale = (da[:, None, i] * w["d"][None, :, i]).astype(F32)
        acc = fma(np.broadcast_to(scale[..., None], acc.shape), sumi[:, :, i], acc)
        if qtype in ("Q2_K", "Q3_K", "Q6_K"):
            continue
        sub_sums = qa[:, i].reshape(t, 8, 32).sum(-1)  # [t, 8]
        prod = (w["mn"][None, :, i] * sub_sums[:, None]).reshape(t, n, 4, 2).sum(-1)
        dmin = (-da[:, None, i] * w["dmin"][None, :, i]).astype(F32)
        if qtype == "Q4_K":
            accm = fma(np.broadcast_to(dmin[..., None], accm.shape), prod.astype(F32), accm)
        else:
            summs = (summs + (dmin * prod.sum(-1).astype(F32)).astype(F32)).astype(F32)
    out = hsum_float_8(acc)
    if qtype == "Q4_K":
        mins = ((accm[..., 0] + accm[..., 2]).astype(F32) + (accm[..., 1] + accm[..., 3]).astype(F32)).astype(F32)
        return (out + mins).astype(F32)
    return (out + summs).astype(F32) if qtype == "Q5_K" else out


def matmul_k_tiled(qtype: str, raw: np.ndarray, n: int, k: int, x: np.ndarray) -> np.ndarray:
    """x [T, K] @ W.T as the AVX2 build's tiled K-quant GEMM (ggml-cpu/tiled, taken by Q4_K/Q5_K/Q6_K
    weights outside the repack buffer when the batch has >= 8 rows): per super-block i an exact
    integer sum s_i over its 256 values (scales applied, Q6_K's -32 included), then
    res = d_w * float(s_i) (Q4_K/Q5_K: res = fma(-dmin_w, float(sum_s mn_s A_s), res)) and
    y = fma(res, d_a, y): one rounding of the weight scale's product before the activation scale."""
    w = k_blocks(qtype, raw, n, k)
    qa, da = quantize_q8_K(x)
    t, nb = qa.shape[0], k // 256
    sums = np.einsum("nbv,tbv->tnb", (w["codes"] * w["scales"]).astype(np.int64), qa.astype(np.int64))
    y = np.zeros((t, n), F32)
    for i in range(nb):
        res = (w["d"][None, :, i] * sums[:, :, i].astype(F32)).astype(F32)
        if "mn" in w:
            code_sums = qa[:, i].reshape(t, 8, 32).sum(-1)
            mins = np.einsum("ns,ts->tn", w["mn"][:, i], code_sums).astype(F32)
            res = fma(-np.broadcast_to(w["dmin"][None, :, i], res.shape), mins, res)
        y = fma(res, np.broadcast_to(da[:, None, i], res.shape), y)
    return y


def q6_K_block_sum_lanes(w: dict[str, np.ndarray], qa: np.ndarray) -> np.ndarray:
    """Q6_K's integer lane sums [T, N, K/256, 8] as llama.cpp 0.3.36's ggml_vec_dot_q6_K_q8_K
    (AVX2) forms them: the unsigned codes' products in the products' lanes (lane j: values
    4j..4j+3 of every 32-value run, times their scales), less lane j's share of the offset taken
    from the q8_K block sums, 32 (sc_2j B_2j + sc_2j+1 B_2j+1) (B_m: the code sum of 16-value
    sub-block m, so lane j holds values 32j..32j+31). Same total per super-block as the offset
    subtracted in the products' lanes, other lane sums."""
    t, n, nb = qa.shape[0], w["codes"].shape[0], qa.shape[1]
    products = np.einsum("nbv,tbv->tnbv", (w["codes"] + 32) * w["scales"], qa)
    lanes = products.reshape(t, n, nb, 8, 8, 4).sum(axis=(3, 5))  # exact
    block_sums = qa.reshape(t, nb, 16, 16).sum(-1)  # [t, nb, 16]
    scales16 = w["scales"][..., ::16]  # [n, nb, 16]
    return lanes - 32 * (scales16[None] * block_sums[:, None]).reshape(t, n, nb, 8, 2).sum(-1)


def matmul_q6_K_block_sums(raw: np.ndarray, n: int, k: int, x: np.ndarray) -> np.ndarray:
    """x [T, K] @ W.T as ggml_vec_dot_q6_K_q8_K (AVX2; llama.cpp's Q6_K calls of fewer than 8
    rows): matmul_k's Q6_K, named for the goldens that pin its lanes."""
    return matmul_k("Q6_K", raw, n, k, x)


GEMM_ROWS = 4  # tokens per block_q8_Kx4: a repacked matmul's GEMM takes T - T % 4 of them


def q4_K_repacked(n: int, isa_name: str) -> bool:
    """Whether llama.cpp's CPU backend repacks a Q4_K weight of n rows 8x8 (block_q4_Kx8,
    ggml_repack_get_optimal_repack_type: AVX2 and n % 8 == 0) in the build `isa_name` models: the
    AVX2, AVX-VNNI and AVX-512 builds (their repacked kernels take the same steps lane by lane);
    ggufc's AMX artifacts keep vec_dot's order."""
    return isa_name in ("avx2", "avx-vnni", "avx512-vnni") and n % 8 == 0


def matmul_q4_K_repacked(raw: np.ndarray, n: int, k: int, x: np.ndarray, gemm_rows: int | None = None) -> np.ndarray:
    """x [T, K] @ W.T of a Q4_K weight repacked 8x8, as forward_mul_mat of ggml's repack buffer:
    tokens 0 .. T - T % 4 through ggml_gemm_q4_K_8x8_q8_K, the rest through ggml_gemv_q4_K_8x8_q8_K
    (AVX2). Per row and token both keep one float accumulator for the scales and one for the
    minimums, each fed exact integer sums (int16 maddubs adds cannot overflow with 4-bit codes):

      GEMV, per super-block i:  acc = fma(float(sum_s sc_s (q . a)_s), d_w d_a, acc)
                                accm = fma(float(sum_s mn_s A_s), dmin_w d_a, accm)
      GEMM, per 64-value run g of each super-block: the same with s over sub-blocks 2g, 2g + 1

    then y = acc - accm (A_s: the code sum of sub-block s, d_a: the q8_K block's scale). `gemm_rows`:
    how many leading rows of x the GEMM takes when x is a selection of a batch's rows."""
    w = k_blocks("Q4_K", raw, n, k)
    qa, da = quantize_q8_K(x)
    t, nb = qa.shape[0], k // 256
    prods = np.einsum("nbv,tbv->tnbv", w["codes"] * w["scales"], qa)
    runs = prods.reshape(t, n, nb, 4, 64).sum(-1)  # [t, n, nb, run], exact
    sub_sums = qa.reshape(t, nb, 8, 32).sum(-1)  # [t, nb, 8]
    mins = (w["mn"][None] * sub_sums[:, None]).reshape(t, n, nb, 4, 2).sum(-1)
    d = (da[:, None, :] * w["d"][None]).astype(F32)  # [t, n, nb]
    dmin = (da[:, None, :] * w["dmin"][None]).astype(F32)
    gemm = np.arange(t) < (t - t % GEMM_ROWS if gemm_rows is None else gemm_rows)
    acc = np.zeros((t, n), F32)
    accm = np.zeros((t, n), F32)
    for i in range(nb):
        for g in range(4):  # the GEMM's steps
            acc_g = fma(runs[:, :, i, g].astype(F32), d[:, :, i], acc)
            accm_g = fma(mins[:, :, i, g].astype(F32), dmin[:, :, i], accm)
            acc = np.where(gemm[:, None], acc_g, acc)
            accm = np.where(gemm[:, None], accm_g, accm)
        acc_v = fma(runs[:, :, i].sum(-1).astype(F32), d[:, :, i], acc)  # the GEMV's step
        accm_v = fma(mins[:, :, i].sum(-1).astype(F32), dmin[:, :, i], accm)
        acc = np.where(gemm[:, None], acc, acc_v)
        accm = np.where(gemm[:, None], accm, accm_v)
    return (acc - accm).astype(F32)


TILED_ROWS = 8  # activation rows from which ggml-cpu takes its tiled K-quant GEMM (ggml_tiled_min_batch)


def matmul_k_for(isa_name: str, qtype: str, raw: np.ndarray, n: int, k: int, x: np.ndarray) -> np.ndarray:
    """matmul_k in the order llama.cpp's build for `isa_name` takes: Q4_K's repacked kernels where
    q4_K_repacked, the tiled GEMM at avx2 for a call of >= TILED_ROWS rows (Q5_K, Q6_K, and Q4_K
    not repacked), ggml_vec_dot_*_K_q8_K elsewhere."""
    if qtype == "Q4_K" and q4_K_repacked(n, isa_name):
        return matmul_q4_K_repacked(raw, n, k, x)
    if qtype in ("Q4_K", "Q5_K", "Q6_K") and isa_name == "avx2" and len(x) >= TILED_ROWS:
        return matmul_k_tiled(qtype, raw, n, k, x)
    return matmul_k(qtype, raw, n, k, x)
