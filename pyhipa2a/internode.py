"""Engines that swap a multi-node call's regions with this rank's counterparts on the other nodes
(pyhipa2a.hierarchy), on the call's stream, in the call's order:
- `NcclEngine`: NCCL/RCCL (pyhipa2a.runtime.nccl). Its kernels' waits are unbounded, so `settle` aborts
  the communicator when a call has not finished within the timeout. An exchange is a group launch (12-18 us
  of host time on two H200s); a repeated leg (a plan's: its kernels and exchanges) launches as one graph
  (`graph_for`), one made per leg and handed each new plan's arguments, which an abort
  destroys: ncclCommAbort returns only once every graph holding the communicator is gone (docs/DESIGN.md).
- `MpiEngine`: mpi4py through host copies, for the host backend and for ranks that share a GPU.
Neither raises for a missing peer: its regions keep an old sequence number, and the kernel that reads
them reports the timeout naming that peer and poisons the call's outputs (kernels_hip/hier.hip).
"""
from __future__ import annotations

import os
import time
import warnings
from typing import NamedTuple

import numpy as np

from .arguments import env_choice
from .bootstrap import poll
from .errors import A2ATimeoutError


class Transfer(NamedTuple):
    """`nbytes` from `send` to `peer` and as many from it into `recv` (both list them in the same order)."""
    peer: int
    send: int
    recv: int
    nbytes: int


class MpiEngine:
    watches_streams = False  # (its exchanges wait on the host, each by its own deadline)
    graphs_kept = 0  # (graph_for records none)
    plan_conditions = ()

    def __init__(self, backend, comm, timeout: float):
        self.backend, self.comm, self.timeout = backend, comm, timeout
        # (on a GPU the host copies wait for the stream, which a graph cannot record)
        self.capturable = backend.kind == "host"
        self._unfinished: list = []  # sends to peers that never came: MPI may still read their buffers

    def exchange(self, transfers: list[Transfer], stream) -> None:
        if self.backend.kind == "host":
            self.backend.enqueue(stream, lambda: self._swap_host(transfers))
            return
        # What the stream wrote must be in before we copy it out. Bounded: a grouped combine's stream waits
        # for the caller's group_done, which the host's bound lifts after a timeout, but a stream stuck
        # behind work nothing lifts (the caller's, in a hardware queue its streams share) would hold the
        # host here for good. Past twice the timeout the call has failed already: nothing crosses, and the
        # peers' waits for this rank's part time out naming it. (The copies below still wait for their
        # own: work stuck in a shared queue between this poll and them would hold them.)
        if not poll(lambda: self.backend.stream_done(stream), time.monotonic() + 2 * self.timeout):
            return
        outgoing = []
        for t in transfers:  # (on our stream: a copy on the null stream would wait for the caller's work there)
            outgoing.append(np.empty(t.nbytes, np.uint8))
            self.backend.copy_to_host(outgoing[-1], t.send, stream)
        for t, data in zip(transfers, self._swap([(t.peer, buf) for t, buf in zip(transfers, outgoing)])):
            if data is not None:
                self.backend.copy_to_device(t.recv, data, stream)

    def _swap_host(self, transfers: list[Transfer]) -> None:
        from .host_kernels import mem
        arrived = self._swap([(t.peer, mem(t.send, (t.nbytes,), np.uint8).copy()) for t in transfers])
        for t, data in zip(transfers, arrived):
            if data is not None:
                mem(t.recv, (t.nbytes,), np.uint8)[:] = data

    def _swap(self, items: list[tuple[int, np.ndarray]]) -> list[np.ndarray | None]:
        """Send each (peer, bytes) and receive as many bytes from that peer: the received arrays, None
        for every transfer of a peer that did not deliver all of its own within the timeout (all or
        nothing per peer: a region whose record came without its rows must not pass for this call's)."""
        tags = _tags_per_peer([peer for peer, _ in items])
        received = [np.empty(data.nbytes, np.uint8) for _, data in items]
        recvs = [self.comm.Irecv(buf, source=peer, tag=tag) for (peer, _), buf, tag in zip(items, received, tags)]
        sends = [self.comm.Isend(data, dest=peer, tag=tag) for (peer, data), tag in zip(items, tags)]
        done = [False] * len(recvs)

        def arrived() -> bool:
            done[:] = [d or r.Test() for d, r in zip(done, recvs)]
            return all(done)

        deadline = time.monotonic() + self.timeout
        if poll(arrived, deadline):  # every peer came, so every send is matched and ends soon
            poll(lambda: all(s.Test() for s in sends), deadline)
        else:
            for d, r in zip(done, recvs):
                if not d:
                    r.Cancel()
                    r.Wait()  # a cancel completes either way; after it MPI no longer writes the buffer
        # Sends to a peer that never came stay alive with their buffers: MPI may still read them.
        self._unfinished = [(s, data) for s, data in self._unfinished if not s.Test()]
        self._unfinished += [(s, data) for s, (_, data) in zip(sends, items) if not s.Test()]
        late = {peer for (peer, _), d in zip(items, done) if not d}
        return [None if peer in late else buf for (peer, _), buf in zip(items, received)]

    def graph_for(self, key, queue) -> None:
        """None: on a GPU the exchanges wait on the host, which a graph cannot record."""
        return None

    def settle(self, stream) -> None:
        """Nothing to watch: every exchange gave up by its own deadline."""

    def abort(self) -> None:
        """Nothing to abort: every exchange gives up by its own deadline."""

    def close(self, broken: bool) -> None:
        """The sends still pending (to a peer that never came) are left to MPI's finalization."""


def _tags_per_peer(peers: list[int]) -> list[int]:
    """Each transfer's MPI tag: its rank among the transfers with the same peer, which both sides list
    in the same order (a position in the whole list differs from side to side with 3 nodes or more)."""
    seen: dict[int, int] = {}
    tags = []
    for peer in peers:
        tags.append(seen.get(peer, 0))
        seen[peer] = tags[-1] + 1
    return tags


# After an abort, what is left on an exchange's stream is ours: kernels that read the regions, then wait for
# the node's peers, each wait bounded by the timeout, a few in a row (calls queued behind a failed one report
# at once). A stream still running this many timeouts later waits for something else.
DRAIN_TIMEOUTS = 3


class NcclEngine:
    capturable = True
    watches_streams = True  # (settle bounds a stream that NCCL's waits hold)

    def __init__(self, backend, comm, timeout: float, communicator=None):
        """`communicator`: an NcclComm made already (tests), else one over `comm`."""
        from .runtime import nccl
        self.backend, self.timeout = backend, timeout
        self._origin = backend.stream_create()  # (graphs are recorded here: the caller's may be another library's)
        self._graphs: dict = {}  # key -> the backend's recorded steps
        self._refused: set = set()  # keys whose recording failed: queued step by step
        try:
            self.nccl = communicator or nccl.NcclComm(nccl.NcclLibrary(nccl.find_library(backend.kind)), comm,
                                                      timeout)
        except BaseException:
            backend.stream_destroy(self._origin)
            raise
        # What a plan that launches this engine's graphs needs to hold: a communicator not aborted (an abort
        # destroys the graphs; close() drops the plans first).
        self.plan_conditions = ((self.nccl, "aborted", False),)

    def graph_for(self, key, queue):
        """The graph of what `queue(stream)` launches (a plan's leg, whose launches differ only in their
        arguments from plan to plan): recorded the first time `key` comes (nothing runs), else handed the
        arguments its packs hold now (a new plan's; launches already queued keep theirs). One launch of about
        6 us instead of 30-60 us of launches, one graph a key for good (a graph made per plan grew device
        memory). None after an abort (the graphs are gone) and where the backend records none (warned once):
        the caller launches step by step."""
        if self.nccl.aborted:
            self._drop_graphs()  # (an abort of the communicator's own watch: ncclCommAbort waits for them)
            return None
        if key in self._refused:
            return None
        graph = self._graphs.get(key)
        if graph is not None:
            graph.rehand()
            return graph
        try:
            graph = self.backend.record_steps(self._origin, queue)
            why = "the backend records no graph"
        except Exception as e:  # (a step it cannot record: the caller's launches raise it again, if it is theirs)
            graph, why = None, f"{type(e).__name__}: {e}"
        if graph is not None and self.nccl.aborted:  # (its exchange was aborted while it recorded)
            graph.close()
            graph, why = None, "the communicator was aborted"
        if graph is None:
            if self.backend.kind != "hip":  # (HIP records none, by design)
                warnings.warn(f"pyhipa2a: the {key} leg between nodes is launched step by step ({why})",
                              RuntimeWarning, stacklevel=2)
            self._refused.add(key)
            return None
        self._graphs[key] = graph
        return graph

    @property
    def graphs_kept(self) -> int:
        return len(self._graphs)

    def _drop_graphs(self) -> None:
        """Destroy the graphs (a launched one is freed once it completes): ncclCommAbort waits for every graph
        that captured the communicator to be gone (two H200s, NCCL 2.28)."""
        graphs, self._graphs = self._graphs, {}
        for graph in graphs.values():
            graph.close()

    def exchange(self, transfers: list[Transfer], stream) -> None:
        """Queue the transfers; a peer that never comes is not raised here (nor after an abort): its
        regions keep an old sequence number, and the kernels that read them report it."""
        from .runtime.nccl import NcclTimeout
        if self.nccl.aborted:
            return
        sends = [(t.peer, t.send, t.nbytes) for t in transfers]
        recvs = [(t.peer, t.recv, t.nbytes) for t in transfers]
        try:
            self.nccl.exchange(sends, recvs, self.backend.stream_handle(stream))
        except NcclTimeout:  # the group launch itself waited for a peer (its first call) past the timeout
            return

    def settle(self, stream) -> None:
        """Wait for `stream` without hanging: abort the communicator when its work has not finished
        `timeout` seconds after this wait began, or NCCL reports an error (the kernels then report). The
        abort ends NCCL's kernels; what is left is ours, each wait bounded by the timeout, unless the stream
        also waits for work outside ours (a producer's stream that never finishes): past DRAIN_TIMEOUTS
        more timeouts this raises A2ATimeoutError, so that no caller goes on to wait for it without a bound."""
        from .runtime.nccl import NcclFailure

        def done() -> bool:
            return self.backend.stream_done(stream)

        def finished() -> bool:
            if done():
                return True
            self.nccl.poll()
            return False
        if not self.nccl.aborted:
            try:
                if poll(finished, time.monotonic() + self.timeout):
                    return
            except NcclFailure:
                pass
        self.abort()  # (idempotent; after the communicator's own watch aborted it, it drops the graphs too)
        if not poll(done, time.monotonic() + DRAIN_TIMEOUTS * self.timeout):
            raise A2ATimeoutError(f"the stream of the exchange between nodes had not finished "
                                  f"{DRAIN_TIMEOUTS * self.timeout:.1f} s after the NCCL communicator was aborted: "
                                  f"it waits for work that never finishes")

    def abort(self) -> None:
        self.nccl.abort()
        self._drop_graphs()

    def close(self, broken: bool) -> None:
        """Finalize the communicator, or abort it where a call failed (`broken`): a peer may have aborted
        its own already, and a finalize would wait for it until the timeout, then raise from close()."""
        self._drop_graphs()
        try:
            if broken:
                self.nccl.abort()
            self.nccl.close()
        finally:
            self.backend.stream_destroy(self._origin)


def default_engine(backend_kind: str, placements: list) -> str:
    """The engine when none is named: MPI on the host backend and where two ranks drive one GPU
    (`placements`: each rank's (machine, device index)), which NCCL refuses; NCCL/RCCL otherwise."""
    return "mpi" if backend_kind == "host" or len(set(placements)) < len(placements) else "nccl"


ENGINES = ("nccl", "mpi")


def asked_engine(name: str | None) -> str | None:
    """AllToAll(engine=), else PYHIPA2A_INTERNODE, else None: default_engine's choice, made once the ranks are
    placed. A name that is no engine raises, within a node too (where none is used), so that one script runs on
    one node or many."""
    if name is None and os.environ.get("PYHIPA2A_INTERNODE"):
        return env_choice("PYHIPA2A_INTERNODE", ENGINES)
    if name is not None and name not in ENGINES:
        raise ValueError(f"engine must be one of {ENGINES} or None, not {name!r}")
    return name


def make_engine(name: str | None, backend, comm, timeout: float, placements: list):
    """The engine `name` (as asked_engine returns it; None: default_engine's for `placements`)."""
    name = name or default_engine(backend.kind, placements)
    if name == "mpi":
        return MpiEngine(backend, comm, timeout)
    if backend.kind == "host":
        raise ValueError("the host backend moves regions between nodes with MPI (engine='mpi')")
    return NcclEngine(backend, comm, timeout)

