"""Multi-rank case for scripts/cpu_speed.py (run by tests/test_cpu_speed.py under mpiexec)."""
from __future__ import annotations


def case_ranks_agree_on_every_take(comm):
    """FastCpu.measure on two ranks whose figure() holds a barrier and an allreduce, as the bench's do."""
    from tests.script_modules import load_script
    cpu_speed = load_script("cpu_speed")
    rank = comm.Get_rank()

    def figure():
        comm.Barrier()
        return comm.allreduce(rank, op=cpu_speed.MPI.SUM) + 10.0 * rank + next(takes)

    fast = cpu_speed.FastCpu(comm)
    if rank == 1:
        fast.fastest_yard_us = 1e-6  # this rank alone has seen Python run far faster
    takes = iter([3.0, 1.0, 2.0])
    assert fast.measure(figure) == (None, None), "a take made though a rank's CPU was not at full speed"
    fast.close()
    fast = cpu_speed.FastCpu(comm, slack=float("inf"))
    takes = iter([3.0, 1.0, 2.0])
    value, yard = fast.measure(figure)
    assert value == 1.0 + 1.0 + 10.0 * rank and yard > 0, (value, yard)
    fast.close()
