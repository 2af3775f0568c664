"""Run a test case on several MPI ranks from inside one pytest process.

`run_case("tests.cases.heap_cases:case_exchange", ranks=4, backend="host")`
starts `mpiexec -n 4 python tests/run_case.py ...`. Every rank runs the case
function; a rank whose case raises prints its traceback and aborts the whole
job, and a job that outlives `timeout` is killed. Either way the pytest test
fails with every rank's output, within the time limit, never hanging.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
RUNNER = Path(__file__).resolve().parent / "run_case.py"


@lru_cache(maxsize=1)
def mpiexec_prefix() -> tuple[str, ...]:
    exe = os.environ.get("MPIEXEC") or shutil.which("mpiexec") or shutil.which("mpirun")
    if exe is None:
        raise RuntimeError("no mpiexec on PATH: install an MPI (pip install mpich) and mpi4py")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60).stdout
    if "Open MPI" in version or "OpenRTE" in version:
        # As on the GPU machine: no core pinning, shared-memory transport, root allowed.
        return (exe, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "--mca", "pml", "ob1",
                "--mca", "btl", "self,vader", "--mca", "btl_vader_single_copy_mechanism", "none")
    return (exe,)


def run_mpi(argv: list[str], ranks: int, backend: str | None, timeout: float = 300.0, env: dict | None = None,
            allow_rank_death: bool = False, what: str | None = None) -> subprocess.CompletedProcess:
    """`mpiexec -n ranks python argv...` from the repository root, output captured; a job that outlives
    `timeout` is killed (its whole process group) and fails the test, as does a non-zero exit.
    `allow_rank_death`: a rank is meant to die; keep the others running and accept the job's exit code
    (the job itself prints what must be seen)."""
    what = what or " ".join(argv)
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full_env.pop("PYHIPA2A_BACKEND", None)
    if backend:
        full_env["PYHIPA2A_BACKEND"] = backend
    full_env.update(env or {})
    prefix = list(mpiexec_prefix())
    if allow_rank_death:
        prefix += (["--mca", "orte_abort_on_non_zero_status", "0"] if "--allow-run-as-root" in prefix
                   else ["-disable-auto-cleanup"])
    cmd = [*prefix, "-n", str(ranks), sys.executable, *argv]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            env=full_env, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{what} on {ranks} ranks did not finish within {timeout:.0f} s:\n{out}")
    if proc.returncode != 0 and not allow_rank_death:
        raise AssertionError(f"{what} on {ranks} ranks failed (exit {proc.returncode}):\n{out}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, "")


def run_case(case: str, ranks: int, backend: str | None, timeout: float = 300.0, args: tuple = (),
             env: dict | None = None, allow_rank_death: bool = False) -> subprocess.CompletedProcess:
    """One case function of tests/cases on every rank (see run_mpi); a case that skips on a rank skips the test."""
    run = run_mpi([str(RUNNER), case, *map(str, args)], ranks, backend, timeout, env, allow_rank_death, what=case)
    skipped = [line.split("SKIPPED: ", 1)[1] for line in run.stdout.splitlines() if "] SKIPPED: " in line]
    if skipped:
        pytest.skip(skipped[0])
    return run


@lru_cache(maxsize=1)
def gpu_runtime() -> tuple[str | None, int]:
    """(the GPU runtime this machine has, "hip" or "cuda", its device count), or (None, 0)."""
    from pyhipa2a.runtime import _make
    for name in ("hip", "cuda"):
        try:
            n = _make(name).device_count()
        except Exception:
            continue
        if n:
            return name, n
    return None, 0


def gpu_count() -> int:
    return gpu_runtime()[1]


def host_ranks() -> int:
    return int(os.environ.get("PYHIPA2A_TEST_RANKS", "4"))


def gpu_ranks() -> int:
    return int(os.environ.get("PYHIPA2A_TEST_GPU_RANKS", "0")) or gpu_count()


# Parametrize a test over backends: host always, the GPU where one exists.
BACKENDS = [pytest.param("host", id="host"), pytest.param("gpu", id="gpu", marks=pytest.mark.gpu)]


def ranks_for(backend: str) -> int:
    return host_ranks() if backend == "host" else gpu_ranks()


def env_backend(backend: str):
    """PYHIPA2A_BACKEND for the job: 'host', or the GPU's runtime by name. Named, not left to the
    library's search: a rank that cannot open the GPU (an MPS server that a trapped kernel took down,
    say) then fails instead of running a GPU test on the host backend, where it would pass unseen."""
    return "host" if backend == "host" else gpu_runtime()[0]
