"""Python twins of the device kernels for the host backend, so everything above them runs without GPUs: each follows
its namesake `.hip` file's protocol on shared memory; a host "grid" is one process (no last-block hand-off)."""
from __future__ import annotations

import ctypes
import time

import numpy as np

from ..bootstrap import poll
from ..dtypes import bfloat16

STATUS_OK, STATUS_TIMEOUT, STATUS_BAD_INDEX, STATUS_CAPACITY, STATUS_MISMATCH, STATUS_PEER = range(6)


def mem(ptr: int, shape, dtype) -> np.ndarray:
    """A NumPy view of memory at `ptr` (mapped into this process)."""
    dtype = np.dtype(dtype)
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return np.empty(shape, dtype)
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(ptr)
    return np.frombuffer(raw, dtype=dtype).reshape(shape)


def f16_and_bf16(body):
    """The f16 and bf16 twins of a kernel `body(backend, *args, dtype)`, as the device builds one of each."""
    return (lambda backend, *args: body(backend, *args, np.dtype(np.float16)),
            lambda backend, *args: body(backend, *args, bfloat16()))


def bases(heap) -> list[int]:
    return [int(b) for b in mem(heap.bases, (heap.world,), np.uint64)]


class Status:
    """A kernel's status words and their host mirror, reported to together."""

    def __init__(self, status_ptr: int, mirror_ptr: int = 0):
        self.words = mem(status_ptr, (4,), np.uint32)
        self.mirror = mem(mirror_ptr, (4,), np.uint32) if mirror_ptr else None

    def report(self, code: int, peer: int, what: int, detail: int) -> None:
        """First error wins, as on the device; a mirror that holds the host's own report keeps it."""
        if self.words[0] != STATUS_OK:
            return
        mirror_free = self.mirror is not None and self.mirror[0] == STATUS_OK
        for words in (self.words, self.mirror) if mirror_free else (self.words,):
            words[1], words[2], words[3] = peer & 0xFFFFFFFF, what & 0xFFFFFFFF, detail & 0xFFFFFFFF
            words[0] = code


def wait_flags(backend, flags_ptr: int, indices, want: int, deadline: float, status, what: int, peer=None) -> bool:
    """Wait until flag[i] == want for every i in `indices`; on timeout report `peer` (None: the first missing i)."""
    pending = [int(i) for i in indices]
    if not pending:
        return True
    flags = mem(flags_ptr, (max(pending) + 1,), np.uint32)

    def arrived() -> bool:
        pending[:] = [i for i in pending if flags[i] != want]
        return not pending
    if not poll(arrived, deadline):
        status.report(STATUS_TIMEOUT, pending[0] if peer is None else peer, what, want)
        return False
    backend.load_acquire_u32(flags_ptr)  # a locked read orders the data reads that follow
    return True


def tag(values, epoch: int) -> np.ndarray:
    """Tagged words (kernels_hip/protocol.h): the 32-bit value low, the epoch high."""
    return (np.uint64(epoch) << np.uint64(32)) | np.asarray(values).astype(np.uint32).astype(np.uint64)


class Recorder:
    """Host twin of kernels_hip/profile.h: events in the same buffer layout (warp 0's ring), host clock in ns."""

    def __init__(self, buffer_ptr: int):
        self.ptr = int(buffer_ptr)
        if self.ptr:
            from ..profile import EVENT, HEADER_BYTES, events_offset
            warps, per_warp = (int(v) for v in mem(self.ptr, (4,), np.uint32)[:2])
            self.count = mem(self.ptr + HEADER_BYTES, (1,), np.uint32)
            self.events = mem(self.ptr + events_offset(warps), (per_warp,), EVENT)

    def record(self, tag: int, start_ns: int, detail: int = 0) -> None:
        if not self.ptr:
            return
        end = time.monotonic_ns()
        i = int(self.count[0])
        self.count[0] = i + 1
        self.events[i % len(self.events)] = (start_ns, end, tag, 0, 0, detail)
