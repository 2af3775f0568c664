"""Lining up the ranks' device clocks (kernels_hip/clock.hip): each device's clock is compared with rank
0's by a ping-pong over the heap on the device, and only rank 0's meets the host's clock, through one
reading (clock_offset), whose error, up to half a launch's round trip, shifts every rank alike."""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import numpy as np

from .errors import A2AError, A2ATimeoutError
from .kernels import HeapView, timeout_ns


def clock_offset(backend, library, stream, tries: int = 5) -> int:
    """host monotonic ns minus device clock ns, from the tightest of `tries` probes."""
    kernel = library.kernel("clock_probe")
    pack = kernel.pack()
    out = backend.malloc_ipc(8)
    try:
        best = None
        for _ in range(tries):
            pack.set_scalars(out)
            before = time.monotonic_ns()
            kernel.launch(pack, 1, 1, stream)
            backend.stream_synchronize(stream)
            after = time.monotonic_ns()
            device = np.empty(1, np.uint64)
            backend.copy_to_host(device, out, stream)
            if best is None or after - before < best[0]:
                best = (after - before, (before + after) // 2 - int(device[0]))
        return best[1]
    finally:
        backend.free(out)


CLOCK_ROUNDS = 32  # words each peer trades with rank 0 in a clock sync (kernels_hip/clock.hip)


@dataclass(frozen=True)
class ClockSync:
    """This rank's clock against rank 0's, from a clock sync's stamps (ns)."""
    offset_ns: int     # this rank's clock minus rank 0's
    error_ns: int      # the offset is within this of the truth: half the longest round trip used
    one_way_ns: float  # a word's trip between the two ranks (median of the rounds used)


def clock_sync_from_stamps(rank0: np.ndarray, peer: np.ndarray) -> ClockSync:
    """A peer's ClockSync from rank 0's stamps with it and its own, each [round] = (sent, seen). NTP's
    arithmetic: rank 0 sends at s0 and sees the answer at r0, the peer sees it at r1 and answers at s1; the
    offset lies within half of (r0 - s0) - (s1 - r1) of ((r1 - s0) + (s1 - r0)) / 2. The quarter of the
    rounds with the shortest round trips give the median offset."""
    s0, r0 = rank0[:, 0].astype(np.int64), rank0[:, 1].astype(np.int64)
    s1, r1 = peer[:, 0].astype(np.int64), peer[:, 1].astype(np.int64)
    round_trip = (r0 - s0) - (s1 - r1)
    best = np.argsort(round_trip, kind="stable")[:max(1, len(round_trip) // 4)]
    offsets = ((r1 - s0) + (s1 - r0))[best] / 2
    return ClockSync(int(np.median(offsets)), int(round_trip[best].max() + 1) // 2,
                     float(np.median(round_trip[best])) / 2)


class Clocks:
    """The clock syncs of one node exchange. Collective: every rank syncs as often as the others."""

    def __init__(self, library, buffers, stream):
        self.library, self.buffers, self.stream = library, buffers, stream
        self.epoch = 0          # tags each sync's words
        self.failed = None      # why the syncs are out of step (each rank counts its own)
        self.last: ClockSync | None = None  # the last sync's, this rank against rank 0

    def offset_ns(self) -> int:
        """Host monotonic clock minus this device's clock, in ns. A rank that never syncs is named in the
        others' A2ATimeoutError; after any failure later syncs raise A2AError."""
        if self.failed is not None:
            raise A2AError(f"clock_offset_ns() is unusable after an earlier failure: {self.failed}")
        try:
            return self._sync()
        except Exception as error:
            self.failed = str(error)
            raise

    @functools.cached_property
    def _launch(self):
        """(kernel, pack) of clock_sync, made on first use."""
        kernel = self.library.kernel("clock_sync")
        pack = kernel.pack()
        a, b = pack[0], self.buffers
        a.heap = HeapView.of(b.heap)
        for name in ("box", "stamps", "from0", "done", "verdict"):
            setattr(a, "off_" + name, b.offset("clock_" + name))
        a.rounds, a.timeout_ns = CLOCK_ROUNDS, timeout_ns(b.config.timeout)
        return kernel, pack

    def _sync(self) -> int:
        b, backend, s = self.buffers, self.buffers.heap.backend, self.stream
        rank, world, timeout = b.heap.rank, b.heap.world, b.config.timeout
        host = clock_offset(backend, self.library, s) if rank == 0 else 0
        self.epoch += 1
        kernel, pack = self._launch
        pack[0].host_offset, pack[0].epoch = host & (2**64 - 1), self.epoch
        stamps = np.zeros((world, CLOCK_ROUNDS, 2), np.uint64)  # a round that never completes stays 0
        verdict = np.zeros(1, np.uint32)                        # the epoch once this rank's part is done
        backend.copy_to_device(b["clock_stamps"].ptr, stamps, s)
        backend.copy_to_device(b["clock_verdict"].ptr, verdict, s)
        kernel.launch(pack, 1, 1, s)
        from0 = np.zeros(2 * CLOCK_ROUNDS + 1, np.uint64)
        for array, name in ((stamps, "stamps"), (from0, "from0"), (verdict, "verdict")):
            backend.copy_to_host(array, b["clock_" + name].ptr, s)
        backend.stream_synchronize(s)
        if verdict[0] != self.epoch:
            if rank == 0:  # the peer it waited for: its first word went out, its rounds never ended
                late = tuple(r for r in range(1, world) if stamps[r, 0, 0] and not stamps[r].all())
                raise A2ATimeoutError(f"clock sync: rank {late[0] if late else '?'} never arrived (no answer "
                                      f"within {timeout:.1f} s)", late)
            raise A2ATimeoutError(f"clock sync: rank 0 never arrived (no word within {timeout:.1f} s)", (0,))
        if rank == 0:
            self.last = ClockSync(0, 0, 0.0)
            return host
        self.last = clock_sync_from_stamps(from0[:-1].reshape(CLOCK_ROUNDS, 2), stamps[0])
        return int(from0[-1].astype(np.int64)) - self.last.offset_ns
