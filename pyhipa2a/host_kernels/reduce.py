"""Host twin of kernels_hip/reduce.hip: out = the sum of n slots, added in fp32, rounded once."""
from __future__ import annotations

import numpy as np

from . import f16_and_bf16, mem


def _sum(backend, slots, out, count, stride, n, dtype) -> None:
    count, stride, n = count.value, stride.value, n.value
    if not count:
        return
    span = mem(slots.value, ((n - 1) * stride + count,), dtype)
    total = sum(span[j * stride:j * stride + count].astype(np.float32) for j in range(n))
    mem(out.value, (count,), dtype)[...] = total.astype(dtype)


sum_slots_f16, sum_slots_bf16 = f16_and_bf16(_sum)
