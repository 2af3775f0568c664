"""Gradients of pyhipa2a.jax's dispatch and combine (jax.custom_vjp).

With rows packed and x in the dtype of y, on the rank that owns row r = row(t, j) of token t's slot j
(scale s: that rank's expert_scale):

    expert_x[r] = x[t]                      ->  dx[t] = sum_j d_expert_x[row(t, j)]
    y[t] = sum_j w[t, j] s expert_y[r]      ->  d_expert_y[r] = s w[t, j] dy[t],  dw[t, j] = s <expert_y[r], dy[t]>

So the backward pass is itself exchanges, each rule a pair of its own (a rule runs only where its inputs
need gradients: x may need none): combine's gradient dispatches dy with the same indices (its rows land
where the forward's did: the places depend on the routing alone), then closes that dispatch with a
combine of zeros; dispatch's gradient dispatches zeros with the same indices to lay the rows out again,
then combines d_expert_x with unit weights. The weights travel to the rows' owners, and each row's dot
product back to its token, through a second, narrow exchange of their own (the weights' rows): each fp32
value as two 16-bit halves (high, and the remainder), 22 of fp32's 24 significant bits in fp16, 16 in
bf16; in fp16 a dot product must stay within its range (65504).
Rows beyond a count hold whatever the buffer held (in XLA's buffers, NaN as often as not). A function of
expert_x over all its rows (an expert as one einsum) puts them into its gradients through 0 * garbage, so
under differentiation dispatch zeroes them, whether or not x itself needs a gradient, and their gradients
are zero. Outside it (a forward pass; an eager call) the rules are left out: they would cost a full pass
over expert_x, and in an eager call JAX's custom_vjp alone costs more than the exchange. A program traced
outside it is differentiated later as it was traced (jax.grad of a jitted function that ran before), its
rows not zeroed, so its calls refuse that (refusing_gradients): NaN rows times a zero gradient would
reach the expert's weights' gradient where x takes none.

Order, by data alone (XLA keeps no other order between custom calls: its CPU compiler drops optimization
barriers): each call takes an order word the calls it must follow made. Combine's gradient dispatches after
the forward combine (its order word is a residual: y's gradient need not depend on y) and after the
object's last call (a later layer's rules); the narrow pair and the closing combine follow that dispatch.
Dispatch's gradient follows the object's last call (the closing combine, where combine's gradient ran)
and the rows' gradients. Each rule leaves its objects' last order words for the next (order_after).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import core as _jax_core

from .errors import A2AError

try:  # (JAX names its differentiating traces nowhere public; without them the rules always run)
    from jax._src.interpreters import ad as _ad
except ImportError:
    _ad = None


def no_order():
    """The order word of a call that follows the calls before it through its data alone."""
    return jnp.zeros((1,), jnp.int32)


def running_traces():
    """The traces running now, innermost first. (JAX names no public way to ask: its trace context and each
    trace's parent say so; pyhipa2a.jax refuses a JAX without them.)"""
    trace = _jax_core.trace_ctx.trace
    while trace is not None:
        yield trace
        trace = getattr(trace, "parent_trace", None)


def program_trace():
    """The trace of the function being traced now (jax.jit, jax.grad, scan; the innermost), or None in an eager
    call."""
    trace = _jax_core.trace_ctx.trace
    return None if isinstance(trace, _jax_core.EvalTrace) else trace


def refusing_gradients(call, why: str):
    """`call` as a function that JAX, differentiating it, refuses with an A2AError saying `why`, rather than in its
    own words for a custom call or callback without a rule: a traced call that takes no rules (a program traced
    without differentiation may be differentiated later: jax.grad of a jitted function that ran before). An
    eager call is returned as it is: outside differentiation, nothing differentiates it later."""
    if program_trace() is None:
        return call
    refused = jax.custom_jvp(call)

    def refuse(primals, tangents):
        raise A2AError(f"no gradient through this call: {why}")
    refused.defjvp(refuse)
    return refused


def differentiating() -> bool:
    """Whether a call traced now can be differentiated: a JVP or linearization runs around it (jax.grad,
    jax.vjp, jax.jvp; jit or scan inside them included). A JAX whose traces are named otherwise is taken to
    be differentiating: the rules then run always, correct and slower."""
    kinds = tuple(getattr(_ad, name) for name in ("JVPTrace", "LinearizeTrace") if hasattr(_ad, name))
    return len(kinds) < 2 or any(isinstance(t, kinds) for t in running_traces())


def differentiable_dispatch(a2a, x, indices, order):
    """(the JaxDispatch, the order word out) of a differentiable dispatch."""
    tokens, dtype = x.shape[0], x.dtype

    @jax.custom_vjp
    def dispatch(x, indices, order):  # (what runs where x needs no gradient: its rows zeroed all the same)
        d, order = a2a.dispatch_after(order, x, indices)
        return d._replace(expert_x=_zero_beyond(d)), order

    def forward(x, indices, order):
        return dispatch(x, indices, order), indices

    def backward(indices, cotangents):
        # A pair of its own: a dispatch that lays the rows out again (of zeros, after this object's last
        # call and once the rows' gradients are in), then the combine of those gradients with unit weights.
        c, d_expert_x = a2a.config, cotangents[0].expert_x
        zeros = jnp.zeros((tokens, c.hidden), c.in_dtype)
        _, laid_out = a2a.dispatch_after(a2a.order_after(_word_after(d_expert_x)), zeros, indices)
        ones = jnp.ones((tokens, c.top_k), jnp.float32)
        dx, _ = a2a.combine_after(laid_out, d_expert_x.astype(c.out_dtype), ones, 1.0)
        return dx.astype(dtype), None, None
    dispatch.defvjp(forward, backward)
    return dispatch(x, indices, order)


def differentiable_combine(a2a, rows, order, expert_y, weights, indices, scale: float):
    """(y, the order word out) of a differentiable combine after the dispatch of `indices`; its weights'
    gradient crosses `rows`, a JaxAllToAll of the weights' rows (config.weight_row_cols wide)."""
    cols = rows.config.hidden

    @functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
    def combine(expert_y, weights, indices, order, scale):
        return a2a.combine_after(order, expert_y, weights, scale)

    def forward(expert_y, weights, indices, order, scale):
        y, done = a2a.combine_after(order, expert_y, weights, scale)
        return (y, done), (expert_y, weights, indices, done)

    def backward(scale, res, cotangents):
        (expert_y, weights, indices, done), dy = res, cotangents[0]
        c, k = a2a.config, a2a.config.top_k
        # A pair of its own, after this combine (y's gradient need not depend on y: a linear loss) and after
        # the object's last call (a later layer's rules): the dispatch of dy, closed below whether or not x
        # has a gradient to take.
        d, dispatched = a2a.dispatch_after(a2a.order_after(done), dy.astype(c.in_dtype), indices)
        valid = _valid_rows(d)
        slot = jnp.clip(d.expert_meta[..., 2], 0, k - 1)
        halves = _halves(weights, cols, c.out_dtype)
        spread, between = rows.dispatch_after(rows.order_after(dispatched), halves, indices)
        weight = _joined(spread.expert_x, 2 * slot)  # w[t, j] of each row
        dy_rows = d.expert_x.astype(jnp.float32)
        d_expert_y = jnp.where(valid[..., None], scale * weight[..., None] * dy_rows, 0.0)
        dots = jnp.where(valid, scale * jnp.sum(expert_y.astype(jnp.float32) * dy_rows, axis=-1), 0.0)
        back = _placed_halves(dots, 2 * slot, cols, c.out_dtype)
        ones = jnp.ones(weights.shape, jnp.float32)
        summed, _ = rows.combine_after(between, back, ones, 1.0)
        summed = summed.astype(jnp.float32)
        d_weights = summed[:, 0:2 * k:2] + summed[:, 1:2 * k:2]
        # (Not ordered with the narrow pair, an exchange of another object: every rank runs one program,
        # compiled alike, so the two come in one order everywhere.)
        closed, _ = a2a.combine_after(dispatched, jnp.zeros_like(expert_y), ones, 1.0)
        # What follows on either object (dispatch's gradient, an earlier layer's rules) comes after these
        # calls through the objects' order words (order_after), so no other pair interleaves with them.
        # The barrier only keeps the closing combine: JAX drops a call none of whose results is used, and
        # the GPU's calls carry no JAX effect (pyhipa2a.jax: JAX's fast dispatch); it orders nothing.
        d_expert_y, d_weights, _ = jax.lax.optimization_barrier(
            (d_expert_y.astype(expert_y.dtype), d_weights, closed))
        return d_expert_y, d_weights, None, None
    combine.defvjp(forward, backward)
    return combine(expert_y, weights, indices, order, scale)


def _word_after(x):
    """An order word computed from `x` (no call reads an order word's value): a call that takes it comes after
    whatever made `x`. (Not an optimization barrier: XLA's CPU compiler drops those, and the order with them.)"""
    return jax.lax.convert_element_type(x.reshape(-1)[:1], jnp.int32)


def _valid_rows(d):
    """Which rows of a dispatch's expert_x it filled: [L, W*M] packed, or [R] contiguous (expert l's from its
    offset)."""
    counts = d.expert_num_tokens
    if d.expert_offsets is None:
        return jnp.arange(d.expert_x.shape[1])[None, :] < counts[:, None]
    rows, first = jnp.arange(d.expert_x.shape[0]), d.expert_offsets[:-1]
    expert = jnp.clip(jnp.searchsorted(first, rows, side="right") - 1, 0, first.shape[0] - 1)  # (starts ascend)
    return rows < first[expert] + counts[expert]


def _zero_beyond(d):
    return jnp.where(_valid_rows(d)[..., None], d.expert_x, jnp.zeros((), d.expert_x.dtype))


def _halves(weights, cols: int, dtype):
    """[T, cols]: weight j as columns 2j (its 16-bit rounding) and 2j + 1 (the remainder)."""
    pairs = jnp.stack(_split(weights, dtype), axis=-1).reshape(weights.shape[0], -1)
    return jnp.pad(pairs, ((0, 0), (0, cols - pairs.shape[1])))


def _joined(spread, column):
    """Each row's value from its two halves at `column` and `column + 1`."""
    f = spread.astype(jnp.float32)
    take = functools.partial(jnp.take_along_axis, f, axis=-1)
    return (take(column[..., None]) + take(column[..., None] + 1))[..., 0]


def _placed_halves(values, column, cols: int, dtype):
    """[L, R, cols]: each row's value as two halves at `column` and `column + 1`, zeros elsewhere."""
    high, low = _split(values, dtype)
    where = jnp.arange(cols)
    return jnp.where(where == column[..., None], high[..., None],
                     jnp.where(where == column[..., None] + 1, low[..., None], np.zeros((), dtype)))


def _split(values, dtype):
    """fp32 `values` as two 16-bit halves: their rounding to `dtype`, and the remainder."""
    high = values.astype(dtype)
    return high, (values - high.astype(jnp.float32)).astype(dtype)
