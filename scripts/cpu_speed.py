"""Host figures taken on a CPU at full speed (scripts/bench.py's starred columns).

The device machines are virtual machines whose vCPUs each run Python at full
speed part of the time and at about half speed otherwise, flipping every few
seconds, each on its own (measured at commit f01bdb7: a loop of
100 additions read 1.8-2.2 us or 2.6-4.5 us on the same vCPU seconds apart; two
empty launches 5.2-5.7 or 8.1-9.8, an eager step 8.1-9.2 or 10.7-14.4; and
whole machines differ: full speed read 2.35-2.6 on another). A host figure taken
in a few milliseconds, as the bench's are, reads one state or the other: the
library's cost, or the machine's neighbours'. `FastCpu.measure` takes a figure a
few times, each with each rank's thread moved to the fastest CPU of its share as
measured just before, where that one runs at full speed, and keeps the best
take; the thread goes back to the CPUs it had after.
"""
from __future__ import annotations

import contextlib
import os
import statistics
import time

from mpi4py import MPI

SLACK = 1.3  # a CPU runs at full speed where its yardstick reads within this factor of the node's fastest reading
TRIES = 3  # takes of a figure, each on CPUs picked anew


def yardstick_us(samples: int = 100) -> float:
    """Median time of a fixed piece of Python (100 additions), in us: 1.8-2.2 on the device machines'
    vCPUs at full speed, 2.6-4.5 at the other times."""
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
    allowed CPUs, such that no two ranks can pick the same CPU: the ranks allowed the same CPUs take every
    n-th of them from their index among those ranks (a launcher that binds ranks apart leaves each its
    own); empty where there are fewer such CPUs than ranks, or where another rank's different CPUs
    overlap the rank's own (which one may pick what cannot be split fairly: none measures)."""
    mine = allowed[local_rank]
    if any(other != mine and set(other) & set(mine) for other in allowed):
        return []
    alike = [rank for rank, other in enumerate(allowed) if other == mine]
    return mine[alike.index(local_rank)::len(alike)]


@contextlib.contextmanager
def cpus_kept():
    """The calling thread's CPUs as they are on entry, given back however the block ends."""
    saved = os.sched_getaffinity(0)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved)


class FastCpu:
    """Each rank's share of its node's CPUs, and the node's fastest yardstick reading: what full speed
    reads on this machine (collective: every rank of comm makes one, and keeps it for its measures)."""

    def __init__(self, comm, slack: float = SLACK):
        self.comm, self.slack = comm, slack
        pinnable = hasattr(os, "sched_setaffinity")
        allowed = sorted(os.sched_getaffinity(0)) if pinnable else []
        self.node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        self.share = cpu_share(self.node.allgather(allowed), self.node.Get_rank())
        self.usable = comm.allreduce(bool(self.share), op=MPI.LAND)  # every rank can move, or none measures
        self.fastest_yard_us = float("inf")
        if self.usable:  # a first look at every CPU of the node, so that no rank takes its own slow CPUs for fast
            with cpus_kept():
                self._fastest()

    def close(self) -> None:
        self.node.Free()

    def _fastest(self) -> tuple[int, float]:
        """The fastest CPU of this rank's share now and its yardstick, leaving the thread on the last
        one; the node's fastest reading is updated (collective over the node)."""
        yards = {}
        for cpu in self.share:
            os.sched_setaffinity(0, {cpu})
            yards[cpu] = yardstick_us(30)
        cpu = min(yards, key=yards.get)
        self.saw(yards[cpu])
        return cpu, yards[cpu]

    def saw(self, yard: float) -> None:
        """A yardstick read elsewhere on this node (collective over the node): full speed may be faster."""
        self.fastest_yard_us = self.node.allreduce(min(self.fastest_yard_us, yard), op=MPI.MIN)

    def measure(self, figure, key=lambda value: value):
        """The best (smallest key) of TRIES takes of figure(), each with every rank's thread on the fastest
        CPU of its share where all of those run at full speed (within `slack` of the node's fastest
        reading), with the slowest rank's yardstick at that take's pick; (None, None) where no take found
        such CPUs, or some rank has none to move to. A CPU can slow down during a take (the bench read a
        step twice as long on a CPU whose yardstick read full speed before and after): the best of several
        takes is the figure at full speed. Collective, as figure() is; `key` may differ between ranks (each
        keeps its own best take). Only the calling thread moves: a thread it starts during a take keeps
        that take's one CPU."""
        if not self.usable:
            return None, None
        best = None
        with cpus_kept():
            for _ in range(TRIES):
                cpu, yard = self._fastest()
                if not self.comm.allreduce(yard <= self.slack * self.fastest_yard_us, op=MPI.LAND):
                    continue
                os.sched_setaffinity(0, {cpu})
                value, yard = figure(), self.comm.allreduce(yard, op=MPI.MAX)
                if best is None or key(value) < key(best[0]):
                    best = (value, yard)
            return best or (None, None)
