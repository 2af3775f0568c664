"""Host figures taken on a CPU at full speed (scripts/bench.py's starred columns).

The device machines are virtual machines whose vCPUs each run Python at full
speed part of the time and at about half speed otherwise, flipping every few
seconds, each on its own (docs/PERFORMANCE.md, thirty-third session: a loop of
100 additions read 1.8-2.2 us or 3.0-4.5 us on the same vCPU seconds apart; two
empty launches 5.2-5.7 or 8.1-9.8, an eager step 8.1-9.2 or 10.7-14.4; and
whole machines differ: full speed read 2.35-2.6 on another). A host figure taken
in a few milliseconds, as the bench's are, reads one state or the other: the
library's cost, or the machine's neighbours'. `FastCpu.measure` takes
a figure a few times, each with each rank's thread moved to the fastest CPU of
its share as measured just before (where that one runs at full speed: as fast as
the fastest reading the rank has seen), and keeps the best take; the thread goes
back to the CPUs it had after.
"""
from __future__ import annotations

import os
import statistics
import time

from mpi4py import MPI

FULL_SPEED = 1.3  # a CPU runs at full speed where its yardstick reads within this of the fastest reading
TRIES = 3  # takes of a figure, each on CPUs picked anew


def yardstick_us(samples: int = 100) -> float:
    """Median time of a fixed piece of Python (100 additions), in us: 1.8-2.2 on the device machines'
    vCPUs at full speed, 3-4.5 at the other times."""
    times = []
    for _ in range(samples):
        t0 = time.perf_counter_ns()
        s = 0
        for i in range(100):
            s += i
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e3


def cpu_share(allowed: list[list[int]], local_rank: int) -> list[int]:
    """The CPUs the rank at `local_rank` among its node's ranks may pick from, given every node rank's
    allowed CPUs: where all ranks may run anywhere alike, every n-th of them from its index (no two
    ranks pick the same CPU); where a launcher bound them apart, its own CPUs. Empty where there are
    fewer CPUs than ranks (two ranks would share one)."""
    mine = allowed[local_rank]
    if all(a == mine for a in allowed):
        return mine[local_rank::len(allowed)]
    return mine


class FastCpu:
    """Each rank's share of its node's CPUs (collective: every rank of comm makes one)."""

    def __init__(self, comm):
        self.comm = comm
        pinnable = hasattr(os, "sched_setaffinity")
        allowed = sorted(os.sched_getaffinity(0)) if pinnable else []
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        try:
            share = cpu_share(node.allgather(allowed), node.Get_rank())
        finally:
            node.Free()
        self.allowed, self.share = allowed, share
        self.usable = comm.allreduce(bool(share), op=MPI.LAND)  # every rank can move, or none measures
        self.floor = float("inf")  # the fastest yardstick this rank has read: what full speed reads here

    def _fastest(self) -> tuple[int, float]:
        best = None
        for cpu in self.share:
            os.sched_setaffinity(0, {cpu})
            yard = yardstick_us(30)
            if best is None or yard < best[1]:
                best = (cpu, yard)
        self.floor = min(self.floor, best[1])
        return best

    def measure(self, figure, key=lambda value: value):
        """The best (smallest key) of TRIES takes of figure(), each with every rank's thread on the fastest
        CPU of its share where all of those run at full speed (within FULL_SPEED of the fastest reading
        each rank has seen), with the slowest rank's yardstick at that take's pick; (None, None) where no
        take found such CPUs, or some rank has none to move to. A CPU can slow down during a take (the
        bench read a step 2x slower on a CPU whose yardstick read full speed before and after): the best
        of several takes is the figure at full speed. Collective, as figure() is."""
        if not self.usable:
            return None, None
        best = None
        try:
            for _ in range(TRIES):
                cpu, yard = self._fastest()
                if not self.comm.allreduce(yard <= FULL_SPEED * self.floor, op=MPI.LAND):
                    continue
                os.sched_setaffinity(0, {cpu})
                value, yard = figure(), self.comm.allreduce(yard, op=MPI.MAX)
                if best is None or key(value) < key(best[0]):
                    best = (value, yard)
            return best or (None, None)
        finally:
            os.sched_setaffinity(0, self.allowed)
