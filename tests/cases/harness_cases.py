"""Cases of the test harness itself (tests/mpi_harness.py): what a case sees of its environment."""
from __future__ import annotations

import json
import os


def case_environment(comm, expected: str) -> None:
    """Every rank sees the PYHIPA2A_ variables `expected` (JSON: name -> value, or null for unset)."""
    for name, value in json.loads(expected).items():
        assert os.environ.get(name) == value, (comm.Get_rank(), name, os.environ.get(name), value)
