"""One rank of an MPI test case: `python tests/run_case.py module:function [args...]`."""
from __future__ import annotations

import importlib
import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import pytest  # noqa: E402
from mpi4py import MPI  # noqa: E402


def main() -> None:
    module, function = sys.argv[1].split(":")
    comm = MPI.COMM_WORLD
    try:
        getattr(importlib.import_module(module), function)(comm, *sys.argv[2:])
    except pytest.skip.Exception as skip:  # every rank decides alike; the harness turns it into a skip
        print(f"[rank {comm.Get_rank()}] SKIPPED: {skip.msg}", flush=True)
        return
    except BaseException:
        print(f"[rank {comm.Get_rank()}] case {sys.argv[1]} failed:", flush=True)
        traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        comm.Abort(1)  # peers may be blocked in a collective: take the whole job down
        os._exit(1)
    print(f"[rank {comm.Get_rank()}] {sys.argv[1]} ok", flush=True)


if __name__ == "__main__":
    main()
