"""Ranks that are devices of one process (pyhipa2a.local): AllToAll's ranks made in one process, and
JaxAllToAll(devices=...) inside shard_map. Each case runs in one process (under mpiexec -n 1 by the tests);
its ranks are JAX's CPU devices over the host backend (XLA_FLAGS forces their number), or GPUs: on one
GPU, AllToAll's ranks share it (JAX's cannot: XLA tells its ranks apart by their GPU).

Every round draws the whole world's inputs from a seed and checks each rank's results against
pyhipa2a.reference, outputs poisoned before the call where the call writes into our buffers.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest

import pyhipa2a
from pyhipa2a import reference
from pyhipa2a.local import each, open_ranks
from pyhipa2a.testing import check_dispatch_against_oracle, draw_world, layout_arguments


def _host() -> bool:
    return pyhipa2a.get_backend().kind == "host"


def _rank_view(a2a, rank: int):
    """What the oracle's checks ask of an object (its configuration, a rank, the world) for rank `rank`."""
    return SimpleNamespace(config=a2a.config, rank=rank, world=a2a.config.world)


def case_alltoall_ranks_in_one_process(comm, ranks="2", rounds="3"):
    """`ranks` AllToAll objects made in this process by open_ranks, on its GPUs in turn (all on one GPU where
    it has one) or the host backend; each round, every rank's dispatch then every rank's combine (on GPUs
    from this one thread, in turn: their kernels wait for each other on the devices; on the host a thread a
    rank, as its kernels run at launch); the dispatch and y against the oracle; then closed together."""
    W = int(ranks)
    E, k, H, M = 2 * W, 2, 128, 8
    gpus = 1 if _host() else pyhipa2a.get_backend().device_count()
    a2a = open_ranks(W, lambda c: pyhipa2a.AllToAll(c, device=c.Get_rank() % gpus, num_experts=E, experts_per_token=k,
                                                    hidden_dim=H, max_num_tokens=M))
    try:
        assert [a.rank for a in a2a] == list(range(W)), [a.rank for a in a2a]
        in_turn = (lambda items, step: [step(i) for i in items]) if not _host() else each
        for i in range(int(rounds)):
            inputs = draw_world(300 + i, W, E, k, H, M)
            results = in_turn(range(W), lambda r: a2a[r].dispatch(inputs.xs[r], inputs.indices[r]))
            for r in range(W):
                check_dispatch_against_oracle(a2a[r], inputs, results[r])
            # (every rank's combine launched before any y is read: a read waits for the kernels of all)
            ys = in_turn(range(W), lambda r: a2a[r].combine(results[r].expert_x, inputs.weights[r]))
            identity = reference.fused_expert([1.0] * W)
            for r in range(W):
                want = reference.combine(inputs.xs, inputs.indices, inputs.weights, E, identity, ranks=[r])[r]
                assert np.allclose(ys[r].numpy().astype(np.float64), want, rtol=1e-2, atol=5e-3), (i, r)
        for a in a2a:
            a.synchronize()
    finally:
        each(a2a, pyhipa2a.AllToAll.close)


def _jax_devices(W: int):
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # (our heaps share the GPUs with JAX's pool)
    jax = pytest.importorskip("jax")
    devices = jax.devices("cpu") if _host() else [d for d in jax.devices() if d.platform == "gpu"]
    if len(devices) < W:
        pytest.skip(f"{W} ranks that are devices need {W} JAX devices; there are {len(devices)}")
    return jax, pytest.importorskip("jax.numpy"), devices[:W]


def case_jax_ranks_are_devices(comm, ranks="2", row_layout="packed"):
    """JaxAllToAll(devices=..., axis_name="ep"): dispatch, an expert in jnp (expert_x * 2) and combine inside
    shard_map over a2a.mesh, jitted, called with new values and a new token count (a retrace); each rank's
    y and dispatch against the oracle."""
    from jax.sharding import PartitionSpec as P
    from pyhipa2a.jax import JaxAllToAll
    W = int(ranks)
    jax, jnp, devices = _jax_devices(W)
    E, k, H, M = 4 * W, 3, 128, 16
    with JaxAllToAll(devices=devices, axis_name="ep", num_experts=E, experts_per_token=k, hidden_dim=H,
                     max_num_tokens=M, **layout_arguments(row_layout)) as a2a:
        assert a2a.rank is None and a2a.world == W

        def step(x, indices, weights):
            d = a2a.dispatch(x, indices)
            return d, a2a.combine((d.expert_x * 2).astype(d.expert_x.dtype), weights, expert_scale=1.5)
        sharded = jax.jit(jax.shard_map(step, mesh=a2a.mesh, in_specs=P("ep"), out_specs=P("ep")))
        for i, T in enumerate((M, 5, M)):
            inputs = draw_world(310 + i, W, E, k, H, M, token_counts=[T] * W)
            d, y = sharded(*(np.concatenate(a) for a in (inputs.xs, inputs.indices, inputs.weights)))
            expert = reference.fused_expert([2 * 1.5] * W)
            ys = np.split(np.asarray(y).astype(np.float64), W)
            for r in range(W):
                want = reference.combine(inputs.xs, inputs.indices, inputs.weights, E, expert, ranks=[r])[r]
                assert np.allclose(ys[r], want, rtol=1e-2, atol=5e-3), (i, r, float(np.abs(ys[r] - want).max()))
                mine = type(d)(*(None if a is None else np.split(np.asarray(a), W)[r] for a in d))
                check_dispatch_against_oracle(_rank_view(a2a, r), inputs, mine)
            print(f"round {i}: T={T} on each of {W} ranks")
        a2a.check()


def case_jax_gradients_ranks_are_devices(comm, ranks="2"):
    """jax.grad through dispatch, a linear expert per local expert and combine inside shard_map over the
    ranks that are devices, against jax.grad of the same layer computed densely: the gradients of x, of the
    weights and of the experts' matrices."""
    from jax.sharding import PartitionSpec as P
    from pyhipa2a.jax import JaxAllToAll
    W = int(ranks)
    jax, jnp, devices = _jax_devices(W)
    E, k, H, M = 2 * W, 2, 64, 8
    with JaxAllToAll(devices=devices, axis_name="ep", num_experts=E, experts_per_token=k, hidden_dim=H,
                     max_num_tokens=M) as a2a:
        inputs = draw_world(320, W, E, k, H, M, token_counts=[M] * W)
        rng = np.random.default_rng(321)
        mats = (rng.standard_normal((E, H, H)) / np.sqrt(H)).astype(np.float32)
        probes = rng.standard_normal((W * M, H)).astype(np.float32)

        def layer(x, indices, weights, local, probe):
            d = a2a.dispatch(x, indices)
            expert_y = jnp.einsum("lrh,lhg->lrg", d.expert_x.astype(jnp.float32), local).astype(x.dtype)
            y = a2a.combine(expert_y, weights)
            return jax.lax.psum(jnp.sum(y.astype(jnp.float32) * probe), "ep")
        loss = jax.shard_map(layer, mesh=a2a.mesh, in_specs=(P("ep"),) * 5, out_specs=P())
        xs, idx, ws = (np.concatenate(a) for a in (inputs.xs, inputs.indices, inputs.weights))
        got = jax.jit(jax.grad(loss, argnums=(0, 2, 3)))(xs, idx, ws, mats, probes)

        def dense(x, w, m):
            rows = jnp.einsum("th,tkhg->tkg", x.astype(jnp.float32), m[idx])
            return jnp.sum(jnp.sum(rows * w[..., None], axis=1) * probes)
        want = jax.grad(dense, argnums=(0, 1, 2))(jnp.asarray(xs, jnp.float32), jnp.asarray(ws), jnp.asarray(mats))
        for g, w, name in zip(got, want, ("x", "weights", "experts")):
            g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
            assert np.allclose(g, w, rtol=3e-2, atol=3e-2), (name, float(np.abs(g - w).max()))
        a2a.check()


def case_jax_ranks_are_devices_refusals(comm):
    """Refused before any kernel runs: devices= without axis_name, with a communicator too; a call outside
    shard_map; a shard_map over an axis of another size. A heap that does not fit (JAX took the memory)
    names the setting that leaves room."""
    from jax.sharding import Mesh, PartitionSpec as P
    from pyhipa2a.errors import A2AError
    from pyhipa2a.jax import JaxAllToAll
    from pyhipa2a.errors import RuntimeFailure
    from pyhipa2a.runtime.host import HostBackend
    jax, jnp, devices = _jax_devices(2)
    params = dict(num_experts=4, experts_per_token=2, hidden_dim=64, max_num_tokens=4)
    if _host():
        def full(self, nbytes):
            raise RuntimeFailure("cuMemAlloc failed: CUDA_ERROR_OUT_OF_MEMORY: out of memory")
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(HostBackend, "malloc_ipc", full)
            with pytest.raises(A2AError, match="out of memory. JAX takes 75%.*XLA_PYTHON_CLIENT_PREALLOCATE=false"):
                JaxAllToAll(devices=devices, axis_name="ep", **params)
    with pytest.raises(TypeError, match="needs axis_name"):
        JaxAllToAll(devices=devices, **params)
    with pytest.raises(TypeError, match="not both"):
        JaxAllToAll(comm, devices=devices, axis_name="ep", **params)
    with pytest.raises(TypeError, match="axis_name goes with devices"):
        JaxAllToAll(comm, axis_name="ep", **params)
    inputs = draw_world(330, 2, 4, 2, 64, 4, token_counts=[4, 4])
    with JaxAllToAll(devices=devices, axis_name="ep", **params) as a2a:
        with pytest.raises(A2AError, match="inside shard_map over its axis 'ep'"):
            a2a.dispatch(jnp.asarray(inputs.xs[0]), jnp.asarray(inputs.indices[0]))
        narrow = Mesh(np.array(devices[:1]), ("ep",))
        one = jax.shard_map(lambda x, i: a2a.dispatch(x, i).expert_num_tokens, mesh=narrow, in_specs=P("ep"),
                            out_specs=P("ep"))
        with pytest.raises(ValueError, match="has 1 devices, but this object has 2 ranks"):
            jax.jit(one)(inputs.xs[0], inputs.indices[0])
        # The same devices in another order: refused as the program compiles, before any kernel runs (on
        # GPUs each position would run the rank of its GPU, with another position's experts).
        turned = jax.jit(jax.shard_map(lambda x, i, w: a2a.combine(a2a.dispatch(x, i).expert_x, w),
                                       mesh=Mesh(np.array(devices[::-1]), ("ep",)), in_specs=P("ep"),
                                       out_specs=P("ep")))
        whole = [np.concatenate(a) for a in (inputs.xs, inputs.indices, inputs.weights)]
        with pytest.raises(ValueError, match=r"lists the devices along 'ep' as \[1, 0\], but this object's ranks "
                                             r"are devices \[0, 1\]"):
            turned(*whole)
        a2a.check()


def case_jax_in_turn(comm):
    """Every case of ranks that are JAX's devices, in this one process (one start of JAX): the step at 2 ranks
    packed, 3 contiguous and 2 by source; the gradients; the refusals. A part that needs more devices than
    JAX sees is skipped (said in the output); the case skips where none ran."""
    parts = [(case_jax_ranks_are_devices, ("2", "packed")), (case_jax_ranks_are_devices, ("3", "contiguous/8")),
             (case_jax_ranks_are_devices, ("2", "by_source")), (case_jax_gradients_ranks_are_devices, ("2",)),
             (case_jax_ranks_are_devices_refusals, ())]
    ran = 0
    for case, args in parts:
        try:
            case(comm, *args)
        except pytest.skip.Exception as e:
            print(f"{case.__name__}{args}: skipped: {e}")
            continue
        ran += 1
        print(f"{case.__name__}{args}: passed")
    if not ran:
        pytest.skip("no part found the devices it needs")
