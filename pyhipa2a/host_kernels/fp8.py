"""Host twin of the fp8 conversions (kernels_hip/portability.h) and quantizing (kernels_hip/fp8.h), step for step
in NumPy; pyhipa2a.reference states the same rules with ml_dtypes, and the tests hold each to the other."""
from __future__ import annotations

import numpy as np

from ..dtypes import FP8_BLOCK as BLOCK


class Fp8Format:
    def __init__(self, fnuz: bool):
        self.largest = np.float32(240.0 if fnuz else 448.0)
        self.min_exponent = -7 if fnuz else -6
        self.nan = 0x80 if fnuz else 0x7F
        self.top = 0x7F if fnuz else 0x7E  # code of the largest finite value


def to_fp8(values: np.ndarray, fnuz: bool) -> np.ndarray:
    """a2a_float_to_fp8: float32 -> fp8 codes (uint8), to nearest even, saturating; NaN to the format's NaN."""
    f = Fp8Format(fnuz)
    v = np.ascontiguousarray(values, np.float32)
    bits = v.view(np.uint32)
    sign = ((bits >> 24) & 0x80).astype(np.uint32)
    a = np.abs(v)
    e = np.maximum(((bits >> 23) & 0xFF).astype(np.int32) - 127, f.min_exponent)
    inside = a < f.largest  # (False for NaN and inf)
    scaled = np.where(inside, a, 0).astype(np.float32) * np.ldexp(np.float32(1), 3 - e).astype(np.float32)
    m = np.rint(scaled).astype(np.uint32)  # ties to even
    code = np.where(inside, np.minimum(((e - f.min_exponent).astype(np.uint32) << 3) + m, f.top), f.top)
    code = np.where(np.isnan(v), f.nan, np.where(fnuz & (code == 0), 0, code | sign))
    return code.astype(np.uint8)


def from_fp8(codes: np.ndarray, fnuz: bool) -> np.ndarray:
    """a2a_fp8_to_float: fp8 codes -> float32 (exact)."""
    f = Fp8Format(fnuz)
    c = np.asarray(codes, np.uint8).astype(np.int32)
    e, m = (c >> 3) & 0xF, c & 7
    v = np.where(e > 0, 8 + m, m).astype(np.float32) * np.ldexp(np.float32(1), np.maximum(e, 1) - 1
                                                                 + f.min_exponent - 3).astype(np.float32)
    v = np.where(c & 0x80, -v, v).astype(np.float32)
    nan = (c == 0x80) if fnuz else ((c & 0x7F) == 0x7F)
    return np.where(nan, np.float32(np.nan), v).astype(np.float32)


def quantize(x: np.ndarray, fnuz: bool) -> tuple[np.ndarray, np.ndarray]:
    """fp8.h's quantize_piece over whole rows: ([T, H] codes, [T, H / 128] float32 scales)."""
    f = Fp8Format(fnuz)
    T, H = x.shape
    v = x.astype(np.float32).reshape(T, H // BLOCK, BLOCK)
    amax_bits = (v.view(np.uint32) & 0x7FFFFFFF).max(axis=2, initial=0)  # bits order like |values|; NaN on top
    finite = amax_bits < 0x7F800000
    amax = np.where(finite, amax_bits, 0).astype(np.uint32).view(np.float32)
    used = finite & (amax >= np.float32(2.0 ** -112))  # else zeros with scale 0 (below: inv would overflow)
    safe = np.where(used, amax, np.float32(1))
    inv = np.where(used, f.largest / safe, np.float32(0)).astype(np.float32)
    scale = np.where(used, safe / f.largest, np.float32(0)).astype(np.float32)
    scale = np.where(finite, scale, np.float32(np.nan)).astype(np.float32)
    with np.errstate(invalid="ignore"):  # inf * 0 in a non-finite block, whose codes are NaN below
        codes = to_fp8(v * inv[..., None], fnuz)
    codes[~finite] = f.nan
    return codes.reshape(T, H), scale
