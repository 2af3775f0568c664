"""Failures become errors with a cause: dead peers, bad device inputs, memory that must not grow, security."""
from __future__ import annotations

import os
import socket
import stat

import pytest

from tests.mpi_harness import BACKENDS, REPO, env_backend, gpu_count, ranks_for, run_case, run_mpi

CASE = "tests.cases.reliability_cases:"


def shm_files():
    return {f for f in os.listdir("/dev/shm") if f.startswith("pyhipa2a-")}


@pytest.mark.parametrize("backend", BACKENDS)
def test_peer_death_is_an_error_not_a_hang(backend, tmp_path):
    ranks = ranks_for(backend)
    if ranks < 2:
        pytest.skip("needs two ranks")
    before = shm_files()
    run = run_case(CASE + "case_peer_dies", ranks, env_backend(backend), timeout=120, args=(tmp_path,),
                   allow_rank_death=True)
    reports = {p.name: p.read_text() for p in tmp_path.glob("rank*.txt")}
    assert sorted(reports) == [f"rank{r}.txt" for r in range(ranks - 1)], (reports, run.stdout)
    assert all("PEER-DEATH-DETECTED" in t and "CLOSED" in t for t in reports.values()), reports
    assert shm_files() - before == set()  # the dead rank's heap too: unlinked once mapped


@pytest.mark.parametrize("backend", BACKENDS)
def test_device_checks_indices(backend):
    run_case(CASE + "case_device_checks_indices", ranks_for(backend), env_backend(backend))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("leg", ["dispatch", "combine"])
@pytest.mark.parametrize("on_timeout", ["report", "trap"])
def test_a_skipped_call_leaves_no_readable_output(backend, leg, on_timeout):
    ranks = ranks_for(backend)
    if ranks < 2:
        pytest.skip("needs two ranks")
    dead_context = on_timeout == "trap" and backend != "host"  # those ranks leave without MPI_Finalize
    if dead_context and ranks > gpu_count() and not os.environ.get("PYHIPA2A_TEST_TRAP_SHARED"):
        # Under MPS a client whose kernel traps takes the MPS server down, and with it every later
        # GPU test of the session. PYHIPA2A_TEST_TRAP_SHARED=1 runs it anyway (run it last, alone).
        pytest.skip("ranks share a GPU (MPS): a trap would end the MPS server for the tests after it")
    run = run_case(CASE + "case_skipped_call", ranks, env_backend(backend), timeout=120, args=(leg, on_timeout),
                   allow_rank_death=dead_context)
    if dead_context:  # the exit code is not to be trusted then: every rank must say it got through
        assert run.stdout.count("LEFT-AFTER-TRAP") == ranks, run.stdout


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("row_layout", ["packed", "by_source", "contiguous"])
def test_a_failed_rank_poisons_later_calls(row_layout, backend):
    run_case(CASE + "case_failed_rank_poisons_later_calls", ranks_for(backend), env_backend(backend),
             args=(row_layout,), timeout=120)


@pytest.mark.parametrize("backend", BACKENDS)
def test_contiguous_rows_beyond_R_are_reported(backend):
    run_case(CASE + "case_contiguous_rows_beyond_R", ranks_for(backend), env_backend(backend), timeout=120)


def test_barrier_names_the_late_rank():
    run_case(CASE + "case_barrier_names_the_late_rank", ranks_for("host"), "host", timeout=60)


def test_agreement_waits_and_names_the_refusing_rank():
    run_case(CASE + "case_agreement_waits_and_names_the_refusing_rank", ranks_for("host"), "host", timeout=60)


def test_foreign_non_contiguous():
    """Host arrays stand in for another framework's, so this runs on the host backend only."""
    run_case(CASE + "case_foreign_non_contiguous", ranks_for("host"), "host")


@pytest.mark.parametrize("backend", BACKENDS)
def test_stress_memory_flat(backend):
    ranks = ranks_for(backend)
    calls = "60" if backend == "host" else "2000"
    out = run_mpi([str(REPO / "scripts" / "stress.py"), "--calls", calls, "--churn", "20"], ranks,
                  env_backend(backend), timeout=900)
    # (PASS: every call checked, and no rank's device memory in use grew, --slack 0; it may shrink where
    # ranks share a GPU, whose memory in use is all of theirs)
    assert "stress: PASS" in out.stdout and "growth per rank (bytes): [" in out.stdout, out.stdout


def test_library_opens_no_socket(monkeypatch):
    """Python-level sockets are forbidden while a whole host round runs (MPI's own are its business)."""
    def refuse(*a, **k):
        raise AssertionError("pyhipa2a opened a socket")
    monkeypatch.setattr(socket, "socket", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    run_case("tests.cases.exchange_cases:case_shape", 2, "host",
             args=(4, 2, 64, 8, "float16", "random", "random", 1, 1))
    src = (REPO / "pyhipa2a").rglob("*.py")
    assert not [p for p in src if "import socket" in p.read_text() or "urllib" in p.read_text()]


def test_files_written_are_not_world_writable(tmp_path):
    from tests.script_modules import load_script
    write_trace = load_script("trace").write_trace
    from pyhipa2a.runtime.host import HostBackend
    path = tmp_path / "t.json"
    write_trace(str(path), [], {})
    assert not os.stat(path).st_mode & (stat.S_IWOTH | stat.S_IWGRP)
    backend = HostBackend()
    ptr = backend.malloc_ipc(4096)
    name = backend.ipc_export(ptr).rstrip(b"\0").decode()
    mode = os.stat(f"/dev/shm/{name}").st_mode
    backend.free(ptr)
    assert stat.S_IMODE(mode) == 0o600  # heap memory: only its owner may map it


def test_failure_line_names_any_exception():
    """The scripts gather this line from every rank: an exception with no message must not break it
    (an IndexError there would kill the rank and leave its peers waiting in the gather)."""
    from pyhipa2a.testing import failure_line
    assert failure_line(3, AssertionError()) == "rank 3: AssertionError: "
    assert failure_line(0, ValueError("first\nsecond"), " shape X") == "rank 0 shape X: ValueError: first"


def test_waits_yield_before_they_sleep(monkeypatch):
    """Host-side waits (barriers, the engines between nodes, NCCL's group launches, host kernels) poll with
    bootstrap.sleep_backoff: the first polls only yield the CPU, since time.sleep(0) alone costs 50-75 us
    and made every wait end that long after its cause; later polls sleep longer each time, capped at 1 ms."""
    from pyhipa2a import bootstrap
    yields, sleeps = [], []
    monkeypatch.setattr(bootstrap.os, "sched_yield", lambda: yields.append(1))
    monkeypatch.setattr(bootstrap.time, "sleep", sleeps.append)
    for attempt in range(bootstrap.YIELD_POLLS):
        bootstrap.sleep_backoff(attempt)
    assert len(yields) == bootstrap.YIELD_POLLS and not sleeps
    for attempt in (bootstrap.YIELD_POLLS, bootstrap.YIELD_POLLS + 50, 10**9):
        bootstrap.sleep_backoff(attempt)
    assert len(yields) == bootstrap.YIELD_POLLS
    assert 0 < sleeps[0] < sleeps[1] < sleeps[2] == 1e-3, sleeps
