"""Multi-rank cases of gradients through dispatch and combine with PyTorch's autograd (pyhipa2a.torch); JAX's
are in jax_cases (run under mpiexec by the tests)."""
from __future__ import annotations

import contextlib

import numpy as np
import pytest

import pyhipa2a
from pyhipa2a import AllToAll
from pyhipa2a.testing import draw_world, layout_arguments, poison


@contextlib.contextmanager
def _torch_layer(comm, E: int, k: int, H: int, M: int, row_layout: str = "packed"):
    """(torch, the AllToAll on PyTorch's current stream, its Differentiable, the device of its tensors)."""
    torch = pytest.importorskip("torch")
    from pyhipa2a.torch import Differentiable
    host = pyhipa2a.get_backend().kind == "host"
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, stream="current",
                  **layout_arguments(row_layout)) as a2a:
        dev = torch.device("cpu") if host else torch.device("cuda", a2a.heap.device.index)
        if not host:
            torch.cuda.set_device(dev)
        moe = Differentiable(a2a)
        try:
            yield torch, a2a, moe, dev
            a2a.synchronize()
        finally:
            moe.close()


def linear_experts(torch, d, local):
    """Each local expert's matrix on its rows of d.expert_x, in float32: [L, W*M, H] packed, [R, H] contiguous
    (each row's expert found from expert_offsets)."""
    if d.expert_offsets is None:
        return torch.einsum("lrh,lhg->lrg", d.expert_x.float(), local)
    rows = torch.arange(d.expert_x.shape[0], device=d.expert_x.device)
    first = d.expert_offsets[:-1].to(torch.int64)
    expert = (torch.searchsorted(first, rows, right=True) - 1).clamp(0, local.shape[0] - 1)
    return torch.einsum("rh,rhg->rg", d.expert_x.float(), local[expert])


def case_torch_failed_dispatch_stays_poisoned(comm):
    """A dispatch the kernels refused (an expert out of range) hands out its poison through the differentiable
    copy too: counts -1, rows NaN (the rows past the counts were zeroed, the poison with them), and the error at
    the next synchronize."""
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 16, 4
    with pytest.raises(pyhipa2a.A2ADeviceError):
        with _torch_layer(comm, E, k, H, M) as (torch, a2a, moe, dev):
            x = torch.ones((M, H), dtype=torch.float16, device=dev)
            d = moe.dispatch(x, torch.full((M, k), E, dtype=torch.int32, device=dev))
            assert (d.expert_num_tokens == -1).all()
            assert torch.isnan(d.expert_x.float()).all()


def case_torch_gradients(comm, row_layout="packed"):
    """loss = sum over ranks of <y, g>, y = combine(a linear expert per local expert of dispatch(x)): autograd's
    gradients of this rank's x and weights and of its experts' matrices, against autograd of the same layer
    computed densely from every rank's inputs (drawn from one seed) on one device."""
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 64, 8
    with _torch_layer(comm, E, k, H, M, row_layout) as (torch, a2a, moe, dev):
        me, L = a2a.rank, E // world
        inputs = draw_world(92, world, E, k, H, M, token_counts=[M - r % 3 for r in range(world)])
        rng = np.random.default_rng(93)
        mats = (rng.standard_normal((E, H, H)) / np.sqrt(H)).astype(np.float32)
        probes = [rng.standard_normal((len(inputs.xs[r]), H)).astype(np.float32) for r in range(world)]
        scale = 0.5 + me
        x = torch.from_numpy(inputs.xs[me]).to(dev).requires_grad_()
        w = torch.from_numpy(inputs.weights[me]).to(dev).requires_grad_()
        local = torch.from_numpy(mats[me * L:(me + 1) * L]).to(dev).requires_grad_()
        poison(a2a)  # (rows past a count hold NaN: a gradient that reads one is NaN)
        d = moe.dispatch(x, torch.from_numpy(inputs.indices[me]).to(dev))
        assert (d.expert_offsets is None) == (row_layout == "packed")
        expert_y = linear_experts(torch, d, local).to(x.dtype)
        y = moe.combine(expert_y, w, expert_scale=scale)
        (y.float() * torch.from_numpy(probes[me]).to(dev)).sum().backward()

        xs = [torch.from_numpy(a.astype(np.float32)).requires_grad_() for a in inputs.xs]
        ws = [torch.from_numpy(a).requires_grad_() for a in inputs.weights]
        all_mats = torch.from_numpy(mats).requires_grad_()
        total = 0.0
        for r in range(world):
            idx = torch.from_numpy(inputs.indices[r].astype(np.int64))
            rows = torch.einsum("th,tkhg->tkg", xs[r], all_mats[idx])
            owner_scale = 0.5 + torch.div(idx, L, rounding_mode="floor").float()
            total = total + ((rows * (ws[r] * owner_scale)[..., None]).sum(1) * torch.from_numpy(probes[r])).sum()
        total.backward()
        pairs = ((x.grad, xs[me].grad, "x"), (w.grad, ws[me].grad, "weights"),
                 (local.grad, all_mats.grad[me * L:(me + 1) * L], "experts"))
        for got, expected, name in pairs:
            got, expected = got.detach().float().cpu().numpy(), expected.numpy()
            err = float(np.abs(got - expected).max(initial=0.0))
            assert np.allclose(got, expected, rtol=3e-2, atol=3e-2), (name, err)
            print(f"rank {me} d{name}: max err {err:.3g}")


def case_gradients_without_x(comm, lib):
    """Training the experts and the router's weights of a first layer, whose x (raw data) needs no gradient:
    dispatch's gradient never runs, and the object's calls stay paired step after step (three steps, each
    against the dense computation's gradient of the experts)."""
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 64, 8
    host = pyhipa2a.get_backend().kind == "host"
    rng = np.random.default_rng(97)
    mats = (rng.standard_normal((E, H, H)) / np.sqrt(H)).astype(np.float32)
    probes = [rng.standard_normal((M, H)).astype(np.float32) for _ in range(world)]
    steps = [draw_world(98 + i, world, E, k, H, M, token_counts=[M] * world) for i in range(3)]

    def dense_expert_grads(inputs):
        total = np.zeros_like(mats, dtype=np.float64)
        for r in range(world):
            for t in range(M):
                for j, e in enumerate(inputs.indices[r][t]):
                    total[e] += inputs.weights[r][t, j] * np.outer(inputs.xs[r][t].astype(np.float64), probes[r][t])
        return total

    if lib == "jax":
        from pyhipa2a.jax import JaxAllToAll
        jax = pytest.importorskip("jax")
        jnp = pytest.importorskip("jax.numpy")
        a2a = JaxAllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M)
        dev = jax.devices("cpu")[0] if host else [d for d in jax.devices() if d.platform == "gpu"][a2a.device_index]
        with a2a:
            me, L = a2a.rank, E // world

            def loss(local, weights, x, indices):
                d = a2a.dispatch(x, indices)
                expert_y = jnp.einsum("lrh,lhg->lrg", d.expert_x.astype(jnp.float32), local).astype(x.dtype)
                return jnp.sum(a2a.combine(expert_y, weights).astype(jnp.float32) * probes[me])
            step = jax.jit(jax.grad(loss, argnums=(0, 1)))
            for i, inputs in enumerate(steps):
                put = lambda v: jax.device_put(v, dev)  # noqa: E731
                d_local, _ = step(put(mats[me * L:(me + 1) * L]), put(inputs.weights[me]), put(inputs.xs[me]),
                                  put(inputs.indices[me]))
                want = dense_expert_grads(inputs)[me * L:(me + 1) * L]
                got = np.asarray(d_local, np.float64)
                assert np.allclose(got, want, rtol=3e-2, atol=3e-2), (i, float(np.abs(got - want).max()))
            a2a.check()
        return
    with _torch_layer(comm, E, k, H, M) as (torch, a2a, moe, dev):
        me, L = a2a.rank, E // world
        for i, inputs in enumerate(steps):
            local = torch.from_numpy(mats[me * L:(me + 1) * L]).to(dev).requires_grad_()
            w = torch.from_numpy(inputs.weights[me]).to(dev).requires_grad_()
            d = moe.dispatch(torch.from_numpy(inputs.xs[me]).to(dev), torch.from_numpy(inputs.indices[me]).to(dev))
            expert_y = torch.einsum("lrh,lhg->lrg", d.expert_x.float(), local).to(torch.float16)
            (moe.combine(expert_y, w).float() * torch.from_numpy(probes[me]).to(dev)).sum().backward()
            want = dense_expert_grads(inputs)[me * L:(me + 1) * L]
            got = local.grad.double().cpu().numpy()
            assert np.allclose(got, want, rtol=3e-2, atol=3e-2), (i, float(np.abs(got - want).max()))


def case_torch_gradients_of_two_layers(comm):
    """Two layers on one object (the second's x is the first's y), backward through both: x's gradient
    against autograd of the same two layers computed densely from every rank's inputs."""
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 64, 8
    with _torch_layer(comm, E, k, H, M) as (torch, a2a, moe, dev):
        me, L = a2a.rank, E // world
        layers = [draw_world(110 + i, world, E, k, H, M, token_counts=[M] * world) for i in range(2)]
        rng = np.random.default_rng(112)
        mats = [(rng.standard_normal((E, H, H)) / np.sqrt(H)).astype(np.float32) for _ in range(2)]
        probes = [rng.standard_normal((M, H)).astype(np.float32) for _ in range(world)]
        x = torch.from_numpy(layers[0].xs[me]).to(dev).requires_grad_()
        h = x
        for inputs, m in zip(layers, mats):
            d = moe.dispatch(h, torch.from_numpy(inputs.indices[me]).to(dev))
            local = torch.from_numpy(m[me * L:(me + 1) * L]).to(dev)
            expert_y = torch.einsum("lrh,lhg->lrg", d.expert_x.float(), local).to(torch.float16)
            h = moe.combine(expert_y, torch.from_numpy(inputs.weights[me]).to(dev))
        (h.float() * torch.from_numpy(probes[me]).to(dev)).sum().backward()

        xs = [torch.from_numpy(layers[0].xs[r].astype(np.float32)).requires_grad_() for r in range(world)]
        total = 0.0
        for r in range(world):
            h = xs[r]
            for inputs, m in zip(layers, mats):
                rows = torch.einsum("th,tkhg->tkg", h, torch.from_numpy(m)[torch.from_numpy(
                    inputs.indices[r].astype(np.int64))])
                h = (rows * torch.from_numpy(inputs.weights[r])[..., None]).sum(1)
            total = total + (h * torch.from_numpy(probes[r])).sum()
        total.backward()
        got, want = x.grad.float().cpu().numpy(), xs[me].grad.numpy()
        err = float(np.abs(got - want).max(initial=0.0))
        assert np.allclose(got, want, rtol=5e-2, atol=5e-2), err
        print(f"rank {me} two layers' dx: max err {err:.3g}")
