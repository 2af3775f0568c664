"""MPI plumbing: how ranks lie on nodes, the node-local communicator, and waits that cannot hang."""
from __future__ import annotations

import atexit
import functools
import math
import os
import time
from dataclasses import dataclass

import numpy as np

from .arguments import env_int
from .errors import A2ATimeoutError, ConfigMismatchError
from .local import LocalComm


def mpi():
    from mpi4py import MPI  # imported lazily so `import pyhipa2a` stays cheap
    return MPI


def world_size(comm=None) -> int:
    return (mpi().COMM_WORLD if comm is None else comm).Get_size()


def machine_comm(comm):
    """The ranks of `comm` on this rank's machine, in their order (a communicator the caller frees)."""
    if isinstance(comm, LocalComm):  # (ranks of one process: one machine)
        return comm.Split_type()
    return comm.Split_type(mpi().COMM_TYPE_SHARED, key=comm.Get_rank())


def node_comm(comm=None):
    """The ranks of `comm` that share this node. pyhipa2a is single-node: all of them must."""
    comm = mpi().COMM_WORLD if comm is None else comm
    local = machine_comm(comm)
    sizes = comm.allgather(local.Get_size())
    if any(s != comm.Get_size() for s in sizes):
        local.Free()
        raise ConfigMismatchError(
            f"pyhipa2a runs on one node: the communicator has {comm.Get_size()} ranks but only "
            f"{sizes[comm.Get_rank()]} share this node")
    return local


# Polls that yield before a wait sleeps: sleep(0) costs 50-75 us of timer slack, a yield < 1 us, yet shares the CPU.
YIELD_POLLS = 2000


def sleep_backoff(attempt: int) -> None:
    """Give the CPU away between polls: yield for the first YIELD_POLLS, then sleep longer each time, up to 1 ms."""
    if attempt < YIELD_POLLS:
        os.sched_yield()
    else:
        time.sleep(min(1e-3, 1e-5 * (attempt - YIELD_POLLS + 1)))


def poll(ready, deadline: float) -> bool:
    """Whether `ready()` came true by `deadline` (time.monotonic()), asked with sleep_backoff between."""
    attempt = 0
    while not ready():
        if time.monotonic() > deadline:
            return False
        sleep_backoff(attempt)
        attempt += 1
    return True


ARRIVAL_TAG = 0x7A2A  # a bounded barrier's messages (on our own communicators, or the caller's in tests)


class _Arrivals:
    """A barrier as every rank's empty message to every other: unlike MPI_Ibarrier's, a wait that ends early
    knows who never came. Messages between two ranks match in the order they were sent, barrier by barrier; a
    late rank's message is taken by the receive its barrier posted, kept (with its send) in _ABANDONED."""

    def __init__(self, comm):
        _forget_completed()
        MPI, me = mpi(), comm.Get_rank()
        nothing = [bytearray(0), MPI.BYTE]
        peers = [r for r in range(comm.Get_size()) if r != me]
        self._sent = [comm.Isend(nothing, dest=r, tag=ARRIVAL_TAG) for r in peers]
        self._heard = {r: comm.Irecv(nothing, source=r, tag=ARRIVAL_TAG) for r in peers}

    def done(self) -> bool:
        for r in [r for r, request in self._heard.items() if request.Test()]:
            del self._heard[r]
        if self._heard:
            return False
        for request in self._sent:  # (every peer has received ours: they complete)
            request.Wait()
        return True

    def late(self) -> list:
        _ABANDONED.extend((request, None) for request in [*self._sent, *self._heard.values()])
        return sorted(self._heard)


_ABANDONED: list = []  # (request, the memory it reads or writes) of waits given up on: MPI may still complete them


def _forget_completed() -> None:
    _ABANDONED[:] = [kept for kept in _ABANDONED if not kept[0].Test()]  # (a completed one is freed)


@functools.cache
def _forget_at_exit() -> None:
    """At exit, before MPI is finalized (which warns of requests still held), free the requests given up on as they
    complete, waiting a second at most (a peer's message may be on its way)."""
    def settle():
        poll(lambda: not (_forget_completed() or _ABANDONED), time.monotonic() + 1.0)
    atexit.register(settle)  # (after mpi4py's own: run before it)


def bounded_barrier(comm, timeout: float, what: str) -> None:
    """A barrier that raises A2ATimeoutError naming the ranks that never arrived, after `timeout` seconds,
    instead of hanging."""
    if isinstance(comm, LocalComm):
        request = comm.Ibarrier()
        done, late = request.Test, request.absent
    else:
        arrivals = _Arrivals(comm)
        done, late = arrivals.done, arrivals.late
    if not poll(done, time.monotonic() + timeout):
        missing = late()
        raise A2ATimeoutError(f"{what}: rank {comm.Get_rank()} waited {timeout:.1f} s at a barrier; "
                              f"{_ranks(missing)} never arrived", ranks=tuple(missing))


VERDICT_TAG = 0x7A2B  # an agreement's messages: a rank's verdict on its own arguments to one setup step
# (a verdict: the step's name, the sender's rank in COMM_WORLD (a node's own communicator numbers its ranks
# from 0), a byte for refused, then the refusal's words)
STEP_BYTES, VERDICT_BYTES = 64, 512
WORLD_AT, REFUSED_AT, WORDS_AT = STEP_BYTES, STEP_BYTES + 4, STEP_BYTES + 5


class _Verdicts:
    """Every rank's verdict on its own arguments to one setup step, sent to every other, point to point."""

    def __init__(self, comm, step: str, refusal: BaseException | None):
        _forget_completed()
        MPI, me = mpi(), comm.Get_rank()
        mine = bytearray(VERDICT_BYTES)
        named = step.encode()[:STEP_BYTES]
        mine[:len(named)] = named
        mine[WORLD_AT:REFUSED_AT] = MPI.COMM_WORLD.Get_rank().to_bytes(4, "little")
        if refusal is not None:
            words = f"{type(refusal).__name__}: {refusal}".encode()[:VERDICT_BYTES - WORDS_AT]
            mine[REFUSED_AT] = 1
            mine[WORDS_AT:WORDS_AT + len(words)] = words
        self._step = bytes(mine[:STEP_BYTES])
        peers = [r for r in range(comm.Get_size()) if r != me]
        self._heard = {r: bytearray(VERDICT_BYTES) for r in peers}
        self._sent = [(comm.Isend([mine, MPI.BYTE], dest=r, tag=VERDICT_TAG), mine) for r in peers]
        self._waiting = {r: comm.Irecv([self._heard[r], MPI.BYTE], source=r, tag=VERDICT_TAG) for r in peers}

    def done(self) -> bool:
        for r in [r for r, request in self._waiting.items() if request.Test()]:
            del self._waiting[r]
        if self._waiting:
            return False
        for request, _ in self._sent:
            request.Wait()
        return True

    def elsewhere(self) -> dict:
        """{world rank: the step it is at} of the peers at another step of setup than ours."""
        return {_world(b): _text(b[:STEP_BYTES]) for b in self._heard.values()
                if bytes(b[:STEP_BYTES]) != self._step}

    def refusals(self) -> dict:
        """{world rank: its refusal's words} of the peers that refused their arguments."""
        return {_world(b): _text(b[WORDS_AT:]) for b in self._heard.values() if b[REFUSED_AT]}

    def abandon(self) -> None:
        """Keep the requests not completed, with the memory MPI may still read or write, in _ABANDONED."""
        _ABANDONED.extend([*self._sent, *((request, self._heard[r]) for r, request in self._waiting.items())])
        _forget_at_exit()


def _world(verdict) -> int:
    return int.from_bytes(verdict[WORLD_AT:REFUSED_AT], "little")


def _text(raw) -> str:
    return bytes(raw).rstrip(b"\0").decode(errors="replace")


def agreed(comm, what: str, check, undo=None):
    """`check()` (a rank's own checks of its arguments to the setup step `what`: what it makes), once every rank of
    `comm` has run its own. The step before a setup's collectives: a rank whose arguments are refused would
    otherwise leave the others in an MPI collective for good. Each rank tells every other its verdict and waits for
    theirs, as long as MPI's collectives would (ranks may reach a setup far apart; a rank that never comes leaves
    the others waiting, as before). Raises this rank's own refusal (any Exception its check raised), at once; else
    ConfigMismatchError naming the ranks that refused theirs, in their words (having called `undo(result)` on what
    this rank made), or the ranks at another step of setup."""
    try:
        result, refusal = check(), None
    except Exception as error:  # (any: a rank that sent no verdict would leave the others waiting for good)
        result, refusal = None, error
    if isinstance(comm, LocalComm):  # (a rank's failure there ends its group's collectives: no hang to fear)
        if refusal is not None:
            raise refusal
        return result
    verdicts = _Verdicts(comm, what, refusal)
    if refusal is not None:
        verdicts.abandon()  # (the peers' verdicts land in the receives left posted; ours are on their way)
        raise refusal
    try:
        poll(verdicts.done, math.inf)
    except BaseException:  # (an interrupt: MPI may still write into the receives' memory)
        verdicts.abandon()
        raise
    elsewhere, refused = verdicts.elsewhere(), verdicts.refusals()
    if (elsewhere or refused) and undo is not None:
        undo(result)
    if elsewhere:
        raise ConfigMismatchError(f"{what}: " + "; ".join(f"rank {r} is at another step of setup ({step})"
                                                          for r, step in elsewhere.items())
                                  + ": every rank must make the same objects in the same order",
                                  ranks=tuple(elsewhere))
    if refused:  # (ranks named as COMM_WORLD numbers them: mpirun's)
        raise ConfigMismatchError(f"{what}: " + "; ".join(f"rank {r} refused its arguments ({words})"
                                                          for r, words in refused.items()), ranks=tuple(refused))
    return result


def _ranks(ranks: list) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


@dataclass(frozen=True)
class NodeLayout:
    nodes: int
    ranks_per_node: int
    node: int         # this rank's node
    place: int        # this rank's place in its node
    local_rank: int   # this rank among the ranks of its machine (picks its GPU)


def node_layout(comm=None, ranks_per_node: int | None = None) -> NodeLayout:
    """Collective: `comm`'s nodes, its machines or `ranks_per_node` (PYHIPA2A_RANKS_PER_NODE) consecutive ranks."""
    comm = mpi().COMM_WORLD if comm is None else comm
    if ranks_per_node is None:
        ranks_per_node = env_int("PYHIPA2A_RANKS_PER_NODE")
    rank, world = comm.Get_rank(), comm.Get_size()
    if isinstance(comm, LocalComm) and ranks_per_node not in (None, world):
        raise ValueError(f"ranks_per_node={ranks_per_node}: the ranks of one process are one node of {world}")
    machine = machine_comm(comm)
    local_rank, leader = machine.Get_rank(), machine.bcast(rank, root=0)
    machine.Free()
    leaders = comm.allgather(leader)
    asked = comm.allgather(ranks_per_node)
    if len(set(asked)) > 1:
        raise ConfigMismatchError(f"ranks disagree on ranks_per_node: {asked} (rank by rank)")
    if ranks_per_node is None:
        sizes = {lead: leaders.count(lead) for lead in leaders}
        if len(set(sizes.values())) > 1:
            raise ConfigMismatchError(f"the machines hold different numbers of ranks ({sorted(sizes.values())}); "
                                      "every node must hold as many")
        G = sizes[leader]
    else:
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, (int, np.integer)) or ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be a positive integer, not {ranks_per_node!r}")
        G = int(ranks_per_node)
        if world % G:
            raise ValueError(f"ranks_per_node={G} does not divide the {world} ranks into equal nodes")
    groups = [leaders[n * G:(n + 1) * G] for n in range(world // G)]
    if any(len(set(g)) > 1 for g in groups):
        raise ValueError(f"nodes of {G} consecutive ranks must each lie on one machine (ranks by machine: "
                         f"{leaders}); place the ranks machine by machine")
    return NodeLayout(world // G, G, rank // G, rank % G, local_rank)
