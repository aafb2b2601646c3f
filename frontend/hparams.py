"""Typed access to GGUF hyper-parameter keys, with one-line errors naming the key."""

from __future__ import annotations

import builtins
import ctypes
import ctypes.util
import functools
from dataclasses import dataclass
from typing import Any

import numpy as np

from ggufc.messages import GgufcError


class ModelError(GgufcError, ValueError):
    """The model file is readable but not a valid model for ggufc (missing key, tensor, ...)."""


class Keys:
    """Reads `{arch}.<name>` keys; scalars are checked for type, arrays may be per layer."""

    def __init__(self, metadata: dict[str, Any], arch: str) -> None:
        self.metadata = metadata
        self.arch = arch

    def _full(self, name: str) -> str:
        return name if name.startswith(("general.", "tokenizer.")) else f"{self.arch}.{name}"

    def has(self, name: str) -> bool:
        return self._full(name) in self.metadata

    def raw(self, name: str, default: Any = None) -> Any:
        return self.metadata.get(self._full(name), default)

    def int(self, name: str, default: int | None = None) -> int:
        v = self.raw(name, default)
        if v is None:
            raise ModelError(f"missing required key {self._full(name)}")
        if isinstance(v, list):
            if not v or len(set(v)) != 1:
                raise ModelError(f"key {self._full(name)}: per-layer values are not supported here")
            v = v[0]
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
            raise ModelError(f"key {self._full(name)} must be an integer, got {type(v).__name__}")
        return int(v)

    def float(self, name: str, default: float | None = None) -> float:
        v = self.raw(name, default)
        if v is None:
            raise ModelError(f"missing required key {self._full(name)}")
        if isinstance(v, bool) or not isinstance(v, (int, float, np.floating, np.integer)):
            raise ModelError(f"key {self._full(name)} must be a number, got {type(v).__name__}")
        return float(v)

    def str(self, name: str, default: str | None = None) -> str:
        v = self.raw(name, default)
        if v is None:
            raise ModelError(f"missing required key {self._full(name)}")
        if not isinstance(v, str):
            raise ModelError(f"key {self._full(name)} must be a string, got {type(v).__name__}")
        return v

    # the `int`/`str` methods above shadow the builtins inside this class body
    def per_layer(self, name: builtins.str, n_layer: builtins.int,
                  default: builtins.int | None = None) -> list[builtins.int]:
        v = self.raw(name, default)
        if v is None:
            raise ModelError(f"missing required key {self._full(name)}")
        if isinstance(v, list):
            if len(v) != n_layer:
                raise ModelError(f"key {self._full(name)} has {len(v)} entries, expected {n_layer} (one per layer)")
            return [int(x) for x in v]
        return [int(v)] * n_layer


def swa_layers(keys: Keys, n_layer: int, default_period: int) -> list[bool]:
    """llama.cpp's load_swa_pattern: which layers attend through the sliding window, from
    `attention.sliding_window_pattern` as a per-layer array (1 = window) or a scalar period n
    (layer il is windowed iff il % n < n - 1, so every n-th layer is full; 0: every layer)."""
    raw = keys.raw("attention.sliding_window_pattern", default_period)
    if isinstance(raw, list):
        if len(raw) != n_layer:
            raise ModelError(f"key {keys._full('attention.sliding_window_pattern')} has {len(raw)} entries, "
                             f"expected {n_layer} (one per layer)")
        return [bool(v) for v in raw]
    period = keys.int("attention.sliding_window_pattern", default_period)
    if period < 0:
        raise ModelError(f"key {keys._full('attention.sliding_window_pattern')} must be >= 0, got {period}")
    return [period == 0 or il % period < period - 1 for il in range(n_layer)]


def rope_free_layers(n_layer: int, period: int) -> list[bool]:
    """Which layers skip rope when every `period`-th one does (NoPE: layer il iff (il + 1) % period
    == 0, so layers period-1, 2*period-1, ... attend with unrotated q and k)."""
    return [(il + 1) % period == 0 for il in range(n_layer)]


def rope_freq_scale(keys: Keys) -> float:
    """ggml's freq_scale: 1/rope.scaling.factor unless the factor is absent/zero or scaling is none."""
    if keys.raw("rope.scaling.type", "linear") == "none":
        return 1.0
    factor = keys.raw("rope.scaling.factor", None)
    if factor is None:
        factor = keys.raw("rope.scale_linear", None)
    if not factor:
        return 1.0
    return 1.0 / float(factor)


def imrope_components(sections: tuple[int, ...] | list[int], n_rot: int) -> list[str]:
    """Which position component ("t", "h", "w" or "e") each rotary pair of IMROPE reads
    (ggml_mrope_cache_init with is_imrope: the first matching rule wins)."""
    if len(sections) != 4 or sum(sections) <= 0 or not any(s > 0 for s in sections[:3]):
        raise ModelError(
            f"rope.dimension_sections must be 4 sizes with a positive t/h/w section, got {list(sections)}"
        )
    s0, s1, s2, _ = (int(v) for v in sections)
    total = sum(int(v) for v in sections)
    out = []
    for i in range(n_rot // 2):
        sector = i % total
        if sector % 3 == 1 and sector < 3 * s1:
            out.append("h")
        elif sector % 3 == 2 and sector < 3 * s2:
            out.append("w")
        elif sector % 3 == 0 and sector < 3 * s0:
            out.append("t")
        else:
            out.append("e")
    return out


def mrope_components(sections: tuple[int, ...] | list[int], n_rot: int) -> list[str]:
    """Which position component each rotary pair of (non-interleaved) M-RoPE reads: the sections
    t, h, w, e one after another, repeating every sum(sections) pairs (ggml_mrope_cache_init)."""
    if len(sections) != 4 or sum(sections) <= 0 or any(s < 0 for s in sections):
        raise ModelError(f"rope.dimension_sections must be 4 sizes >= 0 with a positive sum, got {list(sections)}")
    bounds = np.cumsum([int(v) for v in sections])
    return ["thwe"[int(np.searchsorted(bounds, i % int(bounds[-1]), side="right"))] for i in range(n_rot // 2)]


def rope_table(n_ctx: int, n_rot: int, base: float, freq_scale: float, freq_factors: np.ndarray | None,
               sections: tuple[int, ...] | list[int] | None = None, interleaved: bool = True) -> np.ndarray:
    """cos/sin for every position and rotary pair, computed the float32 way ggml does.

    ggml builds theta by repeated float32 multiplication (theta *= theta_scale per pair), divides
    by the optional per-pair factor, then applies freq_scale; matching that keeps the goldens tight.
    With IMROPE `sections`, row p holds the angles of a text token at (t, h, w, e) = (p, p, p, 0):
    pairs that read the "e" component get angle 0 (cos 1, sin 0), i.e. are not rotated.
    `interleaved` False: the sections are M-RoPE's consecutive ones (mrope_components).
    """
    theta_scale = powf(np.float32(base), np.float32(-2.0) / np.float32(n_rot))
    theta = np.arange(n_ctx, dtype=np.float32)
    half = n_rot // 2
    comps = ((imrope_components if interleaved else mrope_components)(sections, n_rot) if sections is not None
             else ["t"] * half)
    angles = np.empty((n_ctx, half), dtype=np.float32)
    for i in range(half):
        ff = np.float32(freq_factors[i]) if freq_factors is not None else np.float32(1.0)
        angles[:, i] = np.float32(freq_scale) * (theta / ff) if comps[i] != "e" else np.float32(0.0)
        theta = (theta * theta_scale).astype(np.float32)
    table = np.empty((n_ctx, half, 2), dtype=np.float32)
    table[..., 0], table[..., 1] = _cos_sin_f32(angles)
    return table


@dataclass(frozen=True)
class RopeScaling:
    """The rope op's scaling parameters as llama.cpp's context sets them (llama-context.cpp):
    `freq_scale` 1/rope.scaling.factor, `ext_factor` 1 for YaRN, the YaRN ramp's original context
    and betas, and `attn_factor`, the magnitude the op multiplies cos/sin by (with YaRN, before its
    own 1 + 0.1 ln(1/freq_scale))."""

    freq_scale: float = 1.0
    ext_factor: float = 0.0
    n_orig: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attn_factor: float = 1.0


def read_rope_scaling(keys: Keys, *, read_betas: bool = False) -> RopeScaling:
    """`rope.scaling.*` as llama.cpp's context reads them. With YaRN the context's magnitude is
    mscale(F, 1) / mscale(F, log_mul) (just mscale(F, 1) without `yarn_log_multiplier`) times
    1 / (1 + 0.1 ln F), all in float32; every model then multiplies it by `rope.scaling.attn_factor`.
    `read_betas`: the architecture reads `yarn_beta_fast/slow` (else ggml's 32 and 1)."""
    f32 = np.float32
    fs = rope_freq_scale(keys)
    n_orig = keys.int("rope.scaling.original_context_length", 0) or keys.int("context_length")
    attn = f32(1.0)
    yarn = keys.raw("rope.scaling.type", "linear") == "yarn"
    if yarn:
        factor = f32(1.0) / f32(fs)
        log_mul = f32(keys.float("rope.scaling.yarn_log_multiplier", 0.0))
        attn = _yarn_mscale(factor, f32(1.0))
        if log_mul != 0:
            attn = f32(attn / _yarn_mscale(factor, log_mul))
        attn = f32(attn * (f32(1.0) / (f32(1.0) + f32(0.1) * logf(factor))))
    attn = f32(attn * f32(keys.float("rope.scaling.attn_factor", 1.0)))
    betas = (keys.float("rope.scaling.yarn_beta_fast", 32.0), keys.float("rope.scaling.yarn_beta_slow", 1.0)) \
        if read_betas else (32.0, 1.0)
    return RopeScaling(fs, 1.0 if yarn else 0.0, n_orig, betas[0], betas[1], float(attn))


def _yarn_mscale(factor: np.float32, mscale: np.float32) -> np.float32:
    f32 = np.float32
    return f32(1.0) if factor <= 1 else f32(f32(f32(0.1) * mscale) * logf(factor) + f32(1.0))


def scaled_rope_table(n_ctx: int, n_rot: int, base: float, rs: RopeScaling,
                      freq_factors: np.ndarray | None) -> np.ndarray:
    """cos/sin as ggml's rope_yarn computes them in float32 (ggml_rope_cache_init): per pair the
    extrapolated angle theta / ff, the interpolated one freq_scale times that, mixed by the YaRN
    ramp over the correction dims when `ext_factor` is set (which also scales the magnitude by
    1 + 0.1 ln(1/freq_scale)), and cos/sin times `attn_factor`. Without YaRN and with magnitude 1
    it is `rope_table`'s exactly."""
    f32 = np.float32
    theta_scale = powf(f32(base), f32(-2.0) / f32(n_rot))
    theta = np.arange(n_ctx, dtype=np.float32)
    half = n_rot // 2
    low, high = _yarn_corr_dims(n_rot, rs.n_orig, base, rs.beta_fast, rs.beta_slow)
    fs, ext = f32(rs.freq_scale), f32(rs.ext_factor)
    mscale = f32(rs.attn_factor)
    if ext != 0:
        mscale = f32(mscale * (f32(1.0) + f32(0.1) * logf(f32(1.0) / fs)))
    angles = np.empty((n_ctx, half), dtype=np.float32)
    for i in range(half):
        ff = f32(freq_factors[i]) if freq_factors is not None else f32(1.0)
        extrap = (theta / ff).astype(np.float32)
        interp = (fs * extrap).astype(np.float32)
        if ext != 0:
            y = f32(f32(i) - low) / max(f32(0.001), f32(high - low))
            mix = f32(f32(1.0) - min(f32(1.0), max(f32(0.0), y))) * ext
            interp = (interp * (f32(1.0) - mix) + extrap * mix).astype(np.float32)
        angles[:, i] = interp
        theta = (theta * theta_scale).astype(np.float32)
    table = np.empty((n_ctx, half, 2), dtype=np.float32)
    cos, sin = _cos_sin_f32(angles)
    table[..., 0], table[..., 1] = cos * mscale, sin * mscale
    return table


def _yarn_corr_dims(n_rot: int, n_orig: int, base: float, beta_fast: float,
                    beta_slow: float) -> tuple[np.float32, np.float32]:
    """ggml_rope_yarn_corr_dims in float32: the pair range over which the ramp goes from
    extrapolation to interpolation."""
    f32 = np.float32
    if n_orig <= 0:
        return f32(0.0), f32(0.0)

    def dim(beta: float) -> np.float32:
        ratio = f32(f32(n_orig) / f32(f32(f32(beta) * f32(2)) * f32(np.pi)))
        return f32(f32(f32(n_rot) * logf(ratio)) / f32(f32(2) * logf(f32(base))))

    return f32(max(0.0, np.floor(dim(beta_fast)))), f32(min(n_rot - 1.0, np.ceil(dim(beta_slow))))


def position_scale_table(n_ctx: int, scale: np.ndarray) -> np.ndarray:
    """A one-pair rope table [n_ctx, 1, 2] whose angle is 0 and magnitude `scale[p]`: rope with it
    multiplies every pair of a row by its position's factor, exactly (x·s − y·0)."""
    table = np.zeros((n_ctx, 1, 2), dtype=np.float32)
    table[:, 0, 0] = scale.astype(np.float32)
    return table


@functools.cache
def _libm() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("m")
    try:
        lib = ctypes.CDLL(name) if name else None
    except OSError:
        lib = None
    if lib is not None:
        for fn in (lib.cosf, lib.sinf):
            fn.restype, fn.argtypes = ctypes.c_float, [ctypes.c_float]
        lib.powf.restype, lib.powf.argtypes = ctypes.c_float, [ctypes.c_float, ctypes.c_float]
        lib.logf.restype, lib.logf.argtypes = ctypes.c_float, [ctypes.c_float]
    return lib


def logf(x: np.float32) -> np.float32:
    """The C library's logf, as llama.cpp calls it (without a C library, the float64 log rounded)."""
    lib = _libm()
    if lib is None:
        return np.float32(np.log(np.float64(x)))
    return np.float32(lib.logf(float(x)))


def powf(x: np.float32, y: np.float32) -> np.float32:
    """The C library's powf, as ggml calls it (numpy's float32 power differs by an ulp for some
    rope bases, e.g. 10000^(-1/32)); without a C library, the float64 power rounded."""
    lib = _libm()
    if lib is None:
        return np.float32(np.power(np.float64(x), np.float64(y)))
    return np.float32(lib.powf(float(x), float(y)))


def _cos_sin_f32(angles: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cosf/sinf of float32 angles from the C library, as ggml calls them (numpy's float32 cos
    differs from glibc's in ~10% of values, a float64 cos rounded to float32 in ~1%); without a C
    library, the float64 values rounded."""
    lib = _libm()
    if lib is None:
        wide = angles.astype(np.float64)
        return np.cos(wide).astype(np.float32), np.sin(wide).astype(np.float32)
    uniq, inverse = np.unique(angles, return_inverse=True)
    cos = np.fromiter((lib.cosf(a) for a in uniq.tolist()), dtype=np.float32, count=uniq.size)
    sin = np.fromiter((lib.sinf(a) for a in uniq.tolist()), dtype=np.float32, count=uniq.size)
    return cos[inverse].reshape(angles.shape), sin[inverse].reshape(angles.shape)
