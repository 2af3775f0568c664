"""Host twins of kernels_hip/a2a.hip: the same buffers, flags and reservations."""
from __future__ import annotations

import time

import numpy as np

from ..dtypes import bfloat16
from . import STATUS_BAD_INDEX, STATUS_CAPACITY, Status, bases, mem, wait_flags

WAIT_DISPATCH, WAIT_COMBINE_DONE = 1, 3


def _invalid_pairs(indices: np.ndarray, num_experts: int) -> np.ndarray:
    """Mask of (token, slot) pairs outside [0, E) or repeating an earlier slot of their row."""
    bad = (indices < 0) | (indices >= num_experts)
    for j in range(1, indices.shape[1]):
        bad[:, j] |= (indices[:, :j] == indices[:, j:j + 1]).any(axis=1)
    return bad


def a2a_dispatch(backend, a, c) -> None:
    h, k, L = a.heap, a.top_k, a.local_experts
    capacity = h.world * a.max_tokens
    deadline = time.monotonic() + a.timeout_ns / 1e9
    base = bases(h)
    status = Status(base[h.rank] + a.off_status, a.host_status)
    T = c.num_tokens
    indices = mem(c.indices, (T, k), np.int32)
    x = mem(c.x, (T, a.x_row_bytes), np.uint8)

    bad = _invalid_pairs(indices, a.num_experts)
    if bad.any():
        pos = int(np.flatnonzero(bad)[0])
        status.report(STATUS_BAD_INDEX, h.rank, pos, int(indices.flat[pos]))
    tokens, slots = np.nonzero(~bad)
    experts = indices[tokens, slots]
    for e in np.unique(experts):
        pick = experts == e
        dst, l = int(e) // L, int(e) % L
        n = int(pick.sum())
        # One reservation per (destination, expert): a contiguous run of rows.
        first = backend.atomic_add_u32(base[dst] + a.off_counters + 4 * l, n)
        rows = first + np.arange(n)
        fits = rows < capacity
        if not fits.all():
            status.report(STATUS_CAPACITY, dst, l, int(rows[~fits][0]))
        rows, t, j = rows[fits], tokens[pick][fits], slots[pick][fits]
        mem(base[dst] + a.off_recv_x, (L, capacity, a.x_row_bytes), np.uint8)[l, rows] = x[t]
        mem(base[dst] + a.off_recv_meta, (L, capacity, 3), np.int32)[l, rows] = np.stack(
            [np.full_like(t, h.rank), t, j], axis=1)

    for peer in range(h.world):
        backend.store_release_u32(base[peer] + a.off_dispatch_flags + 4 * h.rank, c.epoch)
    if not wait_flags(backend, base[h.rank] + a.off_dispatch_flags, range(h.world), c.epoch, deadline,
                      status, WAIT_DISPATCH):
        return
    counters = mem(base[h.rank] + a.off_counters, (L,), np.uint32)
    mem(base[h.rank] + a.off_num_tokens, (L,), np.int32)[:] = np.minimum(counters, capacity)
    counters[:] = 0


def _combine(backend, a, c, dtype) -> None:
    h, k, L, H = a.heap, a.top_k, a.local_experts, a.hidden
    capacity = h.world * a.max_tokens
    deadline = time.monotonic() + a.timeout_ns / 1e9
    base = bases(h)
    status = Status(base[h.rank] + a.off_status, a.host_status)

    # Push every received row back to its owner's (token, slot) row.
    counts = mem(base[h.rank] + a.off_num_tokens, (L,), np.int32)
    meta = mem(base[h.rank] + a.off_recv_meta, (L, capacity, 3), np.int32)
    expert_y = mem(c.expert_y, (L, capacity, a.y_row_bytes), np.uint8)
    for l in range(L):
        n = int(counts[l])
        if n == 0:
            continue
        src, token, slot = meta[l, :n, 0], meta[l, :n, 1], meta[l, :n, 2]
        for owner in np.unique(src):
            pick = src == owner
            rows = mem(base[owner] + a.off_combine_rows, (a.max_tokens * k, a.y_row_bytes), np.uint8)
            rows[token[pick] * k + slot[pick]] = expert_y[l, :n][pick]

    # Done barrier: every peer finished pushing to us, and reading our buffers.
    for peer in range(h.world):
        backend.store_release_u32(base[peer] + a.off_combine_done + 4 * h.rank, c.epoch)
    if not wait_flags(backend, base[h.rank] + a.off_combine_done, range(h.world), c.epoch, deadline,
                      status, WAIT_COMBINE_DONE):
        return

    T = c.num_tokens
    rows = mem(base[h.rank] + a.off_combine_rows, (a.max_tokens, k, H), dtype)[:T]
    weights = mem(c.weights, (T, k), np.float32)
    acc = np.zeros((T, H), np.float32)
    for j in range(k):  # slot order, fp32, as the device does
        acc += weights[:, j:j + 1] * rows[:, j].astype(np.float32)
    mem(c.out, (T, H), dtype)[:] = acc.astype(dtype)


def a2a_combine_f16(backend, a, c) -> None:
    _combine(backend, a, c, np.dtype(np.float16))


def a2a_combine_bf16(backend, a, c) -> None:
    _combine(backend, a, c, bfloat16())


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
