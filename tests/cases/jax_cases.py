"""Multi-rank cases of pyhipa2a.jax: dispatch and combine inside jax.jit (run under mpiexec by the tests).

On the host backend the calls are the eager ones, through io_callback on JAX's CPU platform; on GPUs they
are our kernels on XLA's stream. Each round draws the whole world's inputs from a seed and checks this
rank's results against pyhipa2a.reference.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from pyhipa2a import reference
from pyhipa2a.testing import check_dispatch_against_oracle, combine_error_against_oracle, draw_world, layout_arguments


def _jax(a2a_backend_is_host: bool):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # (our heap shares the GPU with JAX's pool)
    jax = pytest.importorskip("jax")
    if not a2a_backend_is_host and not any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("JAX has no GPU here")
    return jax, pytest.importorskip("jax.numpy")


def _made(comm, **params):
    import pyhipa2a
    from pyhipa2a.jax import JaxAllToAll
    host = pyhipa2a.get_backend().kind == "host"
    jax, jnp = _jax(host)
    a2a = JaxAllToAll(comm, **params)
    device = jax.devices("cpu")[0] if host else [d for d in jax.devices() if d.platform == "gpu"][a2a.device_index]
    return a2a, jax, jnp, device


def case_jit_step(comm, rounds="5", row_layout="packed"):
    """One jitted function: dispatch, an expert in jnp (expert_x * 2), combine with expert_scale fused;
    called again with new values and new token counts (a retrace each), its results against the oracle:
    y, and the dispatch's rows, counts and meta (and expert_layout or expert_offsets: `row_layout`, a spec of
    layout_arguments)."""
    world = comm.Get_size()
    E, k, H, M = 4 * world, 3, 256, 16
    a2a, jax, jnp, dev = _made(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M,
                               **layout_arguments(row_layout))
    with a2a:
        me = a2a.rank

        @jax.jit
        def step(x, indices, weights):
            d = a2a.dispatch(x, indices)
            y = a2a.combine((d.expert_x * 2).astype(d.expert_x.dtype), weights, expert_scale=0.5 + me)
            return d, y

        for i in range(int(rounds)):
            counts = [(M, 5, M, 1, 0)[i % 5] if r % 2 == 0 else (M, M - 1, 7, 2, M)[i % 5] for r in range(world)]
            inputs = draw_world(40 + i, world, E, k, H, M, token_counts=counts)
            x, idx, w = (jax.device_put(h, dev) for h in (inputs.xs[me], inputs.indices[me], inputs.weights[me]))
            d, y = step(x, idx, w)
            expert = reference.fused_expert([2 * (0.5 + r) for r in range(world)])
            want = reference.combine(inputs.xs, inputs.indices, inputs.weights, E, expert, ranks=[me])[me]
            got = np.asarray(y).astype(np.float64)
            assert got.shape == want.shape, (got.shape, want.shape)
            err = float(np.abs(got - want).max(initial=0.0))
            assert np.allclose(got, want, rtol=1e-2, atol=5e-3), (i, err)
            check_dispatch_against_oracle(a2a, inputs, d)
            print(f"rank {me} round {i}: T={counts[me]} max err {err:.3g}")
        a2a.check()


def case_inside_shard_map(comm):
    """The step inside jax.shard_map over a mesh of the process's one device (how a JAX model marks its
    expert-parallel region), jitted, called with new values twice: y against the oracle, and the same as
    the step jitted alone."""
    from jax.sharding import Mesh, PartitionSpec
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 64, 8
    a2a, jax, jnp, dev = _made(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M)
    with a2a:
        me = a2a.rank

        def step(x, indices, weights):
            return a2a.combine(a2a.dispatch(x, indices).expert_x, weights, expert_scale=0.5 + me)
        mesh, whole = Mesh(np.array([dev]), ("device",)), PartitionSpec()
        sharded = jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(whole,) * 3, out_specs=whole))
        alone = jax.jit(step)
        for i in range(2):
            inputs = draw_world(140 + i, world, E, k, H, M)
            args = [jax.device_put(a[me], dev) for a in (inputs.xs, inputs.indices, inputs.weights)]
            y = np.asarray(sharded(*args)).astype(np.float64)
            expected = reference.combine(inputs.xs, inputs.indices, inputs.weights, E,
                                         reference.fused_expert([0.5 + r for r in range(world)]), ranks=[me])[me]
            assert np.allclose(y, expected, rtol=1e-2, atol=5e-3), (i, float(np.abs(y - expected).max()))
            assert np.array_equal(y, np.asarray(alone(*args)).astype(np.float64)), i
        a2a.check()


def case_two_exchanges_in_one_program(comm):
    """Two dispatch/combine pairs in one jitted function with no data between them (two layers' branches):
    the order words keep each dispatch combined before the next, so both are right; and weights given to
    dispatch (combine takes none)."""
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 128, 8
    a2a, jax, jnp, dev = _made(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M)
    with a2a:
        me = a2a.rank

        @jax.jit
        def two(x1, i1, w1, x2, i2, w2):
            d1 = a2a.dispatch(x1, i1)
            d2_in = (x2, i2)
            y1 = a2a.combine(d1.expert_x, w1)
            d2 = a2a.dispatch(*d2_in, weights=w2)
            y2 = a2a.combine(d2.expert_x)
            return y1, y2

        a = draw_world(70, world, E, k, H, M)
        b = draw_world(71, world, E, k, H, M, token_counts=[3] * world)
        put = [jax.device_put(h, dev) for inputs in (a, b)
               for h in (inputs.xs[me], inputs.indices[me], inputs.weights[me])]
        for inputs, y in zip((a, b), two(*put)):
            identity = reference.fused_expert([1.0] * world)
            want = reference.combine(inputs.xs, inputs.indices, inputs.weights, E, identity,
                                     ranks=[me])[me]
            got = np.asarray(y).astype(np.float64)
            assert np.allclose(got, want, rtol=1e-2, atol=5e-3), np.abs(got - want).max(initial=0.0)
        a2a.check()


def case_dropped_combine_is_refused(comm):
    """A jitted function that combines but never uses y: JAX drops that combine, so the next call's dispatch
    follows an uncombined one. The device refuses it in every block, so its outputs are all poison (no block
    lands a row after them), and the object says why."""
    from pyhipa2a import A2AError
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 128, 8
    if pyhipa2a_backend_is_host():
        pytest.skip("on the host backend each call is an ordered io_callback, which JAX never drops")
    a2a, jax, jnp, dev = _made(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M)
    with pytest.raises(A2AError, match="never combined"):
        with a2a:
            inputs = draw_world(80, world, E, k, H, M)
            x, idx, w = (jax.device_put(h, dev) for h in (inputs.xs[a2a.rank], inputs.indices[a2a.rank],
                                                         inputs.weights[a2a.rank]))

            @jax.jit
            def dispatched_only(x, indices, weights):
                d = a2a.dispatch(x, indices)
                a2a.combine(d.expert_x, weights)  # (its y unused: dropped)
                return d.expert_num_tokens, d.expert_x, d.expert_meta
            jax.block_until_ready(dispatched_only(x, idx, w))
            counts, rows, meta = (np.asarray(r) for r in jax.block_until_ready(dispatched_only(x, idx, w)))
            assert (counts == -1).all() and (meta == -1).all(), (counts, meta)
            assert (rows.view(np.uint16) == 0xFFFF).all(), np.flatnonzero(rows.view(np.uint16) != 0xFFFF)[:8]
            a2a.check()


def pyhipa2a_backend_is_host() -> bool:
    import pyhipa2a
    return pyhipa2a.get_backend().kind == "host"


def case_refusals(comm):
    """Wrong shapes and types, and a dispatch traced again before its combine, raise while tracing, naming the
    argument, before anything runs."""
    from pyhipa2a import A2AError
    world = comm.Get_size()
    a2a, jax, jnp, dev = _made(comm, num_experts=2 * world, experts_per_token=2, hidden_dim=64, max_num_tokens=4)
    with a2a:
        x, idx = jnp.zeros((4, 64), jnp.float16), jnp.zeros((4, 2), jnp.int32)
        with pytest.raises(ValueError, match="x must be"):
            jax.jit(a2a.dispatch)(jnp.zeros((4, 32), jnp.float16), idx)
        with pytest.raises(ValueError, match="max_num_tokens=4"):
            jax.jit(a2a.dispatch)(jnp.zeros((5, 64), jnp.float16), jnp.zeros((5, 2), jnp.int32))
        with pytest.raises(ValueError, match="indices must be"):
            jax.jit(a2a.dispatch)(x, jnp.zeros((4, 2), jnp.int64 if jax.config.jax_enable_x64 else jnp.float32))
        with pytest.raises(TypeError, match="x must be float16"):
            jax.jit(a2a.dispatch)(jnp.zeros((4, 64), jnp.float32), idx)
        with pytest.raises(ValueError, match="expert_y must be"):
            jax.jit(a2a.combine)(jnp.zeros((3, 3), jnp.float16), jnp.zeros((4, 2), jnp.float32))
        # (refused while tracing: nothing of these programs runs)
        with pytest.raises(TypeError, match="needs the weights"):
            jax.jit(lambda x, i: a2a.combine(a2a.dispatch(x, i).expert_x))(x, idx)
        with pytest.raises(ValueError, match="weights has 3 rows but the dispatch before had 4 tokens"):
            jax.jit(lambda x, i, w: a2a.combine(a2a.dispatch(x, i).expert_x, w))(x, idx, jnp.zeros((3, 2), jnp.float32))
        with pytest.raises(ValueError, match="which sent them"):
            jax.jit(lambda x, i, w: a2a.combine(a2a.dispatch(x, i, weights=w).expert_x, w))(
                x, idx, jnp.zeros((4, 2), jnp.float32))
        with pytest.raises(A2AError, match=r"dispatch\(\) called again before combine\(\)"):
            jax.jit(lambda x, i: (a2a.dispatch(x, i), a2a.dispatch(x, i)))(x, idx)
        # expert_scale: a Python number, checked as the program is traced (once at run time: the dispatch ran)
        with pytest.raises(ValueError, match="expert_scale=nan is not a finite float32"):
            jax.jit(lambda x, i, w: a2a.combine(a2a.dispatch(x, i).expert_x, w, expert_scale=float("nan")))(
                x, idx, jnp.zeros((4, 2), jnp.float32))
        with pytest.raises(TypeError, match="expert_scale must be a real number"):
            jax.jit(lambda x, i, w, s: a2a.combine(a2a.dispatch(x, i).expert_x, w, expert_scale=s))(
                x, idx, jnp.zeros((4, 2), jnp.float32), 2.0)
        # None of those programs ran, nor left a dispatch to combine: a whole step traces and runs.
        routes, w = jnp.tile(jnp.arange(2, dtype=jnp.int32), (4, 1)), jnp.full((4, 2), 0.5, jnp.float32)
        y = jax.jit(lambda x, i, w: a2a.combine(a2a.dispatch(x, i).expert_x, w))(*(jax.device_put(v, dev)
                                                                                   for v in (x, routes, w)))
        assert not np.asarray(y).any()  # (zeros in, zeros out)
        a2a.check()


def case_program_on_another_gpu_is_refused(comm):
    """A program whose arrays are on a GPU other than the object's is refused by XLA's handler, naming both
    GPUs, before any kernel runs (on every rank: no peer is left waiting); the object then serves a program
    on its own GPU, against the oracle."""
    if pyhipa2a_backend_is_host():
        pytest.skip("a GPU's matter")
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 64, 4
    a2a, jax, jnp, dev = _made(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M)
    gpus = [d for d in jax.devices() if d.platform == "gpu"]
    if len(gpus) < 2:
        pytest.skip("JAX sees one GPU")
    with a2a:
        me = a2a.rank
        inputs = draw_world(130, world, E, k, H, M)

        @jax.jit
        def step(x, indices, weights):
            d = a2a.dispatch(x, indices)
            return d, a2a.combine(d.expert_x, weights)
        other = gpus[(a2a.device_index + 1) % len(gpus)]
        with pytest.raises(jax.errors.JaxRuntimeError, match=f"runs on GPU {other.id}, but the object's memory is "
                                                             f"on GPU {a2a.device_index}"):
            d, y = step(*(jax.device_put(a[me], other) for a in (inputs.xs, inputs.indices, inputs.weights)))
            np.asarray(y)
        d, y = step(*(jax.device_put(a[me], dev) for a in (inputs.xs, inputs.indices, inputs.weights)))
        check_dispatch_against_oracle(a2a, inputs, d)
        want = reference.combine(inputs.xs, inputs.indices, inputs.weights, E, reference.fused_expert([1.0] * world),
                                 ranks=[me])[me]
        assert np.allclose(np.asarray(y).astype(np.float64), want, rtol=1e-2, atol=5e-3)
        a2a.check()


def case_gradients(comm, row_layout="packed"):
    """jax.grad through dispatch, a linear expert per local expert (in jnp), and combine against jax.grad of
    the same layer computed densely from every rank's inputs (drawn from one seed): the gradients of this
    rank's x and weights and of its experts' matrices, of the sum over ranks of each rank's <y, g>. Rows
    packed, or contiguous (each row's expert found from expert_offsets)."""
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 64, 8
    a2a, jax, jnp, dev = _made(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M,
                               **layout_arguments(row_layout))
    with a2a:
        me, L = a2a.rank, E // world
        inputs = draw_world(90, world, E, k, H, M, token_counts=[M - r % 3 for r in range(world)])
        rng = np.random.default_rng(91)
        mats = (rng.standard_normal((E, H, H)) / np.sqrt(H)).astype(np.float32)
        probes = [rng.standard_normal((len(inputs.xs[r]), H)).astype(np.float32) for r in range(world)]
        put = lambda a: jax.device_put(a, dev)  # noqa: E731
        scale = 0.5 + me

        def layer(x, weights, local):
            d = a2a.dispatch(x, put(inputs.indices[me]))
            h = d.expert_x.astype(jnp.float32)
            if d.expert_offsets is None:
                expert_y = jnp.einsum("lrh,lhg->lrg", h, local).astype(x.dtype)
            else:
                rows, first = jnp.arange(h.shape[0]), d.expert_offsets[:-1]
                expert = jnp.clip(jnp.searchsorted(first, rows, side="right") - 1, 0, L - 1)
                expert_y = jnp.einsum("rh,rhg->rg", h, local[expert]).astype(x.dtype)
            y = a2a.combine(expert_y, weights, expert_scale=scale)
            return jnp.sum(y.astype(jnp.float32) * put(probes[me]))

        grads = jax.jit(jax.grad(layer, argnums=(0, 1, 2)))(
            put(inputs.xs[me]), put(inputs.weights[me]), put(mats[me * L:(me + 1) * L]))

        def dense(xs, ws, mats):  # every rank's loss, each token through its experts on one device
            total = 0.0
            for r in range(world):
                idx = inputs.indices[r]
                rows = jnp.einsum("th,tkhg->tkg", xs[r].astype(jnp.float32), mats[idx])
                owner_scale = jnp.asarray([[0.5 + e // L for e in row] for row in idx], jnp.float32) if len(idx) \
                    else jnp.zeros((0, k), jnp.float32)
                y = jnp.sum(rows * (ws[r] * owner_scale)[..., None], axis=1)
                total = total + jnp.sum(y * probes[r])
            return total
        want = jax.grad(dense, argnums=(0, 1, 2))([jnp.asarray(a, jnp.float32) for a in inputs.xs],
                                                 [jnp.asarray(w) for w in inputs.weights], jnp.asarray(mats))
        pairs = ((grads[0], want[0][me], "x"), (grads[1], want[1][me], "weights"),
                 (grads[2], want[2][me * L:(me + 1) * L], "experts"))
        for got, expected, name in pairs:
            got, expected = np.asarray(got, np.float64), np.asarray(expected, np.float64)
            err = float(np.abs(got - expected).max(initial=0.0))
            assert np.allclose(got, expected, rtol=3e-2, atol=3e-2), (name, err)
            print(f"rank {me} d{name}: max err {err:.3g}")
        a2a.check()


def case_rows_beyond_counts_under_differentiation(comm, row_layout="packed"):
    """Under jax.vjp, where x needs no gradient (only the expert's scale does), dispatch's rows beyond each
    count are zeros although the buffer holds an earlier call's rows there, and the rows within are x's
    (contiguous: every row outside an expert's counted rows, the rounding's too)."""
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 64, 8
    a2a, jax, jnp, dev = _made(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M,
                               **layout_arguments(row_layout))
    with a2a:
        me = a2a.rank
        put = lambda a: jax.device_put(a, dev)  # noqa: E731
        full = draw_world(120, world, E, k, H, M, token_counts=[M] * world)  # (fills rows the next leaves)
        a2a.combine(a2a.dispatch(put(full.xs[me]), put(full.indices[me])).expert_x, put(full.weights[me]))
        fewer = draw_world(121, world, E, k, H, M, token_counts=[1 + r % 2 for r in range(world)])
        x, idx, w = (put(a[me]) for a in (fewer.xs, fewer.indices, fewer.weights))

        def layer(s):
            d = a2a.dispatch(x, idx)
            y = a2a.combine((d.expert_x.astype(jnp.float32) * s).astype(x.dtype), w)
            return d, jnp.sum(y.astype(jnp.float32))

        (d, _), _ = jax.vjp(jax.jit(layer), put(np.float32(2.0)))  # (the program runs where its argument is)
        counts, rows = np.asarray(d.expert_num_tokens), np.asarray(d.expert_x)
        if d.expert_offsets is None:
            for e, n in enumerate(counts):
                assert not rows[e, n:].any(), f"expert {e}: rows beyond its count {n} are not zero"
        else:
            offsets = np.asarray(d.expert_offsets)
            filled = np.zeros(len(rows), bool)
            for e, n in enumerate(counts):
                filled[offsets[e]:offsets[e] + n] = True
            assert not rows[~filled].any(), f"rows outside the counted ones are not zero ({offsets}, {counts})"
        check_dispatch_against_oracle(a2a, fewer, d)
        a2a.check()


def case_gradients_of_two_layers(comm):
    """Two MoE layers on one object in one jitted loss (the second's x is the first's y): each backward pass
    is a dispatch then a combine per layer, in reverse order; x's gradient against the dense computation's."""
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 64, 8
    a2a, jax, jnp, dev = _made(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M)
    with a2a:
        me, L = a2a.rank, E // world
        a = draw_world(94, world, E, k, H, M, token_counts=[M] * world)
        b = draw_world(95, world, E, k, H, M, token_counts=[M] * world)
        rng = np.random.default_rng(96)
        mats = [(rng.standard_normal((E, H, H)) / np.sqrt(H)).astype(np.float32) for _ in range(2)]
        probes = [rng.standard_normal((M, H)).astype(np.float32) for _ in range(world)]
        put = lambda v: jax.device_put(v, dev)  # noqa: E731
        routes = [(put(a.indices[me]), put(a.weights[me])), (put(b.indices[me]), put(b.weights[me]))]

        def loss(x):
            for (indices, weights), m in zip(routes, mats):
                d = a2a.dispatch(x, indices)
                expert_y = jnp.einsum("lrh,lhg->lrg", d.expert_x.astype(jnp.float32),
                                      put(m[me * L:(me + 1) * L])).astype(x.dtype)
                x = a2a.combine(expert_y, weights)
            return jnp.sum(x.astype(jnp.float32) * put(probes[me]))
        got = np.asarray(jax.jit(jax.grad(loss))(put(a.xs[me])), np.float64)

        def dense(xs):  # every rank's two layers on one device, in fp32
            total = 0.0
            for r in range(world):
                x = xs[r]
                for inputs, m in zip((a, b), mats):
                    rows = jnp.einsum("th,tkhg->tkg", x, jnp.asarray(m)[inputs.indices[r]])
                    x = jnp.sum(rows * jnp.asarray(inputs.weights[r])[..., None], axis=1)
                total = total + jnp.sum(x * probes[r])
            return total
        want = np.asarray(jax.grad(dense)([jnp.asarray(v, jnp.float32) for v in a.xs])[me], np.float64)
        err = float(np.abs(got - want).max(initial=0.0))
        assert np.allclose(got, want, rtol=5e-2, atol=5e-2), err
        print(f"rank {me} two layers' dx: max err {err:.3g}")
        a2a.check()


def case_gradients_where_y_is_stopped(comm, variant):
    """A backward pass whose first call on the object follows a forward combine that itself gets no gradient:
    "rows", a loss on expert_x with y's gradient stopped (dispatch's gradient runs, combine's does not);
    "second", a second pair on the object whose y's gradient is stopped. Each backward call must still come
    after the forward's last call (its order word, seen through the ended differentiating trace), step
    after step, with x's gradient against the dense computation's."""
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 64, 8
    a2a, jax, jnp, dev = _made(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M)
    with a2a:
        me = a2a.rank
        steps = [draw_world(150 + i, world, E, k, H, M, token_counts=[M] * world) for i in range(3)]

        def loss(x, indices, weights):
            d = a2a.dispatch(x, indices)
            y = a2a.combine(d.expert_x, weights)
            if variant == "rows":
                return jnp.sum(d.expert_x.astype(jnp.float32)) + jnp.sum(jax.lax.stop_gradient(y).astype(jnp.float32))
            again = a2a.combine(a2a.dispatch(jax.lax.stop_gradient(x), indices).expert_x, weights)
            return jnp.sum(y.astype(jnp.float32)) + jnp.sum(jax.lax.stop_gradient(again).astype(jnp.float32))
        step = jax.jit(jax.grad(loss))
        for i, inputs in enumerate(steps):
            put = lambda v: jax.device_put(v, dev)  # noqa: E731
            dx = np.asarray(step(put(inputs.xs[me]), put(inputs.indices[me]), put(inputs.weights[me])), np.float64)
            # d/dx: "rows", each token once per slot (expert_x holds a copy a slot); "second", y = sum_j w_j x
            want = (np.full((M, k), 1.0) if variant == "rows" else inputs.weights[me]).sum(axis=1)[:, None]
            assert np.allclose(dx, np.broadcast_to(want, dx.shape), rtol=1e-2, atol=1e-2), (i, variant)
        a2a.check()


def case_gradients_refused_with_reasons(comm):
    """A call that takes no gradient says why when JAX differentiates it, before any call of that program runs,
    on every rank alike: a combine whose dispatch ran outside the differentiated function (Python's memory of
    its indices could be another call's: a compiled program runs again unseen), weights sent by dispatch, a
    jitted step that ran undifferentiated (JAX would differentiate the program it traced then, whose rows
    beyond the counts are not zeroed: NaN there reached the expert's gradient where x takes none), an object
    made with gradients=False. The object goes on: the refused programs never ran."""
    from pyhipa2a import A2AError
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 64, 8
    params = dict(num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M)
    a2a, jax, jnp, dev = _made(comm, **params)
    unit = reference.fused_expert([1.0] * world)  # (expert_x combined as it came)
    with a2a:
        me = a2a.rank
        inputs = draw_world(160, world, E, k, H, M, token_counts=[M] * world)
        x, idx, w = (jax.device_put(v[me], dev) for v in (inputs.xs, inputs.indices, inputs.weights))

        def total(y):
            return jnp.sum(y.astype(jnp.float32))
        rows = a2a.dispatch(x, idx).expert_x  # (eager)
        with pytest.raises(A2AError, match=r"differentiated only in the function that traced its dispatch"):
            jax.grad(lambda w: total(a2a.combine(rows, w)))(w)
        with pytest.raises(A2AError, match=r"differentiated only in the function that traced its dispatch"):
            jax.jit(jax.grad(lambda w: total(a2a.combine(rows, w))))(w)
        y = a2a.combine(rows, w)  # (the eager dispatch is combined as before)
        combine_error_against_oracle(a2a, inputs, np.asarray(y), expert=unit)  # (raises beyond the tolerance)
        with pytest.raises(A2AError, match=r"sent by dispatch\(weights=\)"):
            jax.grad(lambda x: total(a2a.combine(a2a.dispatch(x, idx, weights=w).expert_x)))(x)
        y = jax.jit(lambda x: a2a.combine(a2a.dispatch(x, idx, weights=w).expert_x))(x)
        combine_error_against_oracle(a2a, inputs, np.asarray(y), expert=unit)
        mats = jax.device_put(np.eye(H, dtype=np.float32)[None].repeat(E // world, axis=0), dev)

        def layer(mats, x, w):
            ey = jnp.einsum("lrh,lhg->lrg", a2a.dispatch(x, idx).expert_x.astype(jnp.float32), mats)
            return total(a2a.combine(ey.astype(x.dtype), w))
        step = jax.jit(layer)
        jax.block_until_ready(step(mats, x, w))
        for argnums in (0, 1):  # (x taking no gradient, then taking one)
            with pytest.raises(A2AError, match=r"traced without differentiation"):
                jax.grad(step, argnums=argnums)(mats, x, w)
        jax.block_until_ready(jax.jit(jax.grad(layer))(mats, x, w))  # (traced under differentiation: it runs)
    plain, jax, jnp, dev = _made(comm, gradients=False, **params)
    with plain:
        step = jax.jit(lambda x, w: total(plain.combine(plain.dispatch(x, idx).expert_x, w)))
        jax.block_until_ready(step(x, w))
        with pytest.raises(A2AError, match=r"gradients=False"):
            jax.grad(step)(x, w)
        plain.check()


def case_eager_dispatch_and_compiled_combine(comm):
    """Eager dispatches, each combined by one jitted function that runs compiled from its second call on
    (Python does not see that combine): no dispatch is refused as uncombined, and every y is the oracle's."""
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 64, 8
    a2a, jax, jnp, dev = _made(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M)
    with a2a:
        me = a2a.rank
        combine = jax.jit(lambda rows, w: a2a.combine(rows, w))
        for i in range(3):
            inputs = draw_world(170 + i, world, E, k, H, M, token_counts=[M] * world)
            x, idx, w = (jax.device_put(v[me], dev) for v in (inputs.xs, inputs.indices, inputs.weights))
            y = combine(a2a.dispatch(x, idx).expert_x, w)
            combine_error_against_oracle(a2a, inputs, np.asarray(y), expert=reference.fused_expert([1.0] * world))
        a2a.check()


def case_combine_traced_apart(comm):
    """Dispatch and combine in two jitted functions, the token count changing from call to call: combine is
    given the weights (its token count is then its program's own) and y is the oracle's at every count; a
    combine traced apart without them is refused while tracing (it would keep the count it was traced with:
    its program's y kept that length, and the device reduced the other count's tokens)."""
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 64, 8
    a2a, jax, jnp, dev = _made(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M)
    with a2a:
        me = a2a.rank
        inputs = draw_world(190, world, E, k, H, M, token_counts=[M] * world)
        x, idx, w = (jax.device_put(v[me], dev) for v in (inputs.xs, inputs.indices, inputs.weights))
        ey = jax.ShapeDtypeStruct((*a2a.config.rows_shape, H), jnp.float16)
        jax.jit(lambda x, i, w: a2a.dispatch(x, i, weights=w).expert_x).lower(x, idx, w)  # (traced, never run)
        with pytest.raises(TypeError, match="traced apart from its dispatch"):
            jax.jit(lambda ey: a2a.combine(ey)).lower(ey)
        dispatch = jax.jit(lambda x, i: a2a.dispatch(x, i).expert_x)
        combine = jax.jit(lambda ey, w: a2a.combine(ey, w))
        for i, T in enumerate((M, 5, M, 3)):
            inputs = draw_world(191 + i, world, E, k, H, M, token_counts=[T] * world)
            x, idx, w = (jax.device_put(v[me], dev) for v in (inputs.xs, inputs.indices, inputs.weights))
            y = combine(dispatch(x, idx), w)
            assert y.shape == (T, H), (T, y.shape)
            combine_error_against_oracle(a2a, inputs, np.asarray(y), expert=reference.fused_expert([1.0] * world))
        a2a.check()


def case_eager_calls_compile_once(comm):
    """Eager calls of a kind compile once: later eager steps, with new values, compile nothing (JAX's compile
    events counted, from the third step on), and their y is the oracle's. (On the host backend each eager
    call once made a new callback, which JAX compiled at every call: 25 ms a step.)"""
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 64, 8
    a2a, jax, jnp, dev = _made(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M)
    compiled = []

    def heard(event, seconds, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            compiled.append(event)
    with a2a:
        me = a2a.rank
        unit = reference.fused_expert([1.0] * world)
        for i in range(5):
            if i == 2:  # (the first steps compile what they need: JAX's own operations, and a dispatch whose order
                #          word is a call's, not the first's zeros)
                jax.monitoring.register_event_duration_secs_listener(heard)
            inputs = draw_world(180 + i, world, E, k, H, M, token_counts=[M] * world)
            x, idx, w = (jax.device_put(v[me], dev) for v in (inputs.xs, inputs.indices, inputs.weights))
            y = a2a.combine(a2a.dispatch(x, idx).expert_x, w)
            combine_error_against_oracle(a2a, inputs, np.asarray(y), expert=unit)
        jax.monitoring.unregister_event_duration_listener(heard)
        assert not compiled, f"{len(compiled)} programs compiled in three eager steps after the second"
        a2a.check()


def case_fp8_given_with_weights(comm):
    """fp8 x given with its block scales, and the weights given to dispatch, inside jit: every operand of the
    call in its place (the rows, scales, counts and meta against the oracle; y against the oracle of the
    fp8 rows times their scales)."""
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 256, 8
    a2a, jax, jnp, dev = _made(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M,
                               in_dtype="float8_e4m3", out_dtype="bfloat16")
    with a2a:
        me = a2a.rank
        inputs = draw_world(160, world, E, k, H, M, dtype="bfloat16").quantized(a2a.config.dispatch_dtype)

        @jax.jit
        def step(x, x_scales, indices, weights):
            d = a2a.dispatch(x, indices, weights=weights, x_scales=x_scales)
            rows = d.expert_x.astype(jnp.float32) * jnp.repeat(d.expert_x_scales, 128, axis=-1)
            return d, a2a.combine(rows.astype(jnp.bfloat16))
        d, y = step(*(jax.device_put(a[me], dev) for a in (inputs.xs, inputs.x_scales, inputs.indices,
                                                            inputs.weights)))
        check_dispatch_against_oracle(a2a, inputs, d)
        rows = [reference.dequantize_fp8(x, sc) for x, sc in zip(inputs.xs, inputs.x_scales)]
        want = reference.combine(rows, inputs.indices, inputs.weights, E, reference.fused_expert([1.0] * world),
                                 ranks=[me])[me]
        got = np.asarray(y).astype(np.float64)
        assert np.allclose(got, want, rtol=2e-2, atol=2e-2), float(np.abs(got - want).max())
        a2a.check()
