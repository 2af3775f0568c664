"""Symmetric-heap self-test: `mpirun -n N python scripts/heap_check.py`.

Every rank writes a rank-specific pattern into its slot of every peer's
array and release-stores a flag there; every rank acquires all flags and
verifies all patterns. Runs on every backend (PYHIPA2A_BACKEND picks one).
Exits non-zero on any mismatch, timeout or error, on every rank.
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mpi4py import MPI  # noqa: E402

from pyhipa2a.selftest import heap_self_test  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--words", type=int, default=1 << 16, help="32-bit words each rank writes to each peer")
    p.add_argument("--rounds", type=int, default=3, help="epochs to run (each with fresh patterns)")
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--backend", default=None)
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    try:
        report = heap_self_test(comm, words=args.words, rounds=args.rounds, timeout=args.timeout,
                                backend=args.backend)
        ok = True
    except Exception as e:  # every rank reports its own failure, then all agree on the verdict
        report, ok = f"rank {comm.Get_rank()}: {type(e).__name__}: {e}", False
    reports = comm.gather(report, root=0)
    all_ok = comm.allreduce(ok, op=MPI.LAND)
    if comm.Get_rank() == 0:
        for line in reports:
            print(line)
        print("heap_check:", "PASS" if all_ok else "FAIL")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
