"""Host twin of kernels_hip/expert.hip: gpu-mode's fake expert (expert_y = expert_x * scale; in fp8
dispatch, each fp8 row times its block scales first)."""
from __future__ import annotations

import numpy as np

from ..dtypes import bfloat16
from . import mem
from .fp8 import BLOCK, from_fp8


def _counts(counts, L: int, capacity: int) -> np.ndarray:
    """The experts' row counts; one outside [0, capacity] (-1: a failed dispatch's poison) stands for all
    of its expert's rows, so poisoned rows become poisoned expert_y (exclusive_prefix in expert.hip)."""
    n = mem(counts.value, (L,), np.int32)
    return np.where((n < 0) | (n > capacity), capacity, n)


def _scale(x, y, counts, L, capacity, hidden, scale, dtype) -> None:
    """Arguments arrive as the ctypes objects of the device kernel's signature."""
    L, capacity, hidden = L.value, capacity.value, hidden.value
    xs = mem(x.value, (L, capacity, hidden), dtype)
    ys = mem(y.value, (L, capacity, hidden), dtype)
    n = _counts(counts, L, capacity)
    for l in range(L):
        ys[l, :n[l]] = (xs[l, :n[l]].astype(np.float32) * np.float32(scale.value)).astype(dtype)


def expert_scale_f16(backend, *args) -> None:
    _scale(*args, np.dtype(np.float16))


def expert_scale_bf16(backend, *args) -> None:
    _scale(*args, bfloat16())


def _dequantize(x, scales, y, counts, L, capacity, hidden, scale, fnuz, dtype) -> None:
    L, capacity, hidden = L.value, capacity.value, hidden.value
    codes = mem(x.value, (L, capacity, hidden), np.uint8)
    block = mem(scales.value, (L, capacity, hidden // BLOCK), np.float32)
    ys = mem(y.value, (L, capacity, hidden), dtype)
    n = _counts(counts, L, capacity)
    for l in range(L):
        rows = from_fp8(codes[l, :n[l]], bool(fnuz.value)) * np.repeat(block[l, :n[l]], BLOCK, axis=1)
        ys[l, :n[l]] = (rows.astype(np.float32) * np.float32(scale.value)).astype(dtype)


def expert_dequantize_f16(backend, *args) -> None:
    _dequantize(*args, np.dtype(np.float16))


def expert_dequantize_bf16(backend, *args) -> None:
    _dequantize(*args, bfloat16())
