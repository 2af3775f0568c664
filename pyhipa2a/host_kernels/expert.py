"""Host twin of kernels_hip/expert.hip: gpu-mode's fake expert (expert_y = expert_x * scale)."""
from __future__ import annotations

import numpy as np

from ..dtypes import bfloat16
from . import mem

def _scale(x, y, counts, L, capacity, hidden, scale, dtype) -> None:
    """Arguments arrive as the ctypes objects of the device kernel's signature."""
    L, capacity, hidden = L.value, capacity.value, hidden.value
    xs = mem(x.value, (L, capacity, hidden), dtype)
    ys = mem(y.value, (L, capacity, hidden), dtype)
    n = mem(counts.value, (L,), np.int32)
    for l in range(L):
        ys[l, :n[l]] = (xs[l, :n[l]].astype(np.float32) * np.float32(scale.value)).astype(dtype)


def expert_scale_f16(backend, *args) -> None:
    _scale(*args, np.dtype(np.float16))


def expert_scale_bf16(backend, *args) -> None:
    _scale(*args, bfloat16())
