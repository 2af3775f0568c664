"""pyhipa2a.local: ranks that are devices of one process. LocalComm's collectives on their own; then AllToAll's
ranks made in one process and JaxAllToAll(devices=...) inside shard_map, on the host backend (JAX's CPU
devices, their number forced) and on GPUs."""
from __future__ import annotations

import threading
import time

import pytest

from pyhipa2a.errors import A2AError, A2ATimeoutError
from pyhipa2a.local import each, open_ranks
from tests.mpi_harness import BACKENDS, env_backend, gpu_ranks, run_case

CASE = "tests.cases.local_cases:"


def test_collectives_match_by_order_and_return_every_rank_s_value():
    """allgather, bcast and the barriers of three ranks, each rank a thread, matched by their order."""
    def rank(comm):
        me = comm.Get_rank()
        time.sleep(0.01 * me)  # (ranks come at different times)
        gathered = comm.allgather(me * 10)
        root = comm.bcast(f"from {me}", root=2)
        request = comm.Ibarrier()
        while not request.Test():
            time.sleep(0.001)
        comm.Barrier()
        assert comm.Split_type() is comm and comm.Get_size() == 3
        return gathered, root, comm.allgather(-me)
    results = open_ranks(3, rank)
    assert results == [([0, 10, 20], "from 2", [0, -1, -2])] * 3


def test_a_rank_that_never_comes_is_named_within_the_timeout():
    started = time.monotonic()

    def rank(comm):
        if comm.Get_rank() == 1:
            return None  # (never joins the allgather)
        return comm.allgather(comm.Get_rank())
    with pytest.raises(A2ATimeoutError, match=r"ranks \[1\] never came") as raised:
        open_ranks(2, rank, timeout=0.3)
    assert raised.value.ranks == (1,)
    assert time.monotonic() - started < 5


def test_a_bounded_barrier_names_the_late_rank():
    from pyhipa2a.bootstrap import bounded_barrier

    def rank(comm):
        if comm.Get_rank() == 1:
            time.sleep(0.6)
            bounded_barrier(comm, 5.0, "late")  # (the others have come: it passes)
            return None
        with pytest.raises(A2ATimeoutError, match="late: rank .* waited 0.2 s at a barrier; rank 1 never arrived") as e:
            bounded_barrier(comm, 0.2, "late")
        return e.value.ranks
    assert open_ranks(3, rank) == [(1,), None, (1,)]


def test_a_rank_whose_setup_fails_ends_the_others_and_its_error_is_raised():
    """The other ranks' collectives end at once with its error (no timeout waited out); open_ranks raises the
    failing rank's own error and closes what the others made."""
    closed = []

    class Made:
        def __init__(self, comm):
            comm.allgather(0)
            if comm.Get_rank() == 2:
                raise KeyError("rank 2's own trouble")
            comm.Barrier()

        def close(self):
            closed.append(self)
    started = time.monotonic()
    with pytest.raises(KeyError, match="rank 2's own trouble"):
        open_ranks(3, Made, timeout=30)
    assert time.monotonic() - started < 5 and closed == []  # (the others failed in their barrier: none was made)

    def late(comm):  # a rank that fails after the others are made: they are closed
        if comm.Get_rank() == 0:
            raise ValueError("late")
        return Made.__new__(Made)
    with pytest.raises(ValueError, match="late"):
        open_ranks(3, late)
    assert len(closed) == 2


def test_a_rank_whose_alltoall_setup_fails_is_named_without_a_wait(monkeypatch):
    """AllToAll's own setup on the host backend, rank 1's failing midway: its cleanup's barrier meets the
    others' next collective, which ends the group at once; open_ranks raises rank 1's own error, well within
    the timeout, and leaves no shared memory behind."""
    import pyhipa2a
    from pyhipa2a import intranode
    load = intranode.load_kernels

    def failing(*args, **kwargs):
        if threading.current_thread().name == "pyhipa2a-rank-1":
            raise KeyError("rank 1's own trouble")
        return load(*args, **kwargs)
    monkeypatch.setattr(intranode, "load_kernels", failing)
    started = time.monotonic()
    with pytest.raises(KeyError, match="rank 1's own trouble"):
        open_ranks(3, lambda comm: pyhipa2a.AllToAll(comm, backend="host", num_experts=6, experts_per_token=2,
                                                     hidden_dim=64, max_num_tokens=4, timeout=20))
    assert time.monotonic() - started < 5


def test_each_raises_a_rank_s_own_error_before_the_others_waits_for_it():
    comms = open_ranks(3, lambda comm: comm, timeout=0.5)

    def close(comm):
        if comm.Get_rank() == 2:
            raise RuntimeError("rank 2's own close")
        comm.Barrier()  # (rank 2 never comes: the others time out)
    with pytest.raises(RuntimeError, match="rank 2's own close"):
        each(comms, close)


def test_collectives_in_another_order_are_refused():
    def rank(comm):
        return comm.allgather(1) if comm.Get_rank() == 0 else comm.Barrier()
    with pytest.raises(A2AError, match="every rank must make the same collectives in the same order"):
        open_ranks(2, rank, timeout=5)


def test_each_runs_at_once_and_raises_the_first_error():
    together = threading.Barrier(3, timeout=5)  # (fails unless all three run at once)
    assert each([1, 2, 3], lambda v: (together.wait(), v * 2)[1]) == [2, 4, 6]
    with pytest.raises(ZeroDivisionError):
        each([1, 0, 2], lambda v: 1 / v)
    with pytest.raises(ValueError, match="positive number of ranks"):
        open_ranks(0, lambda comm: None)


@pytest.mark.parametrize("backend", BACKENDS)
def test_alltoall_ranks_in_one_process(backend):
    ranks = 3 if backend == "host" else max(2, gpu_ranks())
    run_case(CASE + "case_alltoall_ranks_in_one_process", 1, env_backend(backend), args=(str(ranks),), timeout=300)


def _cpu_devices(n: int) -> dict:
    return {"XLA_FLAGS": f"--xla_force_host_platform_device_count={n}"}


@pytest.mark.parametrize("backend", BACKENDS)
def test_jax_ranks_are_devices(backend):
    """The step in layouts packed, contiguous and by source, the gradients and the refusals of
    JaxAllToAll(devices=...), in one process (tests/cases/local_cases.py: case_jax_in_turn)."""
    pytest.importorskip("jax")
    run = run_case(CASE + "case_jax_in_turn", 1, env_backend(backend), env=_cpu_devices(3), timeout=600)
    if backend == "host":  # (JAX's CPU devices: every part runs)
        assert run.stdout.count(": passed") == 5, run.stdout


def test_jax_moe_script_on_devices():
    """scripts/jax_moe.py --devices 3: the SwiGLU MoE layer in jit(shard_map) over three ranks that are JAX's
    CPU devices, against the dense oracle."""
    pytest.importorskip("jax")
    from tests.mpi_harness import REPO, run_mpi
    run = run_mpi([str(REPO / "scripts" / "jax_moe.py"), "--devices", "3", "--tokens", "24", "--hidden", "256",
                   "--intermediate", "128", "--iters", "2"], 1, "host", timeout=300, env=_cpu_devices(3),
                  what="jax_moe.py --devices 3")
    assert "3 ranks that are devices: PASS" in run.stdout and "jax_moe: PASS" in run.stdout, run.stdout
