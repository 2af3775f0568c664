"""dispatch(groups=G) (pyhipa2a.groups): the caller's expert group by group between wait_group and group_done, in
any order, each layout, against the oracle; what groups= refuses. Host backend at 1-4 ranks, and GPUs."""
from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest

from pyhipa2a import A2ATimeoutError

from tests.fakes import StandingStream
from tests.mpi_harness import BACKENDS, REPO, env_backend, ranks_for, run_case, run_mpi

CASE = "tests.cases.groups_cases:"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("order,row_layout,G", [("forward", "packed", 4), ("reverse", "contiguous/8", 3),
                                                ("shuffled", "by_source", 8), ("shuffled", "contiguous", 1)])
def test_groups(order, row_layout, G, backend):
    run_case(CASE + "case_groups", ranks_for(backend), env_backend(backend), args=(order, row_layout, G),
             timeout=300)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("row_layout,G,order,ranks_per_node", [("packed", 3, "reverse", 0),
                                                                ("contiguous", 2, "shuffled", 0),
                                                                ("contiguous/8", 4, "forward", 1)])
def test_groups_captured(row_layout, G, order, ranks_per_node, backend):
    """Grouped calls recorded by capture(), within a node and across (simulated) nodes, each launch a new call."""
    run_case(CASE + "case_groups_captured", ranks_for(backend), env_backend(backend),
             args=(row_layout, G, order, ranks_per_node), timeout=300)


# Posted contributions (PYHIPA2A_POST_MIN_TOKENS: every call here posts; nothing pushed, which these sizes
# would otherwise do): each part of a grouped combine stores its tokens' contributions into their owners'
# memory, and the reduce takes them from there; within a node and across simulated nodes.
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("nodes", [False, True])
def test_groups_posted(nodes, backend):
    ranks = ranks_for(backend)
    run_case(CASE + "case_groups", ranks, env_backend(backend),
             args=("shuffled", "contiguous/8", 3, 2, max(1, ranks // 2) if nodes else 0),
             env={"PYHIPA2A_POST_MIN_TOKENS": "1", "PYHIPA2A_PUSH_MAX_TOKENS": "0"}, timeout=300)


@pytest.mark.gpu
def test_groups_whole_tokens():
    """Rows of three segments on a grid of one block: the grouped dispatch lands whole tokens, then segments
    (the GPU kernel's item order, which the host twin does not model)."""
    run_case(CASE + "case_groups", ranks_for("gpu"), env_backend("gpu"),
             args=("shuffled", "contiguous", 3, 2, 0, 2560, 1), timeout=300)


@pytest.mark.parametrize("ranks", [1, 3])
def test_groups_at_other_world_sizes(ranks):
    run_case(CASE + "case_groups", ranks, "host", args=("shuffled", "contiguous/8", 5, 2), timeout=300)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("row_layout,G,ranks_per_node,arrays_at", [("contiguous/8", 3, 0, "same"),
                                                                    ("contiguous", 2, 0, "new"),
                                                                    ("packed", 2, 0, "new"),
                                                                    ("contiguous", 4, 1, "new")])
def test_groups_repeated(row_layout, G, ranks_per_node, arrays_at, backend):
    """Grouped calls become plans (a fresh ticket each) on the same arrays and on new ones standing in, within a
    node and across."""
    run_case(CASE + "case_groups_repeated", ranks_for(backend), env_backend(backend),
             args=(row_layout, G, ranks_per_node, arrays_at), timeout=300)


@pytest.mark.parametrize("backend", BACKENDS)
def test_groups_refusals(backend):
    run_case(CASE + "case_groups_refusals", ranks_for(backend), env_backend(backend), timeout=120)


@pytest.mark.gpu
@pytest.mark.parametrize("queues,nodes", [(None, False), ("1", False), (None, True), ("1", True)])
def test_group_done_never_comes(queues, nodes):
    """(queues "1": every stream of a rank in one hardware queue, where work queued behind a stuck wait waits
    too, whatever its stream; nodes: simulated nodes of half the ranks)"""
    env = {"CUDA_DEVICE_MAX_CONNECTIONS": queues} if queues else None
    ranks = ranks_for("gpu")
    run_case(CASE + "case_group_done_never_comes", ranks, env_backend("gpu"), timeout=120, env=env,
             args=(max(1, ranks // 2) if nodes else 0,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_failed_rank_sends_no_grouped_parts(backend):
    run_case(CASE + "case_failed_rank_sends_no_grouped_parts", ranks_for(backend), env_backend(backend), timeout=120)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("order,row_layout,G", [("shuffled", "packed", 4), ("reverse", "contiguous/8", 3)])
def test_groups_across_nodes(order, row_layout, G, backend):
    """Simulated nodes of half the ranks (of one rank with two): the node's exchange in groups, its combine's
    parts between the regions' records and the sums' way home."""
    ranks = ranks_for(backend)
    run_case(CASE + "case_groups", ranks, env_backend(backend), args=(order, row_layout, G, 2, max(1, ranks // 2)),
             timeout=300)


@pytest.mark.parametrize("row_align", [128, 16])
@pytest.mark.parametrize("backend", BACKENDS)
def test_moe_layer_script(backend, row_align):
    """scripts/moe_layer.py: the SwiGLU layer on the contiguous layout, in sequence and overlapped by groups,
    against the dense layer (small shapes: timings are not tested)."""
    pytest.importorskip("torch")
    run = run_mpi([str(REPO / "scripts" / "moe_layer.py"), "--tokens", "24", "--experts-per-rank", "4", "--top-k",
                   "3", "--hidden", "256", "--intermediate", "128", "--groups", "3", "--iters", "1",
                   "--row-align", str(row_align)],
                  ranks_for(backend), env_backend(backend), timeout=300, what="moe_layer.py")
    assert run.stdout.count(": PASS (") == ranks_for(backend) and "moe_layer: PASS" in run.stdout, run.stdout


def _until(condition, seconds=5.0):
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def _settle(health, seconds=5.0):
    """health.settle(None) on a thread: what it raised (None: it returned); AssertionError where it still runs
    after `seconds` (a bound that never lets go would hang the caller's wait)."""
    import threading
    outcome = []

    def run():
        try:
            health.settle(None)
            outcome.append(None)
        except BaseException as e:  # (handed to the test)
            outcome.append(e)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"settle() still waits after {seconds} s"
    return outcome[0]


def _health_of(bound, status, rank):
    """The Health whose host waits the bound settles (as an AllToAll's)."""
    from pyhipa2a.errors import Health
    health = Health(status, rank)
    health.bound_waits(bound.settle)
    return health


def _gives_up_naming(health, status, rank, group):
    """settle() raises the bound's timeout naming `group`, which the status words name too."""
    failed = _settle(health)
    assert isinstance(failed, A2ATimeoutError), failed
    assert f"combine's wait for group_done({group}) did not pass" in str(failed)
    assert status.tolist() == [1, rank, 9, group]


def _bound_at(backend, timeout, count, seen, done=(), rank=3, status=(0, 0, 0, 0), streams_watched=False):
    """A CombineBound of a combine of `count` groups begun and armed; the streams' seen words `seen` ("waiting",
    "passed", or None: an earlier combine's mark) and done words `done` as the GPU would have written them; its
    [done, seen] words and its status words."""
    from pyhipa2a.groups import CombineBound
    from pyhipa2a.kernels import MAX_GROUPS
    from pyhipa2a.signals import PASSED
    status = np.array(status, np.uint32)
    bound = CombineBound(backend, rank, timeout, status, streams_watched)
    words = np.frombuffer((ctypes.c_uint32 * (2 * MAX_GROUPS)).from_address(bound.done_words),
                          np.uint32).reshape(2, MAX_GROUPS)
    bound.begin(count)
    waiting, passed = bound.marks()
    words[1, :len(seen)] = [{"waiting": waiting, "passed": passed, None: PASSED}[mark] for mark in seen]
    words[0, :len(done)] = done
    bound.arm("combine")
    return bound, words, status


@pytest.mark.parametrize("reported", [False, True])
def test_combine_bound_gives_up_on_the_group_the_stream_stands_at(reported):
    """CombineBound (pyhipa2a.groups): with combine's stream standing at group 2's wait through two looks a timeout
    apart, the host's status words name that group (unless an error was reported first), and the done words of
    the waits not passed are raised so the stream drains; groups passed already are left alone."""
    from pyhipa2a.errors import STATUS_BAD_INDEX, status_error
    backend = StandingStream()
    first = (STATUS_BAD_INDEX, 0, 5, 99) if reported else (0, 0, 0, 0)
    start = time.monotonic()
    bound, words, status = _bound_at(backend, 0.05, 4, ["passed", "passed", "waiting", None], status=first)
    done = words[0]
    try:
        assert _until(lambda: bound.gave_up is not None), words
        assert bound.gave_up - start >= 0.1  # (two looks)
        assert done[:6].tolist() == [0, 0, 1, 1, 0, 0]
        if reported:
            assert status.tolist() == list(first)
        else:
            assert status.tolist() == [1, 3, 9, 2]
            error = status_error(status, 3, "AllToAll")
            assert isinstance(error, A2ATimeoutError) and error.ranks == (3,)
            assert "combine's wait for group_done(2) did not pass within the timeout" in str(error)
        backend.finished = True
    finally:
        bound.close()
    assert backend.destroyed == ["event", "words"]


def test_a_graph_launch_bounds_its_combine_with_the_graphs_marks():
    """A graph that recorded a grouped combine arms the bound at each launch with that combine's groups and tag
    (Groups.replayed): with an eager grouped combine of another tag begun since, the bound still tells the graph's
    passed waits from its standing one, and raises the standing one's done word alone (a raised word left for
    a wait already passed would let the next combine's part through early)."""
    from pyhipa2a.groups import CombineBound
    from pyhipa2a.kernels import MAX_GROUPS
    backend = StandingStream()
    status = np.zeros(4, np.uint32)
    bound = CombineBound(backend, 3, 0.05, status)
    words = np.frombuffer((ctypes.c_uint32 * (2 * MAX_GROUPS)).from_address(bound.done_words),
                          np.uint32).reshape(2, MAX_GROUPS)
    bound.begin(3)
    graph = bound.begun()
    waiting, passed = bound.marks()
    bound.begin(1)  # (an eager grouped combine, one group, since the capture)
    words[1, :3] = [passed, passed, waiting]  # (the launch's stream stands at group 2's wait)
    bound.arm("combine", graph)
    try:
        assert _until(lambda: bound.gave_up is not None), words
        assert words[0, :3].tolist() == [0, 0, 1]
        assert status.tolist() == [1, 3, 9, 2]
        backend.finished = True
    finally:
        bound.close()


def test_combine_bound_names_the_first_group_not_done_where_no_wait_was_reached():
    """A stream that stands at no wait (still behind other stuck work) is given up on at the second look without
    progress, naming the first group whose done word was never raised (group 0's was: its GEMM got there)."""
    backend = StandingStream()
    bound, words, status = _bound_at(backend, 0.05, 3, [None, None, None], done=(1, 0, 0))
    try:
        assert _until(lambda: status[0] != 0), status
        assert status.tolist() == [1, 3, 9, 1] and words[0, :3].tolist() == [1, 1, 1]
    finally:
        bound.close()
    assert backend.destroyed == []  # (its stream never drained: the words are kept, not freed under it)


def test_a_later_report_keeps_the_hosts_give_up():
    """The host writes its give-up into the status words' mirror alone (no stream may carry it); what then fails
    on the device is its consequence (across nodes: the victim's own wait for a peer's sums, whose exchange it
    held up) and must not replace it there, where the caller reads it (protocol.h's a2a_report; its host twin
    here). A mirror that holds no error takes the first report as before."""
    from pyhipa2a.errors import STATUS_TIMEOUT, WAIT_GROUP_DONE, WAIT_WHAT, status_error
    from pyhipa2a.host_kernels import Status
    sums = next(what for what, name in WAIT_WHAT.items() if name.startswith("sums"))
    first = [STATUS_TIMEOUT, 0, sums, 7]
    for mirror_before, mirror_after, reported in [
            ((STATUS_TIMEOUT, 1, WAIT_GROUP_DONE, 1), [STATUS_TIMEOUT, 1, WAIT_GROUP_DONE, 1], "group_done(1)"),
            ((0, 0, 0, 0), first, "sums between nodes")]:
        words, mirror = np.zeros(4, np.uint32), np.array(mirror_before, np.uint32)
        status = Status(words.ctypes.data, mirror.ctypes.data)
        status.report(*first)
        status.report(STATUS_TIMEOUT, 0, 1, 8)  # (a second report changes neither)
        assert words.tolist() == first and mirror.tolist() == mirror_after
        assert reported in str(status_error(mirror, 1, "AllToAll")), mirror


@pytest.mark.parametrize("watched", [True, False], ids=["watched", "unwatched"])
def test_combine_bound_leaves_a_stream_held_by_no_group_done_to_the_streams_watch(watched):
    """A stream that stands at no wait while every group it has not passed is done is held by no group_done
    (across nodes: NCCL's exchange with a peer that never came, ahead of the waits). Where the streams are
    watched (the NCCL engine's watch, which names that peer) the bound names no group of its own and settle()
    returns to that watch at the second look; unwatched, nothing else bounds the stream: it names the first
    group not passed, and raises a timeout after."""
    backend = StandingStream()
    start = time.monotonic()
    bound, words, status = _bound_at(backend, 0.05, 2, [None, None], done=(1, 1), rank=1,
                                     streams_watched=watched)
    health = _health_of(bound, status, 1)
    try:
        if watched:
            assert _settle(health) is None
            assert 0.1 <= time.monotonic() - start < 2.0  # (two looks)
            assert bound.gave_up is None and (status == 0).all() and words[0, :2].tolist() == [1, 1]
            assert _settle(health, 0.5) is None  # (again at once: the watch has it)
        else:
            _gives_up_naming(health, status, 1, 0)
    finally:
        backend.finished = True
        bound.close()


def test_combine_bound_leaves_a_combine_past_its_waits_to_the_streams_watch():
    """A combine whose waits all passed but whose stream has not finished (a graph's replay, whose event follows
    the whole step: its sums' exchange between nodes, say) is held by no group_done either: where the streams
    are watched, settle() returns to that watch instead of polling an event that only the watch can end."""
    backend = StandingStream()
    bound, words, status = _bound_at(backend, 0.05, 2, ["passed", "passed"], streams_watched=True)
    health = _health_of(bound, status, 3)
    try:
        assert _settle(health) is None
        assert bound.gave_up is None and (status == 0).all()
    finally:
        backend.finished = True
        bound.close()


def test_a_replay_behind_one_left_to_the_watch_past_its_waits_stays_left_to_it():
    """A graph's replay launched behind one left to the streams' watch past its waits (stuck in the sums'
    exchange) writes the marks the first did: the watchdog stays stopped, so the replay stays left to the watch
    too, and settle() returns to it rather than polling an event nothing else would end."""
    backend = StandingStream()
    bound, words, status = _bound_at(backend, 0.05, 2, ["passed", "passed"], streams_watched=True)
    health = _health_of(bound, status, 3)
    try:
        assert _settle(health) is None
        bound.arm("combine", bound.begun())
        assert _settle(health, 1.0) is None and bound.gave_up is None and (status == 0).all()
    finally:
        backend.finished = True
        bound.close()


def test_a_combine_behind_one_left_to_the_watch_is_bounded():
    """The watchdog stops at the look that leaves a combine to the streams' watch; the next combine armed, queued
    behind it (the host ahead of the GPU), starts it again: one whose group_done never comes is given up on two
    looks later, naming that group, and its host wait raises rather than returning at once as the first one's."""
    backend = StandingStream()
    bound, words, status = _bound_at(backend, 0.05, 2, [None, None], done=(1, 1), rank=1, streams_watched=True)
    health = _health_of(bound, status, 1)
    try:
        assert _settle(health) is None  # (the first: left to the watch, at the second look)
        assert bound.gave_up is None and (status == 0).all()
        bound.begin(3)  # the next combine, queued behind it: group 2's group_done never comes
        words[0, :3] = (1, 1, 0)
        bound.arm("combine")
        _gives_up_naming(health, status, 1, 2)
    finally:
        backend.finished = True
        bound.close()


def test_replays_are_not_looked_at_again_after_every_wait_passed():
    """A graph writes the same marks at every replay. Once a look found every wait passed and the watchdog
    stopped, the next replay's launch does not start it again: looks a timeout apart could each catch a replay
    standing at the same group's wait and take two healthy replays for a stream standing still."""
    backend = StandingStream()
    bound, words, status = _bound_at(backend, 0.03, 2, ["passed", "passed"])
    try:
        time.sleep(0.15)  # (two looks: every wait passed, the watchdog stops)
        waiting, _ = bound.marks()
        words[1, 0] = waiting  # the next replay stands at group 0's wait, as every replay may for a while
        bound.arm("combine", bound.begun())
        time.sleep(0.3)
        assert bound.gave_up is None and (status == 0).all()
    finally:
        backend.finished = True
        bound.close()


def test_combine_bound_waits_while_the_stream_moves():
    """A stream that moves between looks (here: passes group 0's wait, then stands at group 1's) is not given up on
    until it stands still for a whole timeout; one whose every wait passed (its reduce runs, bounded by its own
    deadline) never is."""
    from pyhipa2a.signals import PASSED
    backend = StandingStream()
    bound, words, status = _bound_at(backend, 0.3, 2, ["waiting", None])
    try:
        time.sleep(0.45)  # (after the first look)
        words[1, 0], words[1, 1] = words[1, 0] - 1, words[1, 0]  # (passed 0, waiting at 1: tag << 2 | 2 - 1)
        time.sleep(0.3)  # (after the second look, which saw it move; before the third)
        assert bound.gave_up is None and status[0] == 0
        assert _until(lambda: bound.gave_up is not None)
        assert status.tolist() == [1, 3, 9, 1] and words[0, :2].tolist() == [0, 1]
    finally:
        backend.finished = True
        bound.close()
    backend = StandingStream()
    bound, words, status = _bound_at(backend, 0.02, 2, ["passed", "passed"])
    try:
        time.sleep(0.3)  # (many looks)
        assert bound.gave_up is None and (words[0] == 0).all() and (status == 0).all()
        assert words[1, 0] & 3 == PASSED
    finally:
        bound.close()


def test_combine_bound_leaves_a_finished_combine_alone():
    backend = StandingStream()
    backend.finished = True
    bound, words, status = _bound_at(backend, 0.02, 2, ["waiting", "waiting"])
    time.sleep(0.15)
    assert bound.gave_up is None and (words[0] == 0).all() and (status == 0).all()
    bound.close()


def test_combine_bound_settles_host_waits():
    """Before a host wait (Health.settle): a pending grouped combine is polled, not waited on. One given up on
    whose stream still does not drain raises the call's error a timeout after the host gave up on it; one that
    finishes returns."""
    from pyhipa2a.errors import Health
    backend = StandingStream()
    start = time.monotonic()
    bound, words, status = _bound_at(backend, 0.05, 3, ["passed", "waiting", None], rank=1)
    health = Health(status, 1)
    health.bound_waits(bound.settle)
    try:
        with pytest.raises(A2ATimeoutError, match=r"combine's wait for group_done\(1\) did not pass"):
            health.settle(None)
        assert 0.15 <= time.monotonic() - start < 2.0
        assert words[0, :3].tolist() == [0, 1, 1]
        backend.finished = True  # (the stream drained at last)
        health.settle(None)
    finally:
        bound.close()
