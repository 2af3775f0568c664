"""Run a test case on several MPI ranks from inside one pytest process.

`run_case("tests.cases.heap_cases:case_exchange", ranks=4, backend="host")`
runs the case function on every rank of `mpiexec -n 4 python tests/run_case.py ...`;
a rank whose case raises prints its traceback and aborts the whole job, and a job
that outlives `timeout` is killed. Either way the pytest test fails with the ranks'
output, within the time limit, never hanging.

Cases on the host backend with no rank meant to die, and no environment of their own
but the library's variables (read when an object is made, never at import), run in a
pool: a job of their rank count, kept while the tests ask for that count, that runs
case after case (`run_case.py --serve`), so a case pays neither a job's start nor its
imports.
A case that fails or outlives its time takes its job down, and the next case starts
another. PYHIPA2A_TEST_POOL=0 runs every case in a job of its own; PYHIPA2A_TEST_POOL=gpu
pools the GPU cases too (each then pays a GPU context's start once, not once a case; a
case that passes alone but fails there names what an earlier case left on the GPU).
"""
from __future__ import annotations

import atexit
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
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
    proc = start_mpi(argv, ranks, backend, env, allow_rank_death)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"{what} on {ranks} ranks did not finish within {timeout:.0f} s:\n{out}")
    if proc.returncode != 0 and not allow_rank_death:
        raise AssertionError(f"{what} on {ranks} ranks failed (exit {proc.returncode}):\n{out}")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, "")


def start_mpi(argv: list[str], ranks: int, backend: str | None, env: dict | None = None,
              allow_rank_death: bool = False, stdin=None) -> subprocess.Popen:
    """`mpiexec -n ranks python argv...` started from the repository root in a session of its own, its output
    (stdout and stderr together) a pipe."""
    full_env = dict(os.environ, PYTHONUNBUFFERED="1",
                    PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    full_env.pop("PYHIPA2A_BACKEND", None)
    if backend:
        full_env["PYHIPA2A_BACKEND"] = backend
    full_env.update(env or {})
    prefix = list(mpiexec_prefix())
    if allow_rank_death:
        prefix += (["--mca", "orte_abort_on_non_zero_status", "0"] if "--allow-run-as-root" in prefix
                   else ["-disable-auto-cleanup"])
    return subprocess.Popen([*prefix, "-n", str(ranks), sys.executable, *argv], stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=REPO, env=full_env, start_new_session=True)


class Pool:
    """A job of `ranks` ranks on `backend` that runs case after case (tests/run_case.py --serve)."""
    MARK = "@@run_case "  # (run_case.MARK: the line that answers a case)

    def __init__(self, ranks: int, backend: str):
        self.ranks = ranks
        self.proc = start_mpi([str(RUNNER), "--serve"], ranks, backend, stdin=subprocess.PIPE)
        self._pending = b""  # output read past the last full line

    def run(self, case: str, args: tuple, timeout: float, env: dict) -> subprocess.CompletedProcess:
        """The case's run with `env` set on every rank: its ranks' output, its job's exit code 0; AssertionError
        (the job killed or gone) where it failed or outlived `timeout`."""
        self.proc.stdin.write(json.dumps({"case": case, "args": list(args), "env": env}) + "\n")
        self.proc.stdin.flush()
        deadline, stray = time.monotonic() + timeout, []
        fd = self.proc.stdout.fileno()
        while True:
            while b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                text = line.decode(errors="replace")
                if text.startswith(self.MARK):
                    answer = json.loads(text[len(self.MARK):])
                    return subprocess.CompletedProcess(case, 0, "".join(stray) + "".join(answer["output"]), "")
                stray.append(text + "\n")  # (written outside Python's streams: the MPI library's, say)
            left = deadline - time.monotonic()
            if left <= 0:
                self.close(kill=True)
                raise AssertionError(f"{case} on {self.ranks} ranks did not finish within {timeout:.0f} s:\n"
                                     + "".join(stray) + self._pending.decode(errors="replace"))
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:  # (the job is gone: a case failed and aborted it)
                    self.close(kill=True)
                    raise AssertionError(f"{case} on {self.ranks} ranks failed (exit {self.proc.returncode}):\n"
                                         + "".join(stray) + self._pending.decode(errors="replace"))
                self._pending += chunk

    def close(self, kill: bool = False) -> None:
        try:
            if not kill:
                try:
                    self.proc.stdin.close()  # (the ranks return, and the job ends as a lone case's does)
                    self.proc.wait(timeout=30)
                except (OSError, subprocess.TimeoutExpired):
                    kill = True
            if kill:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                self.proc.wait()
        finally:
            for pipe in (self.proc.stdin, self.proc.stdout):
                try:
                    pipe.close()
                except OSError:
                    pass


_POOLS: dict = {}  # (ranks, backend) -> Pool: one kept at a time (each rank holds its imports' memory)


def pooled(case: str, ranks: int, backend: str, args: tuple, timeout: float, env: dict) -> subprocess.CompletedProcess:
    """The case's run in the pool. One that fails there runs again in a job of its own, for every rank's output
    as it was written (a pooled rank's is kept until the case ends): failing again, that job's failure is
    the test's; passing, the test fails all the same, as a case that depends on what an earlier case left."""
    key = (ranks, backend)
    if key not in _POOLS:
        while _POOLS:
            _POOLS.popitem()[1].close()
        _POOLS[key] = Pool(ranks, backend)
    pool = _POOLS[key]
    try:
        return pool.run(case, args, timeout, env)
    except BaseException as failure:
        pool.close(kill=True)
        del _POOLS[key]
        if not isinstance(failure, AssertionError):
            raise
        pooled_failure = str(failure)
    run_mpi([str(RUNNER), case, *args], ranks, backend, timeout, env, what=case)
    raise AssertionError(f"{case} failed in the pool of jobs but passed in a job of its own: it depends on what "
                         f"an earlier case left in the process. In the pool:\n{pooled_failure}")


@atexit.register
def _close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


def pool_takes(backend: str | None) -> bool:
    """Whether cases on `backend` run in the pool (PYHIPA2A_TEST_POOL: unset, the host's; "gpu", the GPUs'
    too; "0", none)."""
    setting = os.environ.get("PYHIPA2A_TEST_POOL", "")
    if setting not in ("", "0", "gpu"):
        raise ValueError(f"PYHIPA2A_TEST_POOL={setting!r}: choose '0' (no pool) or 'gpu' (GPU cases too)")
    return setting != "0" and (backend == "host" or (setting == "gpu" and backend is not None))


def run_case(case: str, ranks: int, backend: str | None, timeout: float = 300.0, args: tuple = (),
             env: dict | None = None, allow_rank_death: bool = False) -> subprocess.CompletedProcess:
    """One case function of tests/cases on every rank (see run_mpi; in the pool where it may run there); a case
    that skips on a rank skips the test."""
    library_env = all(name.startswith("PYHIPA2A_") and name != "PYHIPA2A_BACKEND" for name in env or {})
    if library_env and not allow_rank_death and pool_takes(backend):
        run = pooled(case, ranks, backend, tuple(map(str, args)), timeout, dict(env or {}))
    else:
        run = run_mpi([str(RUNNER), case, *map(str, args)], ranks, backend, timeout, env, allow_rank_death,
                      what=case)
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


# gpu-mode's benchmark and test shapes, and a test id for each.
SHAPES = json.loads((REPO / "scripts" / "gpumode_all2all.json").read_text())


def shape_id(s) -> str:
    return f"E{s['num_experts']}-k{s['experts_per_token']}-H{s['hidden_dim']}-M{s['max_num_tokens']}"


# Calls of at most PYHIPA2A_PUSH_MAX_TOKENS tokens push their data as tagged words (on sm_90 only their
# contributions: test_exchange.py's test_publish_modes), larger ones stage it for peers to pull; each rank
# chooses for its own call. A combine whose largest source has at least PYHIPA2A_POST_MIN_TOKENS tokens stores
# the contributions that are not pushed into their owners' memory ("posted": beside owners that push).
# (environment, token counts) per mode.
TRANSFER_MODES = {"pull": ({"PYHIPA2A_PUSH_MAX_TOKENS": "0", "PYHIPA2A_POST_MIN_TOKENS": "0"}, "full"),
                  "push": ({"PYHIPA2A_PUSH_MAX_TOKENS": "64", "PYHIPA2A_POST_MIN_TOKENS": "0"}, "full"),
                  "mixed": ({"PYHIPA2A_PUSH_MAX_TOKENS": "8", "PYHIPA2A_POST_MIN_TOKENS": "0"}, "staggered"),
                  "posted": ({"PYHIPA2A_PUSH_MAX_TOKENS": "8", "PYHIPA2A_POST_MIN_TOKENS": "9"}, "staggered")}


def ranks_for(backend: str) -> int:
    return host_ranks() if backend == "host" else gpu_ranks()


def env_backend(backend: str):
    """PYHIPA2A_BACKEND for the job: 'host', or the GPU's runtime by name. Named, not left to the
    library's search: a rank that cannot open the GPU (an MPS server that a trapped kernel took down,
    say) then fails instead of running a GPU test on the host backend, where it would pass unseen."""
    return "host" if backend == "host" else gpu_runtime()[0]
