"""Dispatch and combine inside jax.jit: JaxAllToAll.

    a2a = JaxAllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M)

    @jax.jit
    def moe(x, indices, weights):
        d = a2a.dispatch(x, indices)                 # JAX arrays: d.expert_x, d.expert_num_tokens, ...
        return a2a.combine(experts(d), weights)     # y [T, H]

Made like AllToAll (the same parameters, one process a GPU under mpirun). Every rank runs the same
program: each traced call is one exchange on every rank, each dispatch combined before the next.

Or one process driving all its GPUs, as JAX runs a node: the ranks are devices of this process, in order
(pyhipa2a.local), and the calls are traced inside shard_map over the object's mesh:

    a2a = JaxAllToAll(devices=jax.local_devices(), axis_name="ep", num_experts=E, ...)
    moe = jax.jit(jax.shard_map(moe_of_one_rank, mesh=a2a.mesh, in_specs=P("ep"), out_specs=P("ep")))

There each device's part of the program calls its rank (XLA's handler picks the rank by the GPU it runs
on; one rank a GPU, GPUs that reach each other's memory).

On a GPU a call is one launch of our kernel on XLA's stream, through XLA's FFI: csrc/jax_ffi.cc, built
by `python -m pyhipa2a.build` against the jaxlib installed, reads XLA's operands and writes XLA's
results in place. On JAX's CPU platform (the host backend, as CI runs it) a call is the eager call, made
through jax.experimental.buffer_callback on NumPy views of XLA's buffers (a callback that makes a JAX
array, even by np.asarray, can deadlock XLA's CPU runtime once every device's thread waits in one).
Either way the calls of one object in one traced function are chained by an order word (an operand and a
result of each call), so XLA keeps them in program order by data alone (the callbacks are not ordered
otherwise, as the GPU's custom calls are not: CI tests the order GPUs rely on), and the custom calls are
marked as having side effects, so XLA drops none. JAX's tracing itself drops a call none of whose
results is used (a combine whose y is never read): the next dispatch then finds its predecessor uncombined
and reports it (docs/DESIGN.md: its results are not all poison then). A call whose kernels reported an
error (a peer that never came, bad routing, that refusal) must not be read; the next call raises, and
`check()` raises the error now.

Gradients (pyhipa2a.jax_grad, `jax.custom_vjp`, only for calls traced under differentiation) are exchanges
too, so every rank must differentiate the same program. They need packed or contiguous rows, x of the dtype
of y, the weights given to combine, and combine's dispatch traced in the same function (Dispatched); a traced
call without them refuses differentiation, saying why. `gradients=False` leaves them out (and the narrow
exchange of the weights' rows they make).
"""
from __future__ import annotations

import ctypes
import functools
from pathlib import Path
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.buffer_callback import buffer_callback
from jax._src import core as _jax_core
from jax.extend.core import Primitive
from jax.interpreters import mlir

from .api import AllToAll  # (the package, imported first, has registered its implementations)
from .errors import A2AError, RuntimeFailure
from .inputs import check_scale
from .jax_grad import (differentiable_combine, differentiable_dispatch, differentiating, no_order, program_trace,
                       refusing_gradients, running_traces)
from .kernels import X_FP8, A2AArgs, CombineCall, DispatchCall, i32, name_own_outputs, u32, u64
from .local import each, open_ranks

_HANDLER = Path(__file__).resolve().parent / "_code" / "_jax_ffi.so"
_TARGET = "pyhipa2a_launch"
_PLACES = 8


class FfiSite(ctypes.Structure):  # csrc/jax_ffi.cc: Site
    _fields_ = [("launch", u64), ("function", u64), ("fixed", u64), ("status", u64), ("next", ctypes.c_int64),
                ("grid", u32), ("block", u32), ("call_bytes", u32), ("device", i32), ("operand_at", i32 * _PLACES),
                ("result_at", i32 * _PLACES), ("call", ctypes.c_uint8 * 128)]


class JaxDispatch(NamedTuple):
    """dispatch()'s results (JAX arrays), as AllToAll's DispatchResult names them."""
    expert_x: jax.Array           # [L, W*M, H], or [R, H] with row_layout="contiguous"
    expert_num_tokens: jax.Array  # int32 [L]
    expert_meta: jax.Array        # int32 [L, W*M, 3] (or [R, 3]): (src_rank, src_token, src_k)
    expert_x_scales: jax.Array | None = None  # float32 [L, W*M, H / 128] (or [R, ...]) in fp8 dispatch
    expert_layout: jax.Array | None = None    # int32 [L, W, 2] with row_layout="by_source"
    expert_offsets: jax.Array | None = None   # int32 [L + 1] with row_layout="contiguous"


@functools.lru_cache(maxsize=None)
def _handler():
    """The loaded handler, registered with XLA for CUDA and ROCm once a process."""
    if not _HANDLER.exists():
        raise A2AError(f"JaxAllToAll on a GPU needs XLA's handler {_HANDLER.name}: run `python -m pyhipa2a.build` "
                       "where jaxlib is installed")
    lib = ctypes.CDLL(str(_HANDLER))
    lib.pyhipa2a_ffi_site.restype = ctypes.c_int64
    lib.pyhipa2a_ffi_site.argtypes = [ctypes.POINTER(FfiSite)]
    lib.pyhipa2a_ffi_site_bytes.restype = ctypes.c_uint64
    lib.pyhipa2a_ffi_retire.argtypes = [ctypes.c_int64]
    if lib.pyhipa2a_ffi_site_bytes() != ctypes.sizeof(FfiSite):
        raise A2AError(f"{_HANDLER.name} was built for another layout: run `python -m pyhipa2a.build` again")
    for platform in ("CUDA", "ROCM"):
        jax.ffi.register_ffi_target(_TARGET, jax.ffi.pycapsule(lib.pyhipa2a_ffi_launch), platform=platform)
    return lib


# One call of a registered site on a GPU: the operands in, `shapes` ((shape, dtype), ...) out. A primitive of
# our own rather than jax.ffi.ffi_call(has_side_effect=True): that marks the traced function as effectful,
# which takes JAX's dispatch off its fast path (250 us more a step on an H200), while all XLA needs to keep
# every call is the custom call's own side-effect flag, which this lowering sets.
_launch = Primitive(_TARGET)
_launch.multiple_results = True
_launch.def_abstract_eval(lambda *operands, site, shapes: [jax.core.ShapedArray(s, d) for s, d in shapes])
_launch.def_impl(lambda *operands, site, shapes: _compiled(site, shapes)(*operands))
_ffi_rule = jax.ffi.ffi_lowering(_TARGET, has_side_effect=True)
for _platform in ("cuda", "rocm"):
    mlir.register_lowering(_launch, lambda ctx, *operands, site, shapes: _ffi_rule(ctx, *operands, site=np.int64(site)),
                           platform=_platform)


# The mesh of a program whose ranks are devices, checked as it is lowered (the mesh's devices are known only
# then): along the object's axis, its devices in rank order. On GPUs each device's part of the program calls
# the rank on its GPU, so a mesh in another order would give a position another rank's experts. The word
# passes through unchanged; the check emits nothing.
_mesh_check = Primitive("pyhipa2a_mesh_check")
_mesh_check.def_abstract_eval(lambda word, *, axis, devices: word)
_mesh_check.def_impl(lambda word, *, axis, devices: word)


def _lower_mesh_check(ctx, word, *, axis, devices):
    mesh = getattr(ctx.module_context.axis_context, "mesh", None)  # (shard_map's, where JAX's lowering names it)
    if mesh is not None and axis in mesh.axis_names:
        along = np.moveaxis(np.asarray(mesh.devices), mesh.axis_names.index(axis), -1).reshape(-1, len(devices))
        if any(tuple(d.id for d in row) != devices for row in along):
            raise ValueError(f"shard_map's mesh lists the devices along {axis!r} as {[d.id for d in along[0]]}, "
                             f"but this object's ranks are devices {list(devices)} in that order: map over "
                             "a2a.mesh")
    return [word]


mlir.register_lowering(_mesh_check, _lower_mesh_check)


@functools.lru_cache(maxsize=None)
def _compiled(site: int, shapes: tuple):
    """An eager call of a site: the call alone, jitted once."""
    return jax.jit(functools.partial(_launch.bind, site=site, shapes=shapes))


class JaxAllToAll:
    """AllToAll's dispatch and combine as JAX operations (see the module's doc)."""

    def __init__(self, comm=None, *, devices=None, axis_name: str | None = None, gradients: bool = True, **params):
        self._axis = axis_name
        self._ranks = _open_ranks(comm, devices, axis_name, params)
        first = self._ranks[0]  # (what every rank shares: the configuration, the backend's kind)
        try:
            self.config = c = first.config
            self.world = c.world
            # One rank a process: its rank and its GPU among JAX's (its arrays must be there). Ranks that are
            # devices: None; `mesh` lays the ranks out.
            self.rank = first.rank if devices is None else None
            self.device_index = first.heap.device.index if devices is None else None
            self.devices = None if devices is None else list(devices)
            self._on_gpu = first.backend.kind != "host"
            if not hasattr(_jax_core, "trace_ctx"):  # (without it no call could be chained: refuse, do not guess)
                raise A2AError(f"JaxAllToAll does not know this JAX ({jax.__version__}): its trace context moved")
            if self._on_gpu:
                if first.layout.nodes > 1:
                    raise A2AError("JaxAllToAll on GPUs runs within one node (its calls across nodes are "
                                   "AllToAll's eager ones)")
                gpus = [a.heap.device.index for a in self._ranks]
                if len(set(gpus)) < len(gpus):  # (XLA's handler tells the ranks of a call apart by their GPU)
                    raise ValueError(f"JaxAllToAll(devices=...) takes one rank a GPU; its ranks are on GPUs {gpus}")
                self._lib = _handler()
                self._entry = first.backend.launch_entry()
                if self._entry is None:
                    raise A2AError("JaxAllToAll: the GPU driver's launch entry was not found")
            self._sites: dict = {}      # GPU: the handler's numbers of each kind of call (_site)
            # Host: each kind of call's callback, made once: an eager call is compiled for its callback, so a
            # new one at every call compiled every call anew (25 ms an eager step).
            self._callbacks: dict = {}
            self._order = None   # the order word of this object's last traced call
            self._dispatched: Dispatched | None = None
            self._weight_rows = None
            # Gradients need packed or contiguous rows, 16-bit x of the dtype of y, and an exchange of the weights'
            # rows (laid out as the tokens' are: the same parameters but the width).
            self._no_gradients = _why_no_gradients(c, gradients)
            if self._no_gradients is None:  # (the weights' rows: two 16-bit halves a weight)
                narrow = {**params, "hidden_dim": c.weight_row_cols, "in_dtype": c.out_dtype.name,
                          "out_dtype": c.out_dtype.name, "dispatch_dtype": None}
                self._weight_rows = JaxAllToAll(comm, devices=devices, axis_name=axis_name, gradients=False, **narrow)
        except BaseException:
            _close_ranks(self._ranks)
            raise

    @property
    def mesh(self) -> jax.sharding.Mesh:
        """Ranks that are devices: the mesh to shard_map the calls over, the ranks in order along `axis_name`."""
        if self.devices is None:
            raise A2AError("mesh: this object's ranks are processes (made with a communicator, not devices=)")
        return jax.sharding.Mesh(np.array(self.devices), (self._axis,))

    # -- shapes -------------------------------------------------------------------
    @functools.cached_property
    def _dispatch_results(self) -> tuple[tuple[str, ...], tuple[str, ...], tuple[jax.ShapeDtypeStruct, ...]]:
        """dispatch()'s results in order, as three columns: their names in JaxDispatch and DispatchResult, the
        DispatchCall fields the kernel writes them through, their shapes (the configuration's: made once). The
        table's last column: whether the configuration has that result."""
        c = self.config
        L, rows, int32 = c.local_experts, c.rows_shape, jnp.int32
        results = [("expert_x", "expert_x", (*rows, c.hidden), c.dispatch_dtype, True),
                   ("expert_num_tokens", "expert_num_tokens", (L,), int32, True),
                   ("expert_meta", "expert_meta", (*rows, 3), int32, True),
                   ("expert_x_scales", "expert_scales", (*rows, c.scale_cols), jnp.float32, c.scale_cols),
                   ("expert_layout", "expert_layout", (L, c.world, 2), int32, c.by_source),
                   ("expert_offsets", "expert_offsets", (L + 1,), int32, c.contiguous)]
        return tuple(zip(*((name, field, jax.ShapeDtypeStruct(shape, dtype))
                           for name, field, shape, dtype, made in results if made)))

    # -- calls ----------------------------------------------------------------------
    def dispatch(self, x, indices, weights=None, x_scales=None) -> JaxDispatch:
        """AllToAll.dispatch on JAX arrays (traceable): x [T, H], indices [T, k] int32, weights [T, k] float32
        (sent with the routing: combine then takes none), x_scales with fp8 x. Differentiable in x where
        neither weights nor scales are given and the rows are packed or contiguous (its gradient: a combine of
        the rows' gradients with unit weights)."""
        last = self._dispatched
        if last is not None and not last.combined and last.in_this_function():
            raise A2AError("dispatch() called again before combine(): each dispatch is combined once")
        order = self.order_after()
        why = (self._no_gradients or (weights is not None and _SENT_WEIGHTS)
               or (not differentiating() and _TRACED_UNDIFFERENTIATED) or None)
        if why is None:
            d, self._order = differentiable_dispatch(self, x, indices, order)
        else:
            d, self._order = refusing_gradients(self.dispatch_after, why)(order, x, indices, weights, x_scales)
        self._dispatched = Dispatched(int(x.shape[0]), indices, weights is not None, program_trace())
        return d

    def dispatch_after(self, order, x, indices, weights=None, x_scales=None) -> tuple:
        """(the JaxDispatch, the order word out) of a dispatch after the call whose order word is `order`
        (no_order() for none; order_after() for this object's last call): dispatch() for rules that order
        calls themselves. The word out becomes the object's last."""
        c = self.config
        order = self._on_axis(order)
        T = _checked_tokens(x, c)
        _check_operand("indices", indices, (T, c.top_k), np.int32)
        if weights is not None:
            _check_operand("weights", weights, (T, c.top_k), np.float32)
        if (x_scales is None) != (c.x_format != X_FP8):
            raise TypeError("x_scales go with fp8 x (AllToAll(in_dtype='float8_e4m3')) and only with it")
        names, outputs, shapes = self._dispatch_results
        *arrays, order = self._call("dispatch", order, dict(x=x, indices=indices, weights=weights, x_scales=x_scales),
                                    shapes, outputs, names, num_tokens=T, check_pairing=1)
        return JaxDispatch(**dict(zip(names, arrays))), order

    def combine(self, expert_y, weights=None, expert_scale: float = 1.0):
        """AllToAll.combine on JAX arrays (traceable): y [T, H] from expert_y [L, W*M, H] and the weights
        [T, k] float32, unless dispatch sent them. `expert_scale`: a Python number (part of the program).
        Differentiable in expert_y and the weights after a differentiable dispatch in the same trace (the
        gradient: a dispatch of y's gradient, weighted, and the weights' gradient)."""
        last, order = self._dispatched, self.order_after()
        ours = last is not None and last.checks_combine()
        if weights is None and last is not None and not ours:
            raise TypeError("combine() traced apart from its dispatch() needs the weights [T, k] float32 (given to "
                            "combine, not sent by dispatch): its token count must be its program's own, where a "
                            "program that took it from the dispatch traced before keeps it when the count changes")
        if ours:
            if weights is None and not last.sent:
                raise TypeError("combine() needs the weights [T, k] float32: here, or given to dispatch(weights=)")
            if weights is not None and last.sent:
                raise ValueError("the weights were given to dispatch(), which sent them: combine() takes none")
            if weights is not None and int(weights.shape[0]) != last.tokens:
                raise ValueError(f"weights has {int(weights.shape[0])} rows but the dispatch before had "
                                 f"{last.tokens} tokens")
        why = (self._no_gradients or (weights is None and _SENT_WEIGHTS)
               or (not (ours and last.in_this_function()) and _DISPATCH_ELSEWHERE)
               or (not differentiating() and _TRACED_UNDIFFERENTIATED) or None)
        if why is None:
            y, self._order = differentiable_combine(self, self._weight_rows, order, expert_y, weights, last.indices,
                                                    check_scale(expert_scale))
        else:
            call = functools.partial(self.combine_after, expert_scale=expert_scale)
            y, self._order = refusing_gradients(call, why)(order, expert_y, weights)
        if last is not None:
            self._dispatched = last._replace(combined=True)
        return y

    def combine_after(self, order, expert_y, weights=None, expert_scale: float = 1.0) -> tuple:
        """(y, the order word out) of a combine after the call whose order word is `order` (as dispatch_after)."""
        c = self.config
        order = self._on_axis(order)
        _check_operand("expert_y", expert_y, (*c.rows_shape, c.hidden), c.out_dtype)
        if weights is not None:
            T = int(weights.shape[0])
            _check_operand("weights", weights, (T, c.top_k), np.float32)
        elif self._dispatched is None:
            raise A2AError("combine() needs the weights, or a dispatch() traced before it that sent them")
        else:
            T = self._dispatched.tokens
        scale = check_scale(expert_scale)  # (while tracing: a bad one refused before any call of the program runs)
        y, order = self._call("combine", order, dict(expert_y=expert_y, weights=weights),
                              (jax.ShapeDtypeStruct((T, c.hidden), c.out_dtype),), ("out",), num_tokens=T,
                              expert_scale=scale)
        return y, order

    def check(self) -> None:
        """Raise the error the kernels reported, if any (the calls' results are then poisoned)."""
        for a2a in self._ranks:
            a2a.synchronize()

    def close(self) -> None:
        """Idempotent. A program compiled with this object's calls is refused from now on."""
        for numbers in self._sites.values():  # (before the memory they name goes)
            for number in numbers:
                self._lib.pyhipa2a_ffi_retire(number)
        self._sites.clear()
        try:
            if self._weight_rows is not None:
                self._weight_rows.close()
        finally:
            _close_ranks(self._ranks)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _on_axis(self, order):
        """Ranks that are devices: the call is traced inside shard_map, over an axis of one device a rank, and
        (checked as the program is compiled) the axis lists the object's devices in rank order. `order`, the
        call's order word, carries that check."""
        if self._axis is None:
            return order
        try:
            size = jax.lax.psum(1, self._axis)  # (of a Python number: the axis's size, known while tracing)
        except NameError:
            raise A2AError(f"a JaxAllToAll made with devices= is called inside shard_map over its axis "
                           f"{self._axis!r} (mesh=a2a.mesh)") from None
        if size != len(self._ranks):
            raise ValueError(f"shard_map's axis {self._axis!r} has {size} devices, but this object has "
                             f"{len(self._ranks)} ranks: map over a2a.mesh")
        return _mesh_check.bind(order, axis=self._axis, devices=tuple(d.id for d in self.devices))

    # -- the order of an object's calls -------------------------------------------
    def order_after(self, *words):
        """The order word of a call after this object's last call (where that can still be used) and after the
        calls whose order words are `words`: a join the program computes, so XLA orders by data alone."""
        # The last call's word where it can still be used: a concrete array, or a tracer of the trace being
        # traced now or of one around it; a tracer of a differentiating trace that has ended stands for its
        # primal value, which lives on (the backward pass follows the forward's last call that way); else None.
        joined = self._order
        while isinstance(joined, jax.core.Tracer) and not any(t is getattr(joined, "_trace", None)
                                                              for t in running_traces()):
            joined = getattr(joined, "primal", None)  # (JAX's JVP and linearize tracers name it so; others: None)
        for word in words:
            joined = word if joined is None else jnp.maximum(joined, word)
        return no_order() if joined is None else joined

    # -- a call, on a GPU or on the host ----------------------------------------------
    def _call(self, leg: str, order, operands: dict, shapes, outputs, names=None, **values) -> list:
        """The results of a `leg` call after the call whose order word is `order`, the order word out last (now
        the object's last). `operands`: the call's fields (None where not given); `shapes`: its results', which
        the kernel writes through its fields `outputs` and the eager call names `names` (combine: none, y
        itself); `values`: the call's other arguments."""
        operands = {field: a for field, a in operands.items() if a is not None}
        shapes = (*shapes, jax.ShapeDtypeStruct((1,), jnp.int32))  # (the order word out)
        if self._on_gpu:
            site = self._site(leg, values["num_tokens"], tuple(operands), outputs, **values)
            results = _launch.bind(*operands.values(), order, site=site,
                                   shapes=tuple((tuple(s.shape), np.dtype(s.dtype)) for s in shapes))
        else:
            results = self._host_call(leg, order, operands, shapes, names, values.get("expert_scale"))
        results = self._varying(results)
        self._order = results[-1]
        return results

    def _site(self, leg: str, tokens: int, fields: tuple, outputs: tuple, **values) -> int:
        """The handler's number for a `leg` call of `tokens` tokens with these operands and results: the site of
        the first rank, which names the next rank's (the handler takes the one on the GPU it runs on)."""
        key = (leg, tokens, fields, outputs, tuple(sorted(values.items())))
        numbers = self._sites.get(key)
        if numbers is not None:
            return numbers[0]
        call_type = DispatchCall if leg == "dispatch" else CombineCall
        numbers, after = [], 0
        for a2a in reversed(self._ranks):
            kernel, blocks, threads, fixed = a2a.launch_site(leg, tokens)
            call = call_type(**values)
            if call_type is DispatchCall:  # (the outputs XLA gives are patched over ours at each call)
                name_own_outputs(call, A2AArgs.from_address(fixed))
            site = FfiSite(launch=self._entry, function=a2a.backend.function_address(kernel.function), fixed=fixed,
                           status=a2a.buffers.status.ctypes.data, next=after, grid=blocks, block=threads,
                           call_bytes=ctypes.sizeof(call), device=a2a.heap.device.index)
            for places, names in ((site.operand_at, fields), (site.result_at, outputs)):
                places[:] = [getattr(call_type, name).offset for name in names] + [-1] * (_PLACES - len(names))
            ctypes.memmove(site.call, ctypes.addressof(call), ctypes.sizeof(call))
            after = self._lib.pyhipa2a_ffi_site(ctypes.byref(site))
            if after <= 0:
                raise A2AError("XLA's handler refused the call's arguments")
            numbers.insert(0, after)
        self._sites[key] = numbers
        return numbers[0]

    def _host_call(self, leg: str, order, operands: dict, shapes, names, scale) -> list:
        """JAX's CPU platform (the host backend): the call is its rank's eager call, made through a buffer
        callback on NumPy views of XLA's buffers. The callback is told its rank: where ranks are devices, each
        device's part of the program calls back on a thread of its own (which the host backend needs: it runs
        kernels at launch, and they wait for the other ranks')."""
        if self._axis is None:
            rank = jnp.zeros((1,), jnp.int32)
        else:
            rank = jax.lax.axis_index(self._axis).astype(jnp.int32).reshape(1)
        fields = tuple(operands)
        kind = (leg, fields, names, scale)
        run = self._callbacks.get(kind)
        if run is None:
            def run(context, outs, rank, *buffers):  # (NumPy views of XLA's buffers: no JAX array made in a callback)
                a2a = self._ranks[int(np.asarray(rank)[0])]
                arrays = dict(zip(fields, map(np.asarray, buffers)))  # (the order word, last, read by nobody)
                if leg == "dispatch":
                    d = a2a.dispatch(**arrays)
                    results = [getattr(d, name).numpy() for name in names]
                else:
                    results = [a2a.combine(**arrays, expert_scale=scale).numpy()]
                for out, value in zip(outs, [*results, 0]):
                    np.asarray(out)[...] = value
            self._callbacks[kind] = run
        return list(buffer_callback(run, shapes, has_side_effect=True)(rank, *operands.values(), order))

    def _varying(self, results) -> list:
        """Ranks that are devices: the results differ from device to device, and are typed so (varying along
        the axis, as shard_map types values); the gradient rules' results must carry their inputs' types."""
        if self._axis is None:
            return list(results)
        return [r if self._axis in getattr(jax.typeof(r), "vma", ()) else jax.lax.pcast(r, self._axis, to="varying")
                for r in results]


class Dispatched(NamedTuple):
    """The dispatch traced or called last, as combine() needs it: its token count, its indices, whether it sent
    the weights, and the trace of the function it was traced in (None: an eager call). A compiled program runs
    again without Python, so Python sees every call only within one traced function: there this is combine's
    own dispatch, with indices that are the program's own data. (Between eager calls a compiled program may
    have run unseen: eager calls are checked against the last eager dispatch all the same, and the device
    pairs them whatever Python saw.)"""
    tokens: int
    indices: object
    sent: bool
    trace: object
    combined: bool = False

    def in_this_function(self) -> bool:
        """Traced in the function being traced now, or in one around it."""
        return self.trace is not None and any(t is self.trace for t in running_traces())

    def checks_combine(self) -> bool:
        """Whether combine() is checked against this dispatch: in one function, or both calls eager."""
        return not self.combined and (self.in_this_function() or (self.trace is None and program_trace() is None))


_SENT_WEIGHTS = ("the weights were sent by dispatch(weights=), which takes no gradient: give them to combine() "
                 "to differentiate the step")
_TRACED_UNDIFFERENTIATED = (
    "it was traced without differentiation, and JAX differentiates that program as it was traced (jax.grad of a "
    "jitted function that ran before): its dispatch's rows beyond the counts, not zeroed, would reach the "
    "expert's gradients. Differentiate a function that has not run undifferentiated: jax.jit(jax.grad(f)), or "
    "jax.grad of a new jax.jit(f)")
_DISPATCH_ELSEWHERE = ("combine() is differentiated only in the function that traced its dispatch() (one jax.grad, "
                       "jax.vjp or jax.jit around both): its gradient dispatches again with that dispatch's "
                       "indices, which must be the program's own data, not Python's memory of another call")


def _why_no_gradients(c, gradients: bool) -> str | None:
    """Why this object's calls take no gradient rules, or None where they do."""
    if not gradients:
        return "JaxAllToAll(gradients=False) differentiates nothing"
    if c.by_source or c.scale_cols or not c.in_dtype == c.out_dtype == c.dispatch_dtype:
        return ("gradients need rows packed or contiguous and x in the dtype of y (no fp8 dispatch); this object "
                f"has row_layout={'by_source' if c.by_source else 'contiguous' if c.contiguous else 'packed'}, "
                f"x {c.in_dtype.name}, y {c.out_dtype.name}, rows {c.dispatch_dtype.name}")
    return None


def _open_ranks(comm, devices, axis_name, params: dict) -> list:
    """[the process's AllToAll]; or, given devices, one AllToAll a device, these ranks in this order."""
    if devices is None and axis_name is not None:
        raise TypeError("axis_name goes with devices= (ranks that are devices of this process)")
    if devices is not None:
        if comm is not None:
            raise TypeError("JaxAllToAll takes a communicator (one rank a process) or devices= (ranks that are "
                            "devices of this process), not both")
        if axis_name is None:
            raise TypeError("devices= needs axis_name: the shard_map axis along which the devices are the ranks")
        devices = list(devices)
        if not devices:
            raise ValueError("devices= is empty")
        # (a GPU's ordinal among those this process sees; JAX's CPU devices all stand for the host backend's one)
        ordinals = [None if d.platform == "cpu" else d.local_hardware_id for d in devices]
    try:
        if devices is None:
            return [AllToAll(comm, **params)]
        return open_ranks(len(ordinals), lambda comm: AllToAll(comm, device=ordinals[comm.Get_rank()], **params))
    except RuntimeFailure as e:
        if "out of memory" not in str(e).lower():
            raise
        raise A2AError(f"{e}. JAX takes 75% of each GPU's memory at its start unless told otherwise: set "
                       "XLA_PYTHON_CLIENT_PREALLOCATE=false (or a smaller XLA_PYTHON_CLIENT_MEM_FRACTION) before "
                       "JAX starts, so the exchange's buffers fit beside it") from e


def _close_ranks(ranks: list) -> None:
    """Close every rank, at once where they are several (a rank's close waits for the others'); the one rank
    of a process on this thread (its close's barrier is MPI's, which may take calls from this thread only)."""
    if len(ranks) == 1:
        ranks[0].close()
    else:
        each(ranks, AllToAll.close)


def _checked_tokens(x, c) -> int:
    shape = tuple(x.shape)
    if len(shape) != 2 or shape[1] != c.hidden:
        raise ValueError(f"x must be (T, {c.hidden}), got {shape}")
    if shape[0] > c.max_tokens:
        raise ValueError(f"x has {shape[0]} tokens; this object was made for max_num_tokens={c.max_tokens}")
    if np.dtype(x.dtype) != c.in_dtype:
        raise TypeError(f"x must be {c.in_dtype.name}, got {np.dtype(x.dtype).name}")
    return shape[0]


def _check_operand(name: str, a, shape: tuple, dtype) -> None:
    if tuple(a.shape) != tuple(shape) or np.dtype(a.dtype) != np.dtype(dtype):
        raise ValueError(f"{name} must be {tuple(shape)} {np.dtype(dtype).name}, got {tuple(a.shape)} "
                         f"{np.dtype(a.dtype).name}")
