"""Host twin of kernels_hip/clock.hip: host ranks share one clock, so a sync finds no offset beyond a round's time."""
from __future__ import annotations

import time

import numpy as np

from . import bases, mem, poll


def clock_probe(backend, out) -> None:
    mem(out.value, (1,), np.uint64)[0] = time.monotonic_ns()


def clock_sync(backend, a) -> None:
    h = a.heap
    deadline = time.monotonic() + a.timeout_ns / 1e9
    base = bases(h)
    stamps = mem(base[h.rank] + a.off_stamps, (h.world, a.rounds, 2), np.uint64)
    box = mem(base[h.rank] + a.off_box, (h.world,), np.uint64)
    done = mem(base[h.rank] + a.off_done, (1,), np.uint32)
    for peer in range(1, h.world):
        if h.rank not in (0, peer):
            continue
        other = peer if h.rank == 0 else 0
        theirs = mem(base[other] + a.off_box + 8 * h.rank, (1,), np.uint64)
        for i in range(a.rounds):
            word = np.uint64(a.epoch << 32 | i)
            if h.rank == 0:  # send, then see the answer
                stamps[other, i, 0] = time.monotonic_ns()
                theirs[0] = word
                if not poll(lambda: box[other] == word, deadline):
                    return
                stamps[other, i, 1] = time.monotonic_ns()
            else:  # see the word, then answer
                if not poll(lambda: box[other] == word, deadline):
                    return
                stamps[other, i, 1] = stamps[other, i, 0] = time.monotonic_ns()
                theirs[0] = word
        if h.rank == 0:  # the peer's copy of our stamps and host offset, then its flag
            from0 = mem(base[peer] + a.off_from0, (2 * a.rounds + 1,), np.uint64)
            from0[:-1] = stamps[peer].ravel()
            from0[-1] = a.host_offset
            backend.store_release_u32(base[peer] + a.off_done, a.epoch)
        elif not poll(lambda: done[0] == a.epoch, deadline):
            return
    mem(base[h.rank] + a.off_verdict, (1,), np.uint32)[0] = a.epoch
