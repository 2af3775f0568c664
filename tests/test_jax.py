"""pyhipa2a.jax: dispatch and combine inside jax.jit, at 1-4 ranks on the host backend (JAX's CPU platform)
and on GPUs (our kernels on XLA's stream)."""
from __future__ import annotations

import pytest

from tests.mpi_harness import BACKENDS, env_backend, ranks_for, run_case

CASE = "tests.cases.jax_cases:"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["case_jit_step", "case_inside_shard_map", "case_two_exchanges_in_one_program",
                                  "case_dropped_combine_is_refused", "case_refusals",
                                  "case_rows_beyond_counts_under_differentiation",
                                  "case_program_on_another_gpu_is_refused", "case_fp8_given_with_weights",
                                  "case_eager_calls_compile_once"])
def test_jax(case, backend):
    pytest.importorskip("jax")
    run_case(CASE + case, ranks_for(backend), env_backend(backend), timeout=600)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_beyond_counts_under_differentiation_contiguous(backend):
    pytest.importorskip("jax")
    run_case(CASE + "case_rows_beyond_counts_under_differentiation", ranks_for(backend), env_backend(backend),
             args=("contiguous/8",), timeout=600)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("row_layout", ["by_source", "contiguous/8"])
def test_jit_step_rows_laid_out(row_layout, backend):
    """dispatch's results inside jit where the rows are laid out by source or contiguous (their shapes, and
    expert_layout or expert_offsets among the results)."""
    pytest.importorskip("jax")
    run_case(CASE + "case_jit_step", ranks_for(backend), env_backend(backend), args=("3", row_layout), timeout=600)


@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_jit_step_at_fewer_ranks(ranks):
    pytest.importorskip("jax")
    run_case(CASE + "case_jit_step", ranks, "host", args=("3",), timeout=600)


def test_differentiating_is_seen_through_jit_and_scan():
    """dispatch zeroes its rows beyond the counts where a call is traced differentiated: under jax.grad,
    jax.vjp, jax.jvp, with jit or scan inside them; not in a plain jit or an eager call."""
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    from pyhipa2a.jax_grad import differentiating
    seen = []

    def made():  # (a new function each time: JAX caches a traced function's program)
        def f(a):
            seen.append(differentiating())
            return a * 2.0
        return f

    def scanned(a):
        return jax.lax.scan(lambda c, _: (made()(c), None), a, jnp.zeros(2))[0]
    transforms = (lambda a: jax.grad(made())(a), lambda a: jax.grad(jax.jit(made()))(a),
                  lambda a: jax.jit(jax.grad(made()))(a), jax.grad(scanned), lambda a: jax.vjp(made(), a),
                  lambda a: jax.jvp(made(), (a,), (a,)))
    for differentiated, calls in ((True, transforms), (False, (lambda a: made()(a), lambda a: jax.jit(made())(a),
                                                                scanned))):
        for call in calls:
            seen.clear()
            call(jnp.float32(1.0))
            assert seen == [differentiated], (differentiated, seen)


@pytest.mark.parametrize("row_layout", ["packed", "contiguous"])
def test_gpu_programs_keep_every_call(row_layout):
    """What XLA would run on a GPU, lowered here for CUDA (tests/fakes.py: LoweredForGpu): every object's calls
    in every forward and backward program are whole pairs, a dispatch then its combine. JAX drops a GPU call
    whose results go unused (a gradient rule's closing combine was lost that way once, seen only on a GPU);
    the peers' calls would then never pair with this rank's."""
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    from mpi4py import MPI

    from pyhipa2a.jax import JaxAllToAll
    from pyhipa2a.testing import layout_arguments
    from tests.fakes import LoweredForGpu

    E, k, H, M = 4, 2, 64, 8
    stop = jax.lax.stop_gradient
    with JaxAllToAll(MPI.COMM_SELF, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M,
                     backend="host", **layout_arguments(row_layout)) as a2a:
        lowered = LoweredForGpu(a2a)
        x, w = jnp.ones((M, H), jnp.float16), jnp.full((M, k), 0.5, jnp.float32)
        indices = jnp.tile(jnp.arange(k, dtype=jnp.int32), (M, 1))

        def layer(x, w):
            return a2a.combine(a2a.dispatch(x, indices).expert_x, w)

        def rows_with_y_stopped(x, w):  # (dispatch's gradient runs, combine's does not)
            d = a2a.dispatch(x, indices)
            return total(d.expert_x) + total(stop(a2a.combine(d.expert_x, w)))

        def total(v):
            return jnp.sum(v.astype(jnp.float32))

        programs = {
            "forward": lambda x, w: layer(x, w),
            "x and w": jax.grad(lambda x, w: total(layer(x, w)), argnums=(0, 1)),
            "w alone (x raw data)": jax.grad(lambda x, w: total(layer(x, w)), argnums=1),
            "x alone": jax.grad(lambda x, w: total(layer(x, w))),
            "y stopped, a loss on expert_x": jax.grad(rows_with_y_stopped),
            "two layers": jax.grad(lambda x, w: total(layer(layer(x, w), w)), argnums=(0, 1)),
            "scanned layers": jax.grad(lambda x, w: total(jax.lax.scan(lambda v, _: (layer(v, w), None), x,
                                                                       jnp.zeros(2))[0])),
        }
        for name, f in programs.items():
            legs = lowered.legs(f, x, w)
            assert legs.get("exchange"), (name, legs)
            for obj, calls in legs.items():
                assert calls == ["dispatch", "combine"] * (len(calls) // 2) and calls, (name, obj, calls)
