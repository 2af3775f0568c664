"""Calls across nodes (pyhipa2a.hierarchy): ranks split into simulated nodes, checked against the oracle.

Host backend: 4 ranks as 2 nodes of 2 (PYHIPA2A_TEST_RANKS does not apply: the layouts are the
point), one check at 8 ranks as 2 nodes of 4. GPU (marked): one node per GPU, NCCL between them
(PYHIPA2A_INTERNODE=mpi stages through the host instead, for ranks that share a GPU).
"""
from __future__ import annotations

import types

import numpy as np
import pytest

from tests.mpi_harness import BACKENDS, REPO, env_backend, gpu_ranks, run_case, run_mpi

CASE = "tests.cases.hierarchy_cases:"


def layout_for(backend: str) -> tuple[int, int]:
    """(ranks, ranks per node)."""
    return (4, 2) if backend == "host" else (gpu_ranks(), max(1, gpu_ranks() // 2))


# (E per rank, k, H, M, dtype, token counts, where the experts are, fused expert[, fp8 dispatch, the
# object's stream, row layout])
CASES = {
    "fp8_quantize_bf16": (4, 4, 256, 16, "bfloat16", "random", "random", "0", "quantize"),
    "fp8_given": (4, 3, 384, 8, "float16", "full", "other", "0", "given"),
    "random": (4, 4, 256, 16, "float16", "random", "random", "0"),
    "bf16_full": (2, 3, 1000, 8, "bfloat16", "full", "random", "0"),
    "only_other_nodes": (4, 2, 128, 8, "float16", "full", "other", "0"),
    "only_own_node": (4, 2, 128, 8, "float16", "full", "own", "0"),
    "no_tokens": (2, 2, 64, 4, "float16", "empty", "random", "0"),
    "some_ranks_empty": (4, 3, 264, 8, "float16", "some_empty", "random", "0"),
    "k1": (2, 1, 128, 8, "float16", "random", "random", "0"),
    "fused_expert": (4, 4, 512, 16, "float16", "random", "random", "1"),
    "hidden_1001": (2, 2, 1001, 8, "float16", "random", "random", "0"),
    # row_layout="contiguous": a node's rows of each expert in one buffer (fp8 scales with them)
    "contiguous_fused": (4, 4, 256, 16, "float16", "random", "random", "1", "none", "own", "contiguous/8"),
    "contiguous_fp8": (4, 3, 384, 8, "bfloat16", "full", "other", "0", "quantize", "own", "contiguous"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", CASES)
def test_nodes_against_oracle(name, backend):
    ranks, G = layout_for(backend)
    E_per_rank, k, H, M, dtype, counts, where, fused, *fp8 = CASES[name]
    run_case(CASE + "case_nodes", ranks, env_backend(backend),
             args=(G, E_per_rank * ranks, k, H, M, dtype, counts, where, fused, 2, 1, *fp8))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["case_nodes_meta_names_true_source", "case_nodes_x_buffer", "case_nodes_graph",
                                  "case_nodes_bad_inputs",
                                  "case_nodes_launch_sites_made_ahead", "case_nodes_repeated_calls",
                                  "case_nodes_plans_hold_the_engines_conditions",
                                  "case_nodes_teardown_goes_on_after_the_engine_fails"])
def test_nodes_cases(case, backend):
    ranks, G = layout_for(backend)
    run_case(CASE + case, ranks, env_backend(backend), args=(G,))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weights_at", ["combine", "dispatch"])
def test_nodes_new_arrays_at_every_call(weights_at, backend):
    """The loop of new arrays and token counts across nodes: the plans take new arrays like the last."""
    ranks, G = layout_for(backend)
    run_case("tests.cases.calls_cases:case_new_arrays_at_every_call", ranks, env_backend(backend),
             args=(weights_at, "0", G))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["case_weights_sent_then_given_again", "case_new_expert_outputs_at_every_call"])
def test_nodes_new_arrays_of_each_kind(case, backend):
    ranks, G = layout_for(backend)
    run_case("tests.cases.calls_cases:" + case, ranks, env_backend(backend), args=(G,))


@pytest.mark.parametrize("who,leg", [("node", "dispatch"), ("rank", "dispatch"), ("node", "combine")])
def test_node_that_never_arrives_host(who, leg):
    run_case(CASE + "case_nodes_peer_never_arrives", 4, "host", args=(2, who, leg), timeout=240)


def test_three_nodes_host():
    """Three nodes of one rank, and of two: every pair of nodes exchanges (tags and orders per peer)."""
    run_case(CASE + "case_nodes", 3, "host", args=(1, 6, 3, 128, 8, "float16", "random", "random", "0", 2, 3))
    run_case(CASE + "case_nodes", 3, "host", args=(1, 9, 3, 256, 8, "float16", "full", "other", "0", 2, 4, "given"))
    run_case(CASE + "case_nodes", 6, "host", args=(2, 12, 4, 64, 4, "float16", "random", "random", "1", 1, 5))
    # the node's object takes AllToAll(stream="current") (our own arrays: its calls stay on one stream)
    run_case(CASE + "case_nodes", 4, "host", args=(2, 8, 2, 64, 8, "float16", "random", "random", "0", 2, 6,
                                                 "none", "current"))


@pytest.mark.gpu
def test_node_that_never_arrives_gpu():
    ranks, G = layout_for("gpu")
    run_case(CASE + "case_nodes_peer_never_arrives", ranks, None, args=(G, "node"), timeout=240)


@pytest.mark.parametrize("backend", BACKENDS)
def test_stress_across_nodes_memory_flat(backend):
    """scripts/stress.py's calls across nodes: random token counts, every call checked, objects rebuilt, and
    device memory flat (the node-to-node kernels' launch sites are made with the object, not one per token
    count)."""
    ranks, G = layout_for(backend)
    if ranks // G < 2:
        pytest.skip(f"needs two nodes; {ranks} ranks of {G} a node")
    calls = "60" if backend == "host" else "600"
    out = run_mpi([str(REPO / "scripts" / "stress.py"), "--calls", calls, "--churn", "20", "--ranks-per-node", str(G)],
                  ranks, env_backend(backend), timeout=900)
    # (PASS: every call checked, and no rank's device memory in use grew, --slack 0; it may shrink where
    # ranks share a GPU, whose memory in use is all of theirs)
    assert "stress: PASS" in out.stdout and "growth per rank (bytes): [" in out.stdout, out.stdout


def test_bad_ranks_per_node_host():
    run_case(CASE + "case_nodes_bad_config", 4, "host")
    run_case(CASE + "case_nodes_rank_layout", 4, "host")


def test_check_script_two_nodes_of_four_host():
    """check.py at 8 ranks as 2 nodes of 4 (issue 21's host target), on the smaller test shapes."""
    run = run_mpi([str(REPO / "scripts" / "check.py"), "--rounds", "1", "--max-hidden", "2880"], 8, "host",
                  timeout=900, env={"PYHIPA2A_RANKS_PER_NODE": "4"}, what="check.py, 2 nodes of 4")
    rows = [line for line in run.stdout.splitlines() if line.startswith("E=")]
    assert rows and all(" PASS " in r for r in rows), run.stdout
    assert "2 nodes of 4 ranks" in run.stdout and "check: PASS" in run.stdout, run.stdout


class _FakeNccl:
    """Stands in for runtime.nccl.NcclComm: `exchange` times out as a peer that never came makes it."""

    def __init__(self, times_out: bool):
        self.times_out, self.aborted, self.calls, self.polls = times_out, False, [], 0

    def exchange(self, sends, recvs, stream):
        from pyhipa2a.runtime.nccl import NcclTimeout
        self.calls.append((sends, recvs, stream))
        if self.times_out:
            self.aborted = True
            raise NcclTimeout("ncclGroupEnd had not returned")

    def poll(self):
        self.polls += 1

    def abort(self):
        self.aborted = True

    def close(self):
        self.closed_aborted = self.aborted  # (NcclComm.close finalizes a live communicator, joins an abort)


class _FakeStreams:
    """The backend calls an engine makes: a stream that reports done after `busy_polls` polls; streams and
    recorded steps as names, with what was done to them in `log`; `records`: whether record_steps can."""
    kind = "cuda"

    def __init__(self, busy_polls: int, records: bool = True):
        self.busy, self.records, self.log = busy_polls, records, []

    def stream_handle(self, stream):
        return 7

    def stream_create(self):
        return "origin"

    def stream_destroy(self, stream):
        self.log.append(("stream_destroy", stream))

    def record_steps(self, stream, queue):
        if not self.records:
            return None
        queue(stream)  # (taped, nothing run)
        name, log = f"graph {len(self.log)}", self.log
        log.append(("recorded", name, stream))
        return types.SimpleNamespace(rehand=lambda: log.append(("rehand", name)),
                                     close=lambda: log.append(("close", name)))

    def stream_done(self, stream):
        self.busy -= 1
        return self.busy < 0


def _engine(nccl, backend, timeout=0.05):
    from pyhipa2a.internode import NcclEngine
    return NcclEngine(backend, None, timeout, communicator=nccl)  # (no library: the fake stands in)


@pytest.mark.parametrize("fails", [True, False], ids=["call_failed", "call_ok"])
def test_nodes_health_aborts_the_exchange_of_a_call_that_failed_before_it(fails):
    """A host wait across nodes runs the object's bounds, then the engine's watch. Where a bound raises (the
    host gave up on a grouped combine whose stream has not drained), the call's exchange between nodes, queued
    behind the stuck wait, is aborted first: it would otherwise wait without bound for peers that gave up too.
    NodesHealth says the engine watches the streams where it does (NCCL's, not MPI's)."""
    from pyhipa2a import A2ATimeoutError
    from pyhipa2a.bootstrap import NodeLayout
    from pyhipa2a.hierarchy import NodesHealth
    from pyhipa2a.internode import MpiEngine, NcclEngine

    class Engine:
        watches_streams = True

        def __init__(self):
            self.calls = []

        def abort(self):
            self.calls.append("abort")

        def settle(self, stream):
            self.calls.append(("settle", stream))

    engine = Engine()
    health = NodesHealth(np.zeros(4, np.uint32), 1, NodeLayout(2, 1, 1, 0, 1), engine)

    def bound():
        if fails:
            raise A2ATimeoutError("rank 1: combine's wait for group_done(1) did not pass", ranks=(1,))
    health.bound_waits(bound)
    if fails:
        with pytest.raises(A2ATimeoutError, match="group_done"):
            health.settle("s")
        assert engine.calls == ["abort"]
    else:
        health.settle("s")
        assert engine.calls == [("settle", "s")]
    assert health.watches_streams and NcclEngine.watches_streams and not MpiEngine.watches_streams


def test_nccl_engine_leaves_a_late_peer_to_the_kernels():
    """A group launch that times out (a peer that never came) does not raise: the regions keep their old
    sequence number for the kernels to report, and later exchanges of the aborted communicator queue nothing;
    a wait on the stream after the abort polls nothing of it."""
    from pyhipa2a.internode import Transfer
    nccl = _FakeNccl(times_out=True)
    engine = _engine(nccl, _FakeStreams(busy_polls=3))
    transfers = [Transfer(1, 100, 200, 64)]
    engine.exchange(transfers, stream=None)
    assert nccl.calls == [([(1, 100, 64)], [(1, 200, 64)], 7)] and nccl.aborted
    engine.exchange(transfers, stream=None)
    assert len(nccl.calls) == 1
    engine.settle(None)
    assert nccl.polls == 0


@pytest.mark.parametrize("exchanged", [True, False], ids=["eager", "graph_replay"])
@pytest.mark.parametrize("drains", [True, False], ids=["drains", "stuck"])
def test_nccl_engine_watchdog_aborts_a_stream_past_the_timeout(exchanged, drains):
    """settle() polls NCCL while the stream runs and, `timeout` seconds after the wait began, aborts the
    communicator, after eager calls and after graph replays (which queue no exchange from the host) alike;
    then it waits, bounded, for the stream to drain, and raises where it does not (it waits for work
    outside ours), so that synchronize() never goes on to wait for it."""
    import time
    from pyhipa2a import A2ATimeoutError
    from pyhipa2a.internode import DRAIN_TIMEOUTS, Transfer
    nccl = _FakeNccl(times_out=False)

    class Streams(_FakeStreams):
        def stream_done(self, stream):  # (drains once the communicator is aborted, or never)
            return drains and nccl.aborted

    engine = _engine(nccl, Streams(busy_polls=0), timeout=0.05)
    if exchanged:
        engine.exchange([Transfer(0, 1, 2, 8)], stream=None)
    start = time.monotonic()
    if drains:
        engine.settle(None)
        assert 0.05 <= time.monotonic() - start < 5
    else:
        with pytest.raises(A2ATimeoutError, match="had not finished [0-9.]+ s after the NCCL communicator was abort"):
            engine.settle(None)
        assert 0.05 * (1 + DRAIN_TIMEOUTS) <= time.monotonic() - start < 5
    assert nccl.aborted and nccl.polls > 0


def test_nccl_engine_watchdog_spares_a_stream_that_finishes():
    """Work queued long ago that finishes while the host waits is no reason to abort."""
    nccl = _FakeNccl(times_out=False)
    engine = _engine(nccl, _FakeStreams(busy_polls=3), timeout=0.05)
    engine.settle(None)
    assert not nccl.aborted and nccl.polls == 3


def test_nccl_engine_keeps_one_graph_a_leg_handed_each_new_plans_arguments_until_an_abort():
    """A key's first plan records its graph (on the engine's own stream, where nothing runs); a later plan of
    the key gets the same graph, handed its packs' arguments again, and no new graph is made. A plan needs the
    communicator not aborted (its graph launches from C). An abort destroys the graphs (ncclCommAbort waits for
    them), and plans launch step by step from then on."""
    nccl, backend = _FakeNccl(times_out=False), _FakeStreams(busy_polls=0)
    engine, queued = _engine(nccl, backend), []
    graphs = [engine.graph_for("dispatch", queued.append) for _ in range(3)]
    assert graphs[0] is graphs[1] is graphs[2] and queued == ["origin"] and engine.graphs_kept == 1
    assert backend.log == [("recorded", "graph 0", "origin"), ("rehand", "graph 0"), ("rehand", "graph 0")]
    engine.graph_for("combine", queued.append)
    assert engine.graphs_kept == 2 and engine.plan_conditions == ((nccl, "aborted", False),)
    engine.abort()
    assert {e for e in backend.log[-2:]} == {("close", "graph 0"), ("close", "graph 3")} and engine.graphs_kept == 0
    assert engine.graph_for("dispatch", queued.append) is None and queued == ["origin"] * 2


def test_nccl_engine_records_no_graph_where_the_backend_cannot():
    engine, queued = _engine(_FakeNccl(times_out=False), _FakeStreams(busy_polls=0, records=False)), []
    with pytest.warns(RuntimeWarning, match="the dispatch leg between nodes is launched step by step"):
        assert engine.graph_for("dispatch", queued.append) is None
    assert engine.graph_for("dispatch", queued.append) is None  # (refused for good: not asked again)
    assert queued == [] and engine.graphs_kept == 0


def test_nccl_engine_drops_its_graphs_once_the_communicator_aborted_itself():
    """The communicator's own watch aborts it (a group launch past the timeout) without the engine: the next
    plan, or a recording during which that happened, leaves no graph holding the communicator."""
    nccl, backend = _FakeNccl(times_out=False), _FakeStreams(busy_polls=0)
    engine = _engine(nccl, backend)
    engine.graph_for("dispatch", lambda s: None)
    nccl.aborted = True
    assert engine.graph_for("dispatch", lambda s: None) is None
    assert backend.log[-1] == ("close", "graph 0") and engine.graphs_kept == 0
    nccl2, backend2 = _FakeNccl(times_out=True), _FakeStreams(busy_polls=0)
    engine2 = _engine(nccl2, backend2)
    from pyhipa2a.internode import Transfer
    with pytest.warns(RuntimeWarning, match="the communicator was aborted"):
        assert engine2.graph_for("combine", lambda s: engine2.exchange([Transfer(1, 1, 2, 8)], s)) is None
    assert [e[0] for e in backend2.log] == ["recorded", "close"] and engine2.graphs_kept == 0


def test_nccl_engine_close_destroys_its_graphs_before_the_communicator():
    events = []

    class Nccl(_FakeNccl):
        def close(self):
            events.append("communicator closed")

    class Backend(_FakeStreams):
        def record_steps(self, stream, queue):
            return types.SimpleNamespace(launch=lambda s: None, close=lambda: events.append("graph closed"))

        def stream_destroy(self, stream):
            events.append(f"{stream} destroyed")
    engine = _engine(Nccl(times_out=False), Backend(busy_polls=0))
    engine.graph_for("dispatch", lambda s: None)
    engine.close(broken=False)
    assert events == ["graph closed", "communicator closed", "origin destroyed"]


@pytest.mark.parametrize("broken", [False, True])
def test_nccl_engine_aborts_at_close_after_a_failed_call(broken):
    """After a failed call a peer may have aborted its communicator, and NCCL's finalize may wait for it:
    a broken object's close aborts instead of finalizing; a healthy one finalizes."""
    nccl = _FakeNccl(times_out=False)
    _engine(nccl, _FakeStreams(busy_polls=0)).close(broken)
    assert nccl.closed_aborted is broken


class _FakeRequest:
    def __init__(self, done: bool):
        self.done, self.cancelled = done, False

    def Test(self):
        return self.done

    def Cancel(self):
        self.cancelled = True

    def Wait(self):
        self.done = True


class _FakeComm:
    """Sends complete at once; a receive completes unless its (source, tag) is in `missing`."""

    def __init__(self, missing=()):
        self.missing, self.recvs = set(missing), []

    def Irecv(self, buf, source, tag):
        buf[:] = source + 1
        self.recvs.append((source, tag))
        return _FakeRequest((source, tag) not in self.missing)

    def Isend(self, data, dest, tag):
        return _FakeRequest(True)


def test_mpi_engine_tags_per_peer_and_all_or_nothing():
    """Tags count each peer's transfers (both sides list them in the same order); a peer that delivers
    only part of its transfers in time delivers none (its record must not pass for this call's)."""
    import numpy as np
    from pyhipa2a.internode import MpiEngine
    comm = _FakeComm(missing={(2, 0)})  # peer 2's first transfer (the rows) never comes; its record does
    engine = MpiEngine(_FakeStreams(0), comm, timeout=0.01)
    items = [(1, np.zeros(4, np.uint8)), (2, np.zeros(4, np.uint8)), (1, np.zeros(2, np.uint8)),
             (2, np.zeros(2, np.uint8))]
    got = engine._swap(items)
    assert comm.recvs == [(1, 0), (2, 0), (1, 1), (2, 1)]
    assert [g is None for g in got] == [False, True, False, True]
    assert (got[0] == 2).all() and (got[2] == 2).all()


@pytest.mark.parametrize("drains", [True, False], ids=["drains", "stuck"])
def test_mpi_engine_copies_out_once_the_stream_drains_and_never_waits_for_it_unbounded(drains):
    """The GPU's bytes are copied out once the stream has finished, on that stream (not the null stream,
    which would wait for the caller's work there); a stream that never finishes is given up on after
    twice the timeout, with nothing sent, and the peers' waits for this rank's part name it."""
    import time
    from pyhipa2a.internode import MpiEngine, Transfer
    copies = []

    class Streams(_FakeStreams):
        def copy_to_host(self, dst, src, stream=None):
            copies.append(("out", src, stream, self.busy < 0))  # (drained by then)

        def copy_to_device(self, dst, src, stream=None):
            copies.append(("in", dst, stream, self.busy < 0))

    comm = _FakeComm()
    engine = MpiEngine(Streams(busy_polls=2 if drains else 10**9), comm, timeout=0.05)
    start = time.monotonic()
    engine.exchange([Transfer(1, 100, 200, 4)], stream="ours")
    if drains:
        assert copies == [("out", 100, "ours", True), ("in", 200, "ours", True)] and comm.recvs == [(1, 0)]
    else:
        assert copies == [] and comm.recvs == [] and 0.09 < time.monotonic() - start < 5


def test_default_engine_is_mpi_where_exchange_peers_share_a_gpu():
    """NCCL refuses a communicator with two ranks on one GPU (simulated nodes sharing a GPU under MPS):
    without an engine named, those exchanges go through MPI; distinct GPUs get NCCL/RCCL."""
    from pyhipa2a.internode import default_engine
    assert default_engine("cuda", [("h0", 0), ("h0", 1)]) == "nccl"
    assert default_engine("hip", [("h0", 0), ("h1", 0)]) == "nccl"  # same index, other machines
    assert default_engine("cuda", [("h0", 0), ("h0", 0)]) == "mpi"
    assert default_engine("cuda", [("h0", 0), ("h1", 0), ("h0", 0)]) == "mpi"
    assert default_engine("host", [("h0", 0), ("h0", 1)]) == "mpi"


def test_combine_seal_carries_the_failure_only_the_host_knows():
    """Host twins of hier.hip's seal and sum: combine's seal, sent home with a rank's sums once its node's combine
    is done, holds the rank's status or, where its status words hold no error, their host mirror (the host alone
    writes there when it gives up on a grouped combine); a counterpart that receives a failed seal reports that
    rank and poisons y instead of adding poison in as sums; a rank whose own seal failed poisons its y (the sum
    takes its status from the seal, not from the mirror again)."""
    import numpy as np

    from pyhipa2a.errors import STATUS_BAD_INDEX, STATUS_OK, STATUS_PEER, STATUS_TIMEOUT
    from pyhipa2a.host_kernels import hier
    from pyhipa2a.kernels import HierArgs, HierSumArgs

    status, mirror, sequence = (np.zeros(4, np.uint32) for _ in range(3))
    sequence[0] = 7
    stage = HierArgs(status=status.ctypes.data, mirror=mirror.ctypes.data, sequence=sequence.ctypes.data)
    seals = []
    for device, host in ((STATUS_OK, STATUS_OK), (STATUS_OK, STATUS_TIMEOUT), (STATUS_BAD_INDEX, STATUS_TIMEOUT)):
        status[0], mirror[0] = device, host
        hier.hier_seal(None, stage)
        seals.append(int(sequence[1]))
    assert seals == [STATUS_OK, STATUS_TIMEOUT, STATUS_BAD_INDEX]

    # Node 1's rank in place 0 gets node 0's sums sealed with the mirror's timeout.
    N, M, T, H = 2, 4, 3, 8
    own, partials, out = np.ones((M, H), np.float16), np.ones((N, M, H), np.float16), np.zeros((T, H), np.float16)
    seal = np.zeros((N, 4), np.uint32)
    seal[0] = (7, STATUS_TIMEOUT, 0, 0)
    status[:], mirror[:], sequence[1] = 0, 0, STATUS_OK
    add = HierSumArgs(own=own.ctypes.data, partials=partials.ctypes.data, seals=seal.ctypes.data, out=out.ctypes.data,
                      sequence=sequence.ctypes.data, status=status.ctypes.data, mirror=mirror.ctypes.data, node=1,
                      nodes=N, ranks_per_node=2, place=0, tokens=T, max_tokens=M, hidden=H)
    hier.hier_sum_f16(None, add)
    assert (status[0], status[1]) == (STATUS_PEER, 0), status  # (rank 0: node 0's rank in our place)
    assert (out.view(np.uint16) == 0xFFFF).all()
    seal[0, 1] = STATUS_OK  # the same sums sealed good: added in
    status[:], mirror[:] = 0, 0
    hier.hier_sum_f16(None, add)
    assert status[0] == STATUS_OK and (out == 2).all()
    sequence[1] = STATUS_TIMEOUT  # our own seal failed (the host gave up on our combine): y poisoned, nothing new said
    hier.hier_sum_f16(None, add)
    assert status[0] == STATUS_OK and (out.view(np.uint16) == 0xFFFF).all()
