"""Dispatch and combine for PyTorch's autograd: `pyhipa2a.torch.Differentiable` (the library stays torch-free;
this module alone imports torch).

    a2a = AllToAll(comm, ..., stream="current")
    moe = Differentiable(a2a)
    d = moe.dispatch(x, indices)              # d.expert_x requires grad where x does
    y = moe.combine(experts(d), weights)     # gradients reach x, the experts and the weights

The gradients are those of pyhipa2a.jax_grad: dispatch's is a combine of the rows' gradients with unit
weights; combine's a dispatch of y's gradient with the same indices, each row weighted on its owner, and
the weights' gradient, the rows' dot products sent back, both through a narrow exchange of the weights'
rows of its own. Each rule's exchanges are whole pairs (dispatch's gradient lays the rows out again with
a dispatch of its own; combine's closes its dispatch), so a backward where x needs no gradient keeps
the object's calls paired; every rank must run the same backward. Rows packed or contiguous, x of the dtype
of y, the weights given to combine. The forward results are copies (autograd keeps them until the backward, past
the buffers' next calls), with the rows beyond each expert's count zeroed.
"""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from .api import AllToAll  # (the package, imported first, has registered its implementations)
from .errors import A2AError
from .inputs import check_scale


class Differentiable:
    """An AllToAll's dispatch and combine, differentiable (see the module's doc)."""

    def __init__(self, a2a, **narrow_params):
        c = a2a.config
        if c.by_source or c.scale_cols or not c.in_dtype == c.out_dtype == c.dispatch_dtype:
            raise A2AError("gradients need packed or contiguous rows and x, expert_x and y of one 16-bit dtype")
        self.a2a, self.config = a2a, c
        self.cols = c.weight_row_cols
        # (the weights' rows land where the tokens' do: the same routing, the same layout)
        layout = {"row_layout": "contiguous", "row_align": c.row_align, "max_recv_rows": c.recv_rows} \
            if c.contiguous else {}
        self.rows = AllToAll(a2a.heap.comm, num_experts=c.num_experts, experts_per_token=c.top_k,
                             hidden_dim=self.cols, max_num_tokens=c.max_tokens, in_dtype=c.out_dtype.name,
                             timeout=c.timeout, stream=c.stream, backend=a2a.backend, device=a2a.heap.device.index,
                             **layout, **narrow_params)
        self._indices = None

    def close(self) -> None:
        self.rows.close()

    def dispatch(self, x, indices):
        """A DispatchResult-like namespace: expert_x (a copy, differentiable), expert_num_tokens, expert_meta,
        expert_offsets (contiguous rows; else None)."""
        self._indices = indices
        expert_x, counts, meta, offsets = _Dispatch.apply(self, x, indices)
        return SimpleNamespace(expert_x=expert_x, expert_num_tokens=counts, expert_meta=meta,
                               expert_offsets=offsets if self.config.contiguous else None, num_tokens=int(x.shape[0]))

    def combine(self, expert_y, weights, expert_scale: float = 1.0):
        """y [T, H] (a copy), differentiable in expert_y and the weights."""
        if self._indices is None:
            raise A2AError("combine() follows a dispatch() of this object")
        return _Combine.apply(self, expert_y, weights, self._indices, check_scale(expert_scale))


def _valid_rows(expert_x, counts, offsets):
    """Which rows of expert_x a dispatch filled: [L, W*M] packed (offsets None), or [R] contiguous."""
    if offsets is None:
        return torch.arange(expert_x.shape[1], device=counts.device)[None, :] < counts[:, None].to(torch.int64)
    rows = torch.arange(expert_x.shape[0], device=counts.device)
    first = offsets[:-1].to(torch.int64)
    expert = (torch.searchsorted(first, rows, right=True) - 1).clamp(0, first.shape[0] - 1)  # (starts ascend)
    return rows < first[expert] + counts.to(torch.int64)[expert]


def _offsets(d, config):
    return _tensor(d.expert_offsets) if config.contiguous else None


def _copy_beyond_zeroed(expert_x, counts, offsets):
    """expert_x with the rows no token filled zeroed, so that no gradient flows from them; a failed call's rows
    (its counts -1, its rows NaN) are kept as they are, to read as the failure they are (tested on the device:
    no host wait)."""
    keep = _valid_rows(expert_x, counts, offsets) | (counts < 0).any()
    return torch.where(keep[..., None], expert_x, 0.0)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, moe, x, indices):
        d = moe.a2a.dispatch(x.detach(), indices)
        counts, meta = _tensor(d.expert_num_tokens).clone(), _tensor(d.expert_meta).clone()
        offsets = _offsets(d, moe.config)
        offsets = offsets.clone() if offsets is not None else torch.zeros(0, dtype=torch.int32, device=counts.device)
        ctx.moe, ctx.tokens = moe, int(x.shape[0])
        ctx.save_for_backward(indices)
        ctx.mark_non_differentiable(counts, meta, offsets)
        expert_x = _copy_beyond_zeroed(_tensor(d.expert_x), counts, offsets if moe.config.contiguous else None)
        return expert_x, counts, meta, offsets

    @staticmethod
    def backward(ctx, d_expert_x, *_):
        # A pair of its own (it runs only where x needs a gradient): a dispatch that lays the rows out
        # again, of zeros, then the combine of the rows' gradients with unit weights.
        moe, (indices,) = ctx.moe, ctx.saved_tensors
        dtype = _torch_dtype(moe.config.out_dtype)
        moe.a2a.dispatch(torch.zeros((ctx.tokens, moe.config.hidden), dtype=dtype, device=d_expert_x.device), indices)
        ones = torch.ones((ctx.tokens, moe.config.top_k), dtype=torch.float32, device=d_expert_x.device)
        dx = moe.a2a.combine(d_expert_x.to(dtype).contiguous(), ones)
        return None, _tensor(dx).clone(), None


class _Combine(torch.autograd.Function):
    @staticmethod
    def forward(ctx, moe, expert_y, weights, indices, scale):
        y = moe.a2a.combine(expert_y.detach().contiguous(), weights.detach().contiguous(), expert_scale=scale)
        ctx.moe, ctx.scale = moe, scale
        ctx.save_for_backward(expert_y.detach(), weights.detach(), indices)
        return _tensor(y).clone()

    @staticmethod
    def backward(ctx, dy):
        moe, scale = ctx.moe, ctx.scale
        expert_y, weights, indices = ctx.saved_tensors
        c, k, cols = moe.config, moe.config.top_k, moe.cols
        dtype = _torch_dtype(c.out_dtype)
        d = moe.a2a.dispatch(dy.to(dtype).contiguous(), indices)  # (closed below)
        counts, meta, dy_rows = _tensor(d.expert_num_tokens), _tensor(d.expert_meta), _tensor(d.expert_x).float()
        valid = _valid_rows(dy_rows, counts, _offsets(d, c))
        slot = meta[..., 2].clamp(0, k - 1).to(torch.int64)
        spread = _tensor(moe.rows.dispatch(_halves(weights, cols, dtype), indices).expert_x).float()
        weight = spread.gather(-1, (2 * slot)[..., None])[..., 0] + spread.gather(-1, (2 * slot + 1)[..., None])[..., 0]
        d_expert_y = torch.where(valid[..., None], scale * weight[..., None] * dy_rows, 0.0).to(expert_y.dtype)
        dots = torch.where(valid, scale * (expert_y.float() * dy_rows).sum(-1), 0.0)
        high = dots.to(dtype)
        low = (dots - high.float()).to(dtype)
        back = torch.zeros((*dots.shape, cols), dtype=dtype, device=dots.device)
        back.scatter_(-1, (2 * slot)[..., None], high[..., None])
        back.scatter_(-1, (2 * slot + 1)[..., None], low[..., None])
        summed = _tensor(moe.rows.combine(back, torch.ones_like(weights))).float()
        d_weights = summed[:, 0:2 * k:2] + summed[:, 1:2 * k:2]
        moe.a2a.combine(torch.zeros_like(expert_y), torch.ones_like(weights))  # (dispatch's gradient may not run)
        return None, d_expert_y, d_weights, None, None


def _tensor(a):
    """An output as a tensor: ours (outputs="ours") through DLPack, a tensor as it is."""
    return a if isinstance(a, torch.Tensor) else torch.from_dlpack(a)


def _halves(weights, cols: int, dtype):
    """[T, cols]: weight j as columns 2j (its 16-bit rounding) and 2j + 1 (the remainder)."""
    high = weights.to(dtype)
    low = (weights - high.float()).to(dtype)
    pairs = torch.stack([high, low], dim=-1).reshape(weights.shape[0], -1)
    return torch.nn.functional.pad(pairs, (0, cols - pairs.shape[1])).contiguous()


def _torch_dtype(dtype: np.dtype):
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}[np.dtype(dtype).name]
