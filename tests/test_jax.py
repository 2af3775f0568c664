"""pyhipa2a.jax: dispatch and combine inside jax.jit, at 1-4 ranks on the host backend (JAX's CPU platform)
and on GPUs (our kernels on XLA's stream)."""
from __future__ import annotations

import pytest

from tests.mpi_harness import BACKENDS, env_backend, ranks_for, run_case

CASE = "tests.cases.jax_cases:"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["case_jit_step", "case_two_exchanges_in_one_program", "case_dropped_combine_is_refused",
                                  "case_refusals"])
def test_jax(case, backend):
    pytest.importorskip("jax")
    run_case(CASE + case, ranks_for(backend), env_backend(backend), timeout=600)


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_jit_step_at_fewer_ranks(ranks):
    pytest.importorskip("jax")
    run_case(CASE + "case_jit_step", ranks, "host", args=("3",), timeout=600)
