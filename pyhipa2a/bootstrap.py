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
VERDICT_TAG = 0x7A2B  # an agreement's messages: a rank's verdict on its own arguments to one setup step


class _Messages:
    """`mine` sent to every other rank of `comm`, and as many bytes received from each, point to point: unlike
    a collective's, a wait that ends early knows who never came. Messages between two ranks match in the order
    they were sent, step by step; a late rank's message is taken by the receive its step posted, kept (with
    its send) in _ABANDONED."""

    def __init__(self, comm, tag: int, mine: bytearray):
        _forget_completed()
        MPI, me = mpi(), comm.Get_rank()
        peers = [r for r in range(comm.Get_size()) if r != me]
        self.heard = {r: bytearray(len(mine)) for r in peers}
        self._sent = [(comm.Isend([mine, MPI.BYTE], dest=r, tag=tag), mine) for r in peers]
        self._waiting = {r: comm.Irecv([self.heard[r], MPI.BYTE], source=r, tag=tag) for r in peers}

    def done(self) -> bool:
        for r in [r for r, request in self._waiting.items() if request.Test()]:
            del self._waiting[r]
        if self._waiting:
            return False
        for request, _ in self._sent:  # (every peer has received ours: they complete)
            request.Wait()
        return True

    def abandon(self) -> list:
        """Keep the requests not completed, with the memory MPI may still read or write, in _ABANDONED; the
        ranks not heard from."""
        _ABANDONED.extend([*self._sent, *((request, self.heard[r]) for r, request in self._waiting.items())])
        return sorted(self._waiting)


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
        arrivals = _Messages(comm, ARRIVAL_TAG, bytearray(0))
        done, late = arrivals.done, arrivals.abandon
    if not poll(done, time.monotonic() + timeout):
        missing = late()
        who = f"rank {missing[0]}" if len(missing) == 1 else f"ranks {missing}"
        raise A2ATimeoutError(f"{what}: rank {comm.Get_rank()} waited {timeout:.1f} s at a barrier; {who} never "
                              "arrived", ranks=tuple(missing))


# A verdict: the step's name, the sender's rank in COMM_WORLD (a node's own communicator numbers its ranks from
# 0), a byte for refused, then the refusal's words.
STEP_BYTES, VERDICT_BYTES = 64, 512
WORLD_AT, REFUSED_AT, WORDS_AT = STEP_BYTES, STEP_BYTES + 4, STEP_BYTES + 5


def _verdict(step: str, refusal: BaseException | None) -> bytearray:
    verdict = bytearray(VERDICT_BYTES)
    named = step.encode()[:STEP_BYTES]
    verdict[:len(named)] = named
    verdict[WORLD_AT:REFUSED_AT] = mpi().COMM_WORLD.Get_rank().to_bytes(4, "little")
    if refusal is not None:
        words = f"{type(refusal).__name__}: {refusal}".encode()[:VERDICT_BYTES - WORDS_AT]
        verdict[REFUSED_AT] = 1
        verdict[WORDS_AT:WORDS_AT + len(words)] = words
    return verdict


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
    mine = _verdict(what, refusal)
    verdicts = _Messages(comm, VERDICT_TAG, mine)
    try:
        if refusal is not None:
            raise refusal
        poll(verdicts.done, math.inf)
    except BaseException:  # (our refusal, or an interrupt: the receives left posted take the peers' verdicts)
        verdicts.abandon()
        _forget_at_exit()
        raise
    # (the peers by their rank in COMM_WORLD, which the errors name: mpirun's numbers)
    theirs = [(int.from_bytes(b[WORLD_AT:REFUSED_AT], "little"), b) for b in verdicts.heard.values()]
    elsewhere = {r: _text(b[:STEP_BYTES]) for r, b in theirs if b[:STEP_BYTES] != mine[:STEP_BYTES]}
    refused = {r: _text(b[WORDS_AT:]) for r, b in theirs if b[REFUSED_AT]}
    if (elsewhere or refused) and undo is not None:
        undo(result)
    if elsewhere:
        raise ConfigMismatchError(f"{what}: " + "; ".join(f"rank {r} is at another step of setup ({step})"
                                                          for r, step in elsewhere.items())
                                  + ": every rank must make the same objects in the same order",
                                  ranks=tuple(elsewhere))
    if refused:
        raise ConfigMismatchError(f"{what}: " + "; ".join(f"rank {r} refused its arguments ({words})"
                                                          for r, words in refused.items()), ranks=tuple(refused))
    return result


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
