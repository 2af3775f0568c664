"""Gradients through dispatch and combine against the dense computation's, at several ranks: JAX's
(pyhipa2a.jax, jax.grad inside jit) and PyTorch's (pyhipa2a.torch, autograd)."""
from __future__ import annotations

import pytest

from tests.mpi_harness import BACKENDS, env_backend, ranks_for, run_case


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["tests.cases.jax_cases:case_gradients",
                                  "tests.cases.jax_cases:case_gradients_of_two_layers",
                                  "tests.cases.grad_cases:case_torch_gradients",
                                  "tests.cases.grad_cases:case_torch_gradients_of_two_layers",
                                  "tests.cases.grad_cases:case_torch_failed_dispatch_stays_poisoned"])
def test_gradients(case, backend):
    run_case(case, ranks_for(backend), env_backend(backend), timeout=600)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["case_gradients_refused_with_reasons", "case_eager_dispatch_and_compiled_combine",
                                  "case_combine_traced_apart"])
def test_jax_python_state_of_calls(case, backend):
    pytest.importorskip("jax")
    run_case("tests.cases.jax_cases:" + case, ranks_for(backend), env_backend(backend), timeout=600)


@pytest.mark.parametrize("ranks", [1, 2])
def test_jax_gradients_at_fewer_ranks(ranks):
    pytest.importorskip("jax")
    run_case("tests.cases.jax_cases:case_gradients", ranks, "host", timeout=600)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lib", ["jax", "torch"])
def test_gradients_where_x_needs_none(lib, backend):
    run_case("tests.cases.grad_cases:case_gradients_without_x", ranks_for(backend), env_backend(backend), args=(lib,),
             timeout=600)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["tests.cases.jax_cases:case_gradients",
                                  "tests.cases.grad_cases:case_torch_gradients"])
def test_gradients_of_contiguous_rows(case, backend):
    """The same gradients where the rows are contiguous (expert_offsets; the weights' exchange laid out alike)."""
    run_case(case, ranks_for(backend), env_backend(backend), args=("contiguous/8",), timeout=600)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["rows", "second"])
def test_jax_gradients_where_y_is_stopped(variant, backend):
    pytest.importorskip("jax")
    run_case("tests.cases.jax_cases:case_gradients_where_y_is_stopped", ranks_for(backend), env_backend(backend),
             args=(variant,), timeout=600)
