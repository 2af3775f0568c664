"""Host twin of kernels_hip/expert.hip: gpu-mode's fake expert, expert_y = expert_x (fp8: times its scales) * scale."""
from __future__ import annotations

import numpy as np

from . import f16_and_bf16, mem
from .fp8 import BLOCK, from_fp8


def _rows(counts, layout, offsets, sources, recv_rows, L: int, capacity: int) -> list[np.ndarray]:
    """Each expert's received rows, as indices into the [recv_rows] buffer: packed (from row l * capacity), by
    source (from row l * capacity + s * M) or contiguous (from expert_offsets[l]); a count out of range (-1: poison)
    stands for all the rows, so poisoned rows become poisoned expert_y (exclusive_prefix, received_row,
    offsets_hold in expert.hip; contiguous offsets that do not hold the rows: every row of the buffer)."""
    n = mem(counts.value, (L,), np.int32)
    n = np.where((n < 0) | (n > capacity), capacity, n)
    if offsets.value:
        first = mem(offsets.value, (L + 1,), np.int32).astype(np.int64)
        spans = np.diff(first)
        if first[0] != 0 or (spans < 0).any() or first[L] > recv_rows.value or (spans < n).any():
            return [np.arange(recv_rows.value)]
        return [first[local] + np.arange(n[local]) for local in range(L)]
    if not layout.value:
        return [local * capacity + np.arange(n[local]) for local in range(L)]
    W = sources.value
    M = capacity // W
    c = mem(layout.value, (L, W, 2), np.int32)[:, :, 1]
    c = np.where((c < 0) | (c > M), M, c)
    return [local * capacity + np.concatenate([s * M + np.arange(c[local, s]) for s in range(W)])[:n[local]]
            for local in range(L)]


def _scale(backend, x, y, counts, layout, offsets, sources, recv_rows, L, capacity, hidden, scale, dtype) -> None:
    """Arguments arrive as the ctypes objects of the device kernel's signature."""
    L, capacity, hidden = L.value, capacity.value, hidden.value
    xs = mem(x.value, (recv_rows.value, hidden), dtype)
    ys = mem(y.value, (recv_rows.value, hidden), dtype)
    for rows in _rows(counts, layout, offsets, sources, recv_rows, L, capacity):
        ys[rows] = (xs[rows].astype(np.float32) * np.float32(scale.value)).astype(dtype)


expert_scale_f16, expert_scale_bf16 = f16_and_bf16(_scale)


def _dequantize(backend, x, scales, y, counts, layout, offsets, sources, recv_rows, L, capacity, hidden, scale, fnuz,
                dtype) -> None:
    L, capacity, hidden, R = L.value, capacity.value, hidden.value, recv_rows.value
    codes = mem(x.value, (R, hidden), np.uint8)
    block = mem(scales.value, (R, hidden // BLOCK), np.float32)
    ys = mem(y.value, (R, hidden), dtype)
    for rows in _rows(counts, layout, offsets, sources, recv_rows, L, capacity):
        values = from_fp8(codes[rows], bool(fnuz.value)) * np.repeat(block[rows], BLOCK, axis=1)
        ys[rows] = (values.astype(np.float32) * np.float32(scale.value)).astype(dtype)


expert_dequantize_f16, expert_dequantize_bf16 = f16_and_bf16(_dequantize)
