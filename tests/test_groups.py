"""dispatch(groups=G) (pyhipa2a.groups): the caller's expert group by group between wait_group and group_done, in
any order, each layout, against the oracle; what groups= refuses. Host backend at 1-4 ranks, and GPUs."""
from __future__ import annotations

import time

import numpy as np
import pytest

from pyhipa2a import A2ATimeoutError

from tests.mpi_harness import BACKENDS, REPO, env_backend, ranks_for, run_case, run_mpi

CASE = "tests.cases.groups_cases:"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("order,row_layout,G", [("forward", "packed", 4), ("reverse", "contiguous/8", 3),
                                                ("shuffled", "by_source", 8), ("shuffled", "contiguous", 1)])
def test_groups(order, row_layout, G, backend):
    run_case(CASE + "case_groups", ranks_for(backend), env_backend(backend), args=(order, row_layout, G),
             timeout=300)


@pytest.mark.parametrize("ranks", [1, 3])
def test_groups_at_other_world_sizes(ranks):
    run_case(CASE + "case_groups", ranks, "host", args=("shuffled", "contiguous/8", 5, 2), timeout=300)


@pytest.mark.parametrize("backend", BACKENDS)
def test_groups_refusals(backend):
    run_case(CASE + "case_groups_refusals", ranks_for(backend), env_backend(backend), timeout=120)


@pytest.mark.gpu
def test_group_done_never_comes():
    run_case(CASE + "case_group_done_never_comes", ranks_for("gpu"), env_backend("gpu"), timeout=120)


def test_groups_across_nodes_refused():
    run_case(CASE + "case_groups_across_nodes_refused", 4, "host", timeout=120)


@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_layer_script(backend):
    """scripts/moe_layer.py: the SwiGLU layer on the contiguous layout, in sequence and overlapped by groups,
    against the dense layer (small shapes: timings are not tested)."""
    pytest.importorskip("torch")
    run = run_mpi([str(REPO / "scripts" / "moe_layer.py"), "--tokens", "24", "--experts-per-rank", "4", "--top-k",
                   "3", "--hidden", "256", "--intermediate", "128", "--groups", "3", "--iters", "1"],
                  ranks_for(backend), env_backend(backend), timeout=300, what="moe_layer.py")
    assert run.stdout.count(": PASS (") == ranks_for(backend) and "moe_layer: PASS" in run.stdout, run.stdout


class _StandingStream:
    """A backend whose combine stream never finishes by itself (as a GPU's stream standing at a wait for a word
    nobody raises). It has no copies and no streams to lend: the bound must touch neither."""
    kind = "stuck"

    def __init__(self):
        self.finished, self.destroyed = False, []

    def activate(self):
        pass

    def stream_done(self, stream):
        return False

    def event_create(self):
        return "event"

    def event_record(self, event, stream):
        assert stream == "combine"

    def event_done(self, event):
        return self.finished

    def event_destroy(self, event):
        self.destroyed.append(event)


def _until(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


@pytest.mark.parametrize("reported", [False, True])
def test_combine_bound_gives_up_on_the_group_the_stream_stands_at(reported):
    """CombineBound (pyhipa2a.groups): past the timeout, with combine's stream at group 2's wait, the host's
    status words name that group (unless an error was reported first), and the done words of groups 2 on are
    raised so the stream drains; groups passed already are left alone. While the stream stands at no wait (in a
    kernel, which bounds itself) nothing is written, and the watchdog looks again later."""
    from pyhipa2a.errors import STATUS_BAD_INDEX, status_error
    from pyhipa2a.groups import CombineBound
    from pyhipa2a.kernels import MAX_GROUPS
    from pyhipa2a.signals import PASSED, WAITING
    backend = _StandingStream()
    G, rank = 4, 3
    words = np.zeros((2, MAX_GROUPS), np.uint32)  # [done, seen]
    done, seen = words
    seen[:G] = PASSED
    status = np.zeros(4, np.uint32)
    if reported:
        status[:] = (STATUS_BAD_INDEX, 0, 5, 99)
    before = status.copy()
    bound = CombineBound(backend, rank, 0.05, 0x1000, words, status)
    try:
        bound.arm("combine", G)
        time.sleep(0.3)  # (several timeouts: the stream is in a kernel, so nothing is given up on)
        assert (done == 0).all() and (status == before).all()
        seen[2] = WAITING
        assert _until(lambda: (done[2:G] == 1).all()), done
        assert (done[:2] == 0).all() and (done[G:] == 0).all()
        if reported:
            assert (status == before).all()
        else:
            assert status.tolist() == [1, rank, 9, 2]
            error = status_error(status, rank, "AllToAll")
            assert isinstance(error, A2ATimeoutError) and error.ranks == (rank,)
            assert "combine waited past the timeout for group_done(2), whose stream never got there" in str(error)
        backend.finished = True
    finally:
        bound.close()
    assert backend.destroyed == ["event"]


def test_combine_bound_leaves_a_finished_combine_alone():
    from pyhipa2a.groups import CombineBound
    from pyhipa2a.kernels import MAX_GROUPS
    from pyhipa2a.signals import WAITING
    backend = _StandingStream()
    backend.finished = True
    words, status = np.zeros((2, MAX_GROUPS), np.uint32), np.zeros(4, np.uint32)
    words[1] = WAITING
    bound = CombineBound(backend, 0, 0.02, 0x1000, words, status)
    bound.arm("combine", 2)
    time.sleep(0.15)
    bound.close()
    assert (words[0] == 0).all() and (status == 0).all()


def test_combine_bound_settles_host_waits():
    """Before a host wait (Health.settle): a pending grouped combine is polled, not waited on. One that finishes
    returns; one given up on whose stream still does not drain raises the call's error within two timeouts."""
    from pyhipa2a.errors import Health
    from pyhipa2a.groups import CombineBound
    from pyhipa2a.kernels import MAX_GROUPS
    from pyhipa2a.signals import PASSED, WAITING
    backend = _StandingStream()
    words, status = np.zeros((2, MAX_GROUPS), np.uint32), np.zeros(4, np.uint32)
    words[1, :3] = (PASSED, WAITING, 0)
    bound = CombineBound(backend, 1, 0.05, 0x1000, words, status)
    health = Health(status, 1)
    health.bound_waits(bound.settle)
    try:
        health.settle(None)  # (nothing pending)
        start = time.monotonic()
        bound.arm("combine", 3)
        with pytest.raises(A2ATimeoutError, match=r"group_done\(1\), whose stream never got there"):
            health.settle(None)
        assert 0.1 <= time.monotonic() - start < 2.0
        assert words[0, :3].tolist() == [0, 1, 1]
        backend.finished = True  # (the stream drained at last)
        health.settle(None)
    finally:
        bound.close()
