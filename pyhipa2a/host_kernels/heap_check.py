"""Host twin of kernels_hip/heap_check.hip."""
from __future__ import annotations

import time

import numpy as np

from . import STATUS_MISMATCH, Status, bases, mem, wait_flags

WAIT_HEAP_CHECK = 4


def pattern(writer: int, reader: int, words: int, epoch: int) -> np.ndarray:
    i = np.arange(words, dtype=np.uint64)
    v = (writer * 0x9E3779B1) ^ (reader * 0x85EBCA77) ^ ((i * 0xC2B2AE3D) & 0xFFFFFFFF) ^ epoch
    return (v & 0xFFFFFFFF).astype(np.uint32)


def heap_check(backend, a) -> None:
    h = a.heap
    deadline = time.monotonic() + a.timeout_ns / 1e9
    base = bases(h)
    status = Status(base[h.rank] + a.off_status)
    for peer in range(h.world):
        mem(base[peer] + a.off_slots + 4 * h.rank * a.words, (a.words,), np.uint32)[:] = \
            pattern(h.rank, peer, a.words, a.epoch)
    for peer in range(h.world):
        backend.store_release_u32(base[peer] + a.off_flags + 4 * h.rank, a.epoch)
    if not wait_flags(backend, base[h.rank] + a.off_flags, range(h.world), a.epoch, deadline, status, WAIT_HEAP_CHECK):
        return
    slots = mem(base[h.rank] + a.off_slots, (h.world, a.words), np.uint32)
    bad = sum(int(np.count_nonzero(slots[w] != pattern(w, h.rank, a.words, a.epoch))) for w in range(h.world))
    mem(base[h.rank] + a.off_result, (1,), np.uint32)[0] = bad
    if bad:
        status.report(STATUS_MISMATCH, h.rank, 0, bad)
