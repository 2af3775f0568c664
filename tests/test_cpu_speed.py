"""scripts/cpu_speed.py, how the bench takes host figures on a CPU at full speed: which CPUs a rank may
pick, that a figure is taken on one CPU of its share and the thread gets its CPUs back after."""
import importlib.util
import os
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("cpu_speed", ROOT / "scripts" / "cpu_speed.py")
cpu_speed = sys.modules["cpu_speed"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cpu_speed)


def test_ranks_that_may_run_anywhere_pick_from_cpus_apart():
    every = list(range(8))
    shares = [cpu_speed.cpu_share([every] * 3, r) for r in range(3)]
    assert shares == [[0, 3, 6], [1, 4, 7], [2, 5]]


def test_ranks_bound_apart_keep_their_own_cpus():
    assert cpu_speed.cpu_share([[0, 1], [2, 3]], 1) == [2, 3]
    assert cpu_speed.cpu_share([[0], [1]], 0) == [0]


def test_more_ranks_than_cpus_leave_a_rank_nothing_to_pick():
    assert cpu_speed.cpu_share([[0, 1]] * 4, 3) == []


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_a_figure_is_the_best_of_its_takes_each_on_one_cpu_of_the_share_and_the_cpus_come_back():
    allowed = os.sched_getaffinity(0)
    fast = cpu_speed.FastCpu(MPI.COMM_SELF)
    assert fast.usable and fast.share == sorted(allowed)
    seen, takes = [], iter([7.0, 3.0, 5.0])
    value, yard = fast.measure(lambda: seen.append(os.sched_getaffinity(0)) or next(takes))
    # (one process: its first pick sets what full speed reads, so at least that take is made)
    assert seen and all(len(cpus) == 1 and cpus <= allowed for cpus in seen), seen
    assert value == min([7.0, 3.0, 5.0][:len(seen)]) and yard > 0
    assert os.sched_getaffinity(0) == allowed
    value, _ = fast.measure(lambda: ("graph", next(iter([4.0]))), key=lambda v: v[1])
    assert value == ("graph", 4.0)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_a_figure_that_raises_gives_the_cpus_back():
    allowed = os.sched_getaffinity(0)
    fast = cpu_speed.FastCpu(MPI.COMM_SELF)
    with pytest.raises(ZeroDivisionError):
        fast.measure(lambda: 1 / 0)
    assert os.sched_getaffinity(0) == allowed


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")
def test_no_figure_where_no_cpu_runs_at_full_speed():
    fast = cpu_speed.FastCpu(MPI.COMM_SELF)
    fast.floor = 1e-6  # (as if full speed had read far faster than any CPU does now)
    called = []
    assert fast.measure(lambda: called.append(1) or 1.0) == (None, None) and not called
    assert os.sched_getaffinity(0) == set(fast.allowed)
