"""PyTorch, CuPy and JAX arrays in and out, on GPUs (each case skips where its library is missing)."""
from __future__ import annotations

import pytest

from tests.mpi_harness import BACKENDS, env_backend, ranks_for, run_case

CASE = "tests.cases.framework_cases:"


@pytest.mark.gpu
@pytest.mark.parametrize("producer_order,calls_on", [("protocol", "own"), ("stream", "own"), ("protocol", "current")])
@pytest.mark.parametrize("lib", ["torch", "cupy", "jax"])
def test_framework_arrays_in_and_out(lib, producer_order, calls_on):
    run_case(CASE + "case_framework_arrays", ranks_for("gpu"), env_backend("gpu"),
             args=(lib, producer_order, calls_on), timeout=600)


@pytest.mark.gpu
@pytest.mark.parametrize("calls_on", ["own", "current"])
@pytest.mark.parametrize("lib", ["torch", "cupy"])
@pytest.mark.parametrize("case, timeout", [("case_new_framework_arrays_at_every_call", 600),
                                           ("case_new_framework_arrays_like_the_last", 300)])
def test_new_framework_arrays(case, timeout, lib, calls_on):
    """New arrays at every call: of changing token counts (the full path), and like the last (plans)."""
    run_case(CASE + case, ranks_for("gpu"), env_backend("gpu"), args=(lib, calls_on), timeout=timeout)


@pytest.mark.gpu
def test_new_jax_arrays_at_every_call():
    run_case(CASE + "case_new_jax_arrays_at_every_call", ranks_for("gpu"), env_backend("gpu"), timeout=600)


@pytest.mark.gpu
@pytest.mark.parametrize("calls_on", ["own", "current"])
@pytest.mark.parametrize("lib", ["torch", "jax"])
def test_producer_arrays_seen_before(lib, calls_on):
    run_case(CASE + "case_producer_arrays_seen_before", ranks_for("gpu"), env_backend("gpu"), args=(lib, calls_on),
             timeout=600)




@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("calls_on", ["own", "current"])
@pytest.mark.parametrize("lib", ["torch", "cupy", "jax"])
def test_outputs_in_the_callers_library(lib, calls_on, backend):
    run_case(CASE + "case_outputs_in_the_callers_library", ranks_for(backend), env_backend(backend),
             args=(lib, calls_on), timeout=600)
