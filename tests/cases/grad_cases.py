"""Multi-rank cases of gradients through dispatch and combine with PyTorch's autograd (pyhipa2a.torch); JAX's
are in jax_cases (run under mpiexec by the tests)."""
from __future__ import annotations

import numpy as np
import pytest

import pyhipa2a
from pyhipa2a import AllToAll
from pyhipa2a.testing import draw_world


def case_torch_gradients(comm):
    """loss = sum over ranks of <y, g>, y = combine(a linear expert per local expert of dispatch(x)): autograd's
    gradients of this rank's x and weights and of its experts' matrices, against autograd of the same layer
    computed densely from every rank's inputs (drawn from one seed) on one device."""
    torch = pytest.importorskip("torch")
    from pyhipa2a.torch import Differentiable
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 64, 8
    host = pyhipa2a.get_backend().kind == "host"
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, stream="current") as a2a:
        me, L = a2a.rank, E // world
        dev = torch.device("cpu") if host else torch.device("cuda", a2a.heap.device.index)
        if not host:
            torch.cuda.set_device(dev)
        moe = Differentiable(a2a)
        try:
            inputs = draw_world(92, world, E, k, H, M, token_counts=[M - r % 3 for r in range(world)])
            rng = np.random.default_rng(93)
            mats = (rng.standard_normal((E, H, H)) / np.sqrt(H)).astype(np.float32)
            probes = [rng.standard_normal((len(inputs.xs[r]), H)).astype(np.float32) for r in range(world)]
            scale = 0.5 + me
            x = torch.from_numpy(inputs.xs[me]).to(dev).requires_grad_()
            w = torch.from_numpy(inputs.weights[me]).to(dev).requires_grad_()
            local = torch.from_numpy(mats[me * L:(me + 1) * L]).to(dev).requires_grad_()
            d = moe.dispatch(x, torch.from_numpy(inputs.indices[me]).to(dev))
            expert_y = torch.einsum("lrh,lhg->lrg", d.expert_x.float(), local).to(x.dtype)
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
            a2a.synchronize()
        finally:
            moe.close()
