"""Ranks that are devices of one process, as JAX runs a node (one process driving all its GPUs).

    ranks = open_ranks(len(devices), lambda comm: AllToAll(comm, device=devices[comm.Get_rank()], **params))
    ...
    each(ranks, AllToAll.close)

`LocalComm` is an in-process communicator with the few calls of mpi4py's that AllToAll's setup and teardown
make (allgather, bcast, a barrier, the node's communicator). Its collectives wait for every rank, so a rank's
setup must run beside the others': `open_ranks` makes each rank in a thread of its own, and `each` runs a
collective step (close) of every rank at once. Calls between setup and teardown are not collective on the
host: on a GPU one thread may make every rank's calls in turn, as their kernels wait for each other on the
devices. The host backend runs kernels at launch, so there each rank's calls need a thread of their own
(JAX's CPU platform runs each device's part of a program in one).

Collectives are matched by their order on each rank, as MPI's are. A collective waits at most `timeout`
for the other ranks and then raises A2ATimeoutError naming those that never came. A rank whose setup
failed ends the group's waits (GroupEnded) as soon as it returns, or as soon as its cleanup's collective
meets the others' next one (collectives that disagree end the group), and open_ranks raises its error.
"""
from __future__ import annotations

import threading
import time

from .errors import A2ATimeoutError


class GroupEnded(A2ATimeoutError):
    """The collectives of a group of ranks ended: a rank failed, or the ranks' collectives disagreed. To each
    rank its peers will then never come, as after a timeout (cleanup treats it so)."""


class _Group:
    """The state the ranks of one group share: the collectives under way, matched by their sequence number."""

    def __init__(self, size: int, timeout: float):
        self.size, self.timeout = size, timeout
        self.changed = threading.Condition()  # (its lock an RLock: fail() is called with it held too)
        self.rounds: dict[int, _Round] = {}
        self.failure: BaseException | None = None  # the first rank's error that ended the group's collectives
        self.failed_rank = -1

    def join(self, seq: int, kind: str, rank: int, value) -> "_Round":
        with self.changed:
            self._usable()
            r = self.rounds.setdefault(seq, _Round(kind, self.size))
            if r.kind != kind:  # (the others' waits end now, not at their timeout)
                error = GroupEnded(f"LocalComm: rank {rank}'s collective number {seq} is {kind}, another rank's "
                                   f"is {r.kind}: every rank must make the same collectives in the same order")
                self.fail(rank, error)
                raise error
            r.values[rank], r.arrived = value, r.arrived + 1
            self.changed.notify_all()
            return r

    def await_round(self, seq: int, r: "_Round", rank: int, wait: bool) -> bool:
        """Whether every rank joined round `seq`; `wait`: wait for that, at most the group's timeout."""
        deadline = time.monotonic() + self.timeout
        with self.changed:
            while r.arrived < self.size:
                self._usable()
                left = deadline - time.monotonic()
                if not wait:
                    return False
                if left <= 0:
                    missing = [i for i, v in enumerate(r.values) if v is _ABSENT]
                    raise A2ATimeoutError(f"LocalComm: rank {rank} waited {self.timeout:.1f} s at a {r.kind}; "
                                          f"ranks {missing} never came", ranks=tuple(missing))
                self.changed.wait(min(left, 0.05))
            r.left += 1
            if r.left == self.size:  # (everyone has what it needs: the round can go)
                del self.rounds[seq]
            return True

    def fail(self, rank: int, error: BaseException) -> None:
        with self.changed:
            if self.failure is None:
                self.failure, self.failed_rank = error, rank
            self.changed.notify_all()

    def _usable(self) -> None:
        if self.failure is not None:
            raise GroupEnded(f"LocalComm: rank {self.failed_rank} failed ({type(self.failure).__name__}: "
                             f"{self.failure}), which ends every collective of its group", ranks=(self.failed_rank,))


_ABSENT = object()


class _Round:
    def __init__(self, kind: str, size: int):
        self.kind, self.values, self.arrived, self.left = kind, [_ABSENT] * size, 0, 0


class _Request:
    """An Ibarrier's request: Test() says whether every rank has come (mpi4py's name)."""

    def __init__(self, group: _Group, seq: int, r: _Round, rank: int):
        self._group, self._seq, self._round, self._rank, self._done = group, seq, r, rank, False

    def Test(self) -> bool:
        self._done = self._done or self._group.await_round(self._seq, self._round, self._rank, wait=False)
        return self._done

    def Wait(self) -> None:
        self._done = self._done or self._group.await_round(self._seq, self._round, self._rank, wait=True)

    def absent(self) -> list:
        """The ranks that have not come (a snapshot)."""
        with self._group.changed:
            return [i for i, v in enumerate(self._round.values) if v is _ABSENT]


class LocalComm:
    """Rank `rank` of a group of ranks in this process (see the module's doc), with mpi4py's names."""

    def __init__(self, group: _Group, rank: int):
        self._group, self._rank, self._seq = group, rank, 0

    def Get_rank(self) -> int:
        return self._rank

    def Get_size(self) -> int:
        return self._group.size

    def _collective(self, kind: str, value):
        seq, self._seq = self._seq, self._seq + 1
        return seq, self._group.join(seq, kind, self._rank, value)

    def allgather(self, value) -> list:
        seq, r = self._collective("allgather", value)
        self._group.await_round(seq, r, self._rank, wait=True)
        return list(r.values)

    def bcast(self, value, root: int = 0):
        return self.allgather(value)[root]

    def Ibarrier(self) -> _Request:
        seq, r = self._collective("barrier", None)
        return _Request(self._group, seq, r, self._rank)

    def Barrier(self) -> None:
        self.Ibarrier().Wait()

    def Split_type(self, split_type=None, key: int = 0) -> "LocalComm":
        """The ranks that share this rank's machine: every rank of the group (ranks keep their numbers)."""
        return self

    def Free(self) -> None:
        pass  # (Split_type made nothing)


def each(items, step) -> list:
    """[step(item) for item in items], each in a thread of its own, all at once. Raises the first error that
    is not a wait for a peer (a rank's own failure, not the others' waits for it), else the first."""
    items = list(items)
    results, errors = [None] * len(items), [None] * len(items)

    def run(i: int) -> None:
        try:
            results[i] = step(items[i])
        except BaseException as e:  # (handed to the caller below)
            errors[i] = e
    threads = [threading.Thread(target=run, args=(i,), name=f"pyhipa2a-rank-{i}") for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    failed = [e for e in errors if e is not None]
    if failed:
        raise next((e for e in failed if not isinstance(e, A2ATimeoutError)), failed[0])
    return results


def open_ranks(size: int, make, *, timeout: float = 60.0) -> list:
    """[make(comm) for the ranks 0 .. size-1 of a new group], each made in a thread of its own. Where one fails,
    the others' collectives end with its error, those made are closed, and its error is raised."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"open_ranks needs a positive number of ranks, not {size!r}")
    group = _Group(size, timeout)
    made: list = [None] * size

    def make_rank(rank: int) -> None:
        try:
            made[rank] = make(LocalComm(group, rank))
        except BaseException as e:
            group.fail(rank, e)
            raise
    try:
        each(range(size), make_rank)
    except BaseException as e:
        each([m for m in made if m is not None], _close_quietly)
        raise (e if not isinstance(e, GroupEnded) else group.failure or e) from None  # (a rank's own error first)
    return made


def _close_quietly(obj) -> None:
    try:
        obj.close()
    except Exception:  # (cleaning up after the error being raised: the peers' closes may fail with it)
        pass
