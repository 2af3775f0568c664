"""Host twin of kernels_hip/expert.hip: gpu-mode's fake expert, expert_y = expert_x (fp8: times its scales) * scale."""
from __future__ import annotations

import numpy as np

from ..dtypes import bfloat16
from . import mem
from .fp8 import BLOCK, from_fp8


def _rows(counts, layout, sources, L: int, capacity: int) -> list[np.ndarray]:
    """Each expert's received rows (packed, or by source from row s * M); a count out of range (-1: poison) stands
    for all the rows, so poisoned rows become poisoned expert_y (exclusive_prefix, received_row in expert.hip)."""
    n = mem(counts.value, (L,), np.int32)
    n = np.where((n < 0) | (n > capacity), capacity, n)
    if not layout.value:
        return [np.arange(n[l]) for l in range(L)]
    W = sources.value
    M = capacity // W
    c = mem(layout.value, (L, W, 2), np.int32)[:, :, 1]
    c = np.where((c < 0) | (c > M), M, c)
    return [np.concatenate([s * M + np.arange(c[l, s]) for s in range(W)])[:n[l]] for l in range(L)]


def _scale(x, y, counts, layout, sources, L, capacity, hidden, scale, dtype) -> None:
    """Arguments arrive as the ctypes objects of the device kernel's signature."""
    L, capacity, hidden = L.value, capacity.value, hidden.value
    xs = mem(x.value, (L, capacity, hidden), dtype)
    ys = mem(y.value, (L, capacity, hidden), dtype)
    for l, rows in enumerate(_rows(counts, layout, sources, L, capacity)):
        ys[l, rows] = (xs[l, rows].astype(np.float32) * np.float32(scale.value)).astype(dtype)


def expert_scale_f16(backend, *args) -> None:
    _scale(*args, np.dtype(np.float16))


def expert_scale_bf16(backend, *args) -> None:
    _scale(*args, bfloat16())


def _dequantize(x, scales, y, counts, layout, sources, L, capacity, hidden, scale, fnuz, dtype) -> None:
    L, capacity, hidden = L.value, capacity.value, hidden.value
    codes = mem(x.value, (L, capacity, hidden), np.uint8)
    block = mem(scales.value, (L, capacity, hidden // BLOCK), np.float32)
    ys = mem(y.value, (L, capacity, hidden), dtype)
    for l, rows in enumerate(_rows(counts, layout, sources, L, capacity)):
        values = from_fp8(codes[l, rows], bool(fnuz.value)) * np.repeat(block[l, rows], BLOCK, axis=1)
        ys[l, rows] = (values.astype(np.float32) * np.float32(scale.value)).astype(dtype)


def expert_dequantize_f16(backend, *args) -> None:
    _dequantize(*args, np.dtype(np.float16))


def expert_dequantize_bf16(backend, *args) -> None:
    _dequantize(*args, bfloat16())
