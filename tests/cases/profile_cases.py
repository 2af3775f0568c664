"""Multi-rank case for profiling (run by tests/test_profile.py under mpiexec)."""
from __future__ import annotations

import os
import sys


def case_trace(comm, shape, out):
    """Runs scripts/trace.py in this job's ranks (it checks the profiling build against the oracle)."""
    import runpy
    script = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "trace.py")
    sys.argv = [script, "--shape", shape, "--iters", "2", "--out", out]
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
