"""One rank of an MPI test case: `python tests/run_case.py module:function [args...]`.

`python tests/run_case.py --serve`: one rank of a job that runs case after case (tests/mpi_harness.py's pool),
so that a case pays neither the job's start nor its imports (PyTorch's alone is seconds a rank). Rank 0 reads a
request a line from stdin (JSON: case, args) and every rank runs it with its output kept; rank 0 answers with
one line: MARK, then JSON of the case and every rank's output. A case that fails takes the job down as a lone
case does: its rank prints what it wrote and the traceback, and aborts. Each case starts from the environment
variables (with the request's own on top), warning filters and warnings not yet shown that the job started with.
"""
from __future__ import annotations

import contextlib
import gc
import importlib
import io
import json
import os
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402

MARK = "@@run_case "  # (starts the answer's line: nothing a case prints starts so)


def run(comm, case: str, args) -> tuple[str, str]:
    """(status, text) of case(comm, *args) on this rank: ("ok", ""), ("skipped", why) or ("failed", traceback)."""
    module, function = case.split(":")
    try:
        getattr(importlib.import_module(module), function)(comm, *args)
    except pytest.skip.Exception as skip:  # every rank decides alike; the harness turns it into a skip
        return "skipped", skip.msg
    except BaseException:
        return "failed", traceback.format_exc()
    return "ok", ""


def finish(comm, case: str, status: str, text: str, out) -> None:
    """Print the case's outcome on `out`; a failed case takes the whole job down (peers may be blocked in a
    collective)."""
    rank = comm.Get_rank()
    if status == "failed":
        out.write(f"[rank {rank}] case {case} failed:\n{text}")
        out.flush()
        sys.stderr.flush()
        comm.Abort(1)
        os._exit(1)
    out.write(f"[rank {rank}] SKIPPED: {text}\n" if status == "skipped" else f"[rank {rank}] {case} ok\n")
    out.flush()


def next_request(comm):
    """The next request, read by rank 0 (None: the harness closed our stdin). The other ranks wait for it asleep:
    MPI's blocking calls poll (MPICH's do), and idle ranks polling would take the CPUs from whatever the test
    session runs between cases (a job of its own, a build, an in-process test)."""
    line = sys.stdin.readline() if comm.Get_rank() == 0 else None
    arrived = comm.Ibarrier()
    while not arrived.Test():
        time.sleep(1e-3)
    return comm.bcast(json.loads(line) if line and line.strip() else None)


def serve(comm) -> None:
    rank, real_out = comm.Get_rank(), sys.stdout
    while True:
        request = next_request(comm)
        if request is None:  # (the harness closed our stdin: the session is over)
            return
        case, environ, kept, filters = request["case"], dict(os.environ), io.StringIO(), warnings.filters[:]
        for module in list(sys.modules.values()):  # (each case sees its warnings, as in a job of its own)
            registry = getattr(module, "__warningregistry__", None)
            if isinstance(registry, dict):
                registry.clear()
        with contextlib.redirect_stdout(kept), contextlib.redirect_stderr(kept):
            os.environ.update(request["env"])
            status, text = run(comm, case, request["args"])
            os.environ.clear()
            os.environ.update(environ)
            warnings.filters[:] = filters
            gc.collect()  # (objects a case left behind let go of their heaps now, not during a later case)
        if status == "failed":
            real_out.write(kept.getvalue())  # (what the case wrote before it failed)
        finish(comm, case, status, text, real_out if status == "failed" else kept)
        answers = comm.gather(kept.getvalue())
        if rank == 0:
            real_out.write(MARK + json.dumps({"case": case, "output": answers}) + "\n")
            real_out.flush()


def main() -> None:
    comm = MPI.COMM_WORLD
    if sys.argv[1] == "--serve":
        return serve(comm)
    finish(comm, sys.argv[1], *run(comm, sys.argv[1], sys.argv[2:]), sys.stdout)


if __name__ == "__main__":
    main()
