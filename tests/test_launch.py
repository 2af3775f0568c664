"""Kernel launches from a reused argument pack, on every backend (tests/cases/launch_cases.py)."""
from __future__ import annotations

import pytest

from tests.mpi_harness import BACKENDS, env_backend, run_case


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["case_relaunch_takes_new_arguments", "case_capture_keeps_recorded_arguments",
                                  "case_repeater_keeps_its_arguments"])
def test_launch(case, backend):
    run_case(f"tests.cases.launch_cases:{case}", 1, env_backend(backend))
