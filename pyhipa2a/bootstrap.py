"""MPI plumbing: the node-local communicator and waits that cannot hang."""
from __future__ import annotations

import time

from .errors import A2ATimeoutError, ConfigMismatchError


def _mpi():
    from mpi4py import MPI  # imported lazily so `import pyhipa2a` stays cheap
    return MPI


def world_size(comm=None) -> int:
    """Ranks in `comm` (MPI.COMM_WORLD when None)."""
    return (_mpi().COMM_WORLD if comm is None else comm).Get_size()


def node_comm(comm=None):
    """The ranks of `comm` that share this node. pyhipa2a is single-node: all of them must."""
    MPI = _mpi()
    comm = MPI.COMM_WORLD if comm is None else comm
    local = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    sizes = comm.allgather(local.Get_size())
    if any(s != comm.Get_size() for s in sizes):
        local.Free()
        raise ConfigMismatchError(
            f"pyhipa2a runs on one node: the communicator has {comm.Get_size()} ranks but only "
            f"{sizes[comm.Get_rank()]} share this node")
    return local


def sleep_backoff(attempt: int) -> None:
    """Yield the CPU while waiting: CI runs 8 ranks on 2 cores."""
    time.sleep(0 if attempt < 10 else min(1e-3, 1e-5 * (attempt - 9)))


def bounded_barrier(comm, timeout: float, what: str) -> None:
    """A barrier that raises A2ATimeoutError after `timeout` seconds instead of hanging."""
    request = comm.Ibarrier()
    deadline = time.monotonic() + timeout
    attempt = 0
    while not request.Test():
        if time.monotonic() > deadline:
            raise A2ATimeoutError(
                f"{what}: rank {comm.Get_rank()} waited {timeout:.1f} s at a barrier; "
                f"at least one of the {comm.Get_size()} ranks never arrived")
        sleep_backoff(attempt)
        attempt += 1
