"""scripts/cpu_speed.py, how the bench takes host figures on a CPU at full speed: which CPUs a rank may
pick, that a figure is the best of its takes, each on one CPU of the share, that a CPU slower than the
node's full speed takes none, that the thread gets its CPUs back, and that ranks agree on every take."""
import os

import pytest
from mpi4py import MPI

from tests.mpi_harness import run_case
from tests.script_modules import load_script

cpu_speed = load_script("cpu_speed")
affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="no CPU affinity on this platform")


def test_ranks_that_may_run_anywhere_pick_from_cpus_apart():
    every = list(range(8))
    assert [cpu_speed.cpu_share([every] * 3, r) for r in range(3)] == [[0, 3, 6], [1, 4, 7], [2, 5]]


def test_ranks_bound_apart_keep_their_own_cpus():
    assert cpu_speed.cpu_share([[0, 1], [2, 3]], 1) == [2, 3]
    assert cpu_speed.cpu_share([[0], [1]], 0) == [0]


def test_ranks_bound_alike_in_groups_split_their_group_s_cpus():
    allowed = [[0, 1, 2, 3]] * 2 + [[4, 5, 6, 7]] * 2  # (bound to sockets, say)
    assert [cpu_speed.cpu_share(allowed, r) for r in range(4)] == [[0, 2], [1, 3], [4, 6], [5, 7]]


def test_overlapping_sets_and_more_ranks_than_cpus_leave_a_rank_nothing_to_pick():
    assert cpu_speed.cpu_share([[0, 1, 2], [2, 3]], 0) == [] and cpu_speed.cpu_share([[0, 1, 2], [2, 3]], 1) == []
    assert cpu_speed.cpu_share([[0, 1]] * 4, 3) == []


@affinity
def test_a_figure_is_the_best_of_its_takes_each_on_one_cpu_of_the_share(monkeypatch):
    allowed = os.sched_getaffinity(0)
    fast = cpu_speed.FastCpu(MPI.COMM_SELF, slack=float("inf"))  # (every CPU counts as at full speed)
    assert fast.usable and fast.share == sorted(allowed)
    seen, takes = [], iter([("a", 5.0), ("z", 3.0), ("m", 4.0)])
    value, yard = fast.measure(lambda: seen.append(os.sched_getaffinity(0)) or next(takes), key=lambda v: v[1])
    assert len(seen) == cpu_speed.TRIES and all(len(cpus) == 1 and cpus <= allowed for cpus in seen), seen
    assert value == ("z", 3.0) and yard > 0
    assert os.sched_getaffinity(0) == allowed
    fast.close()


@affinity
def test_no_take_on_cpus_slower_than_the_node_s_full_speed():
    fast = cpu_speed.FastCpu(MPI.COMM_SELF)
    fast.saw(1e-6)  # (as if Python had once run far faster on this node than any CPU does now)
    called = []
    assert fast.measure(lambda: called.append(1) or 1.0) == (None, None) and not called
    assert fast.fastest_yard_us == 1e-6
    fast.close()


@affinity
def test_the_cpus_at_entry_come_back_also_when_a_figure_raises():
    cpus = os.sched_getaffinity(0)
    entry = {min(cpus)}  # (a narrower mask than the one the object was made with)
    fast = cpu_speed.FastCpu(MPI.COMM_SELF, slack=float("inf"))
    os.sched_setaffinity(0, entry)
    try:
        with pytest.raises(ZeroDivisionError):
            fast.measure(lambda: 1 / 0)
        assert os.sched_getaffinity(0) == entry
    finally:
        os.sched_setaffinity(0, cpus)
        fast.close()


@affinity
def test_ranks_agree_on_every_take():
    """Two ranks, one of which has seen a far faster reading: neither takes any figure (a decision made
    per rank would leave one in figure()'s barrier and hang); with every CPU at full speed, both take
    each of the TRIES takes and keep their own best."""
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("two ranks need a CPU each")
    run_case("tests.cases.cpu_speed_cases:case_ranks_agree_on_every_take", 2, "host", timeout=120)
