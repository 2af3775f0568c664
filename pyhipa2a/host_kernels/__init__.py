"""Python implementations of the device kernels for the host backend.

Each module mirrors the `.hip` file of the same name and follows its protocol
(epoch flags, slot reservation on the receiver's counters, the done barrier)
on the host backend's shared memory, so everything above the kernels is
exercised on machines without GPUs. A host "grid" is one process, so the
last-block hand-off is implicit.
"""
from __future__ import annotations

import ctypes
import time

import numpy as np

from ..bootstrap import sleep_backoff

STATUS_OK, STATUS_TIMEOUT, STATUS_BAD_INDEX, STATUS_CAPACITY, STATUS_MISMATCH = range(5)


def mem(ptr: int, shape, dtype) -> np.ndarray:
    """A NumPy view of memory at `ptr` (mapped into this process)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return np.empty(shape, dtype)
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(ptr)
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def bases(heap) -> list[int]:
    return [int(b) for b in mem(heap.bases, (heap.world,), np.uint64)]


def report(status: np.ndarray, code: int, peer: int, what: int, detail: int) -> None:
    """First error wins, as on the device."""
    if status[0] == STATUS_OK:
        status[1], status[2], status[3] = peer & 0xFFFFFFFF, what & 0xFFFFFFFF, detail & 0xFFFFFFFF
        status[0] = code


def wait_flags(backend, flags_ptr: int, peers, want: int, deadline: float, status, what: int) -> bool:
    """Wait until flag[p] == want for every p in `peers`; on timeout report the first missing peer."""
    pending = list(peers)
    flags = mem(flags_ptr, (max(pending, default=0) + 1,), np.uint32)
    attempt = 0
    while pending:
        pending = [p for p in pending if flags[p] != want]
        if not pending:
            break
        if time.monotonic() > deadline:
            report(status, STATUS_TIMEOUT, pending[0], what, want)
            return False
        sleep_backoff(attempt)
        attempt += 1
    for p in peers:  # acquire: a locked read orders the data reads that follow
        backend.load_acquire_u32(flags_ptr + 4 * p)
    return True
