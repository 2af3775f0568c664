"""The call protocol: what a dispatch or combine checks before any kernel runs, the state it hands on,
and the path it takes (Calls). Dispatch and combine alternate (the device hands each call's epoch from
one to the other); an object that saw an error refuses further calls (peers may be mid-protocol).
"""
from __future__ import annotations

import functools
import operator

import numpy as np

from .config import Config
from .dtypes import FP8_BLOCK
from .errors import A2AError
from .groups import Groups
from .inputs import (Boundary, check_array, check_indices, check_numpy_input, check_scale, check_writable,
                     require_array, same_scale)
from .kernels import WHOLE_COMBINE, X_FP8
from .outputs import Outputs
from .producers import foreign_stream_handle
from .repeat import MISSED, Record, Relaunch, plan_or_none, run
from .streams import Streams


class CallState:
    """What an object's calls hand on to the next: set by Calls._finish, checked and set by a plan alike."""
    __slots__ = ("broken", "pending", "sent", "joined", "keep")

    def __init__(self):
        self.broken = None   # why the object refuses calls after an error
        self.pending = None  # the DispatchResult awaiting its combine
        self.sent = None     # the weights that dispatch sent (combine takes none)
        self.joined = None   # the other library's capture stream the pending dispatch was recorded into
        self.keep = None     # the last call's inputs: the device may still read them

    @property
    def weights_sent(self) -> bool:
        """Whether the pending dispatch sent weights, whichever array (a new one may have stood in for the one
        its plan recorded): what a combine given no weights needs to repeat, since they travel with the routing."""
        return self.sent is not None


def same_stream_given(stream, recorded) -> bool:
    """Whether stream= names the recorded one anew (a new int or PyTorch/CuPy stream object, same handle)."""
    handle = foreign_stream_handle(stream)
    return handle is not None and handle == foreign_stream_handle(recorded)


# How a plan matches each argument again (Record.alike): by identity, but stream= and expert_scale, and the
# arrays another may stand in for (stand_ins).
DISPATCH_ARGS = ("x", "indices", "weights", "x_scales", "stream", "groups")
DISPATCH_ALIKE = (None, None, None, None, same_stream_given, operator.eq)
COMBINE_ARGS = ("expert_y", "weights", "out", "stream", "expert_scale")
COMBINE_ALIKE = (None, None, None, same_stream_given, same_scale)
LEG_ARGS = {"dispatch": (DISPATCH_ARGS, DISPATCH_ALIKE), "combine": (COMBINE_ARGS, COMBINE_ALIKE)}
# (what dispatch sent is the call's weights, whichever array stood in for the recorded: combine compares)
DISPATCH_WEIGHTS = DISPATCH_ARGS.index("weights")
# The arrays a plan may take new ones for: each implementation's _places says where their kernel
# pointers lie (a grouped call's repeat.Relaunch, where its launch reads them). (out is combine's result as
# well: a call on another takes the full path.)
PLACED_ARGS = {"dispatch": ("x", "indices", "x_scales", "weights"), "combine": ("expert_y", "weights")}


def checked_dispatch(config: Config, state: CallState, x, indices, weights, x_scales) -> int:
    """Everything a dispatch() checks before any kernel runs; the call's tokens T."""
    if state.pending is not None:
        raise A2AError("dispatch() called again before combine(): each dispatch is combined once")
    require_array(x, "x")
    require_array(indices, "indices")
    if (x_scales is None) == (config.x_format == X_FP8):
        if x_scales is None:
            raise TypeError(f"x is {config.in_dtype.name}: pass its scales as x_scales [T, "
                            f"{config.scale_cols}] float32 (one per {FP8_BLOCK} elements of a row)")
        raise TypeError(f"x_scales is for fp8 x (AllToAll(in_dtype='float8_e4m3', ...)); this AllToAll takes "
                        f"{config.in_dtype.name} x" + (" and quantizes it itself" if config.scale_cols else ""))
    if x_scales is not None:
        require_array(x_scales, "x_scales")
    if weights is not None:
        require_array(weights, "weights")
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != 2:
        raise ValueError(f"x must have 2 dimensions (T, {config.hidden}), got shape {shape}")
    T = int(shape[0])
    if T > config.max_tokens:
        raise ValueError(f"x has {T} tokens; this AllToAll was built for max_num_tokens={config.max_tokens}")
    if isinstance(indices, np.ndarray):
        check_array("indices", indices.shape, indices.dtype, (T, config.top_k), np.int32)
        check_indices(indices, config.num_experts)
    return T


def checked_combine_weights(state: CallState, weights):
    """combine()'s checks of the pending dispatch and the weights; the weights dispatch sent, or None."""
    if state.pending is None:
        raise A2AError("combine() needs a preceding dispatch() (each dispatch is combined once)")
    sent = state.sent
    if sent is None and weights is None:
        raise TypeError("combine() needs the weights [T, k] float32: here, or given to dispatch(weights=)")
    if sent is not None and weights is not None and weights is not sent:
        raise ValueError("the weights were given to dispatch(), which sent them: combine() takes none "
                         "(or the same array)")
    return sent


def checked_weights_shape(weights, T: int) -> None:
    shape = getattr(weights, "shape", None)
    if shape is not None and len(shape) == 2 and shape[0] != T:
        raise ValueError(f"weights has {shape[0]} rows but the call has {T} tokens")


def stand_ins(where: dict, names: tuple, alike: tuple, args: tuple, arrays) -> tuple:
    """(alike, places) of a call's Record: `alike` with each array argument another array may stand in for at
    a repeat (Taken.stand_in) where `where` (argument name -> address) gives its pointer a place in the
    launch; (alike, ()) where none has."""
    if not where:
        return alike, ()
    alike, places = list(alike), [None] * len(args)
    for obj, taken in arrays:
        i = next((i for i, arg in enumerate(args) if arg is obj), None)  # (None: an output of ours behind it)
        if i is not None and taken.stand_in is not None and names[i] in where:
            alike[i], places[i] = taken.stand_in, (where[names[i]], taken.ptr)
    return tuple(alike), (tuple(places) if any(places) else ())


class Calls:
    """The call path of an AllToAll, shared by its implementations (they provide the launches): a call is
    its plan (pyhipa2a.repeat) where the last two of its kind were this one, or the full path: one check,
    the stream, each argument through the array boundary, the launch, one record of what changed."""

    JOINS_CAPTURES = True  # whether a call may be recorded into another library's capture

    def __init__(self, config: Config, exchange, health):
        self._config, self._exchange, self._health = config, exchange, health
        heap = exchange.heap
        self.heap, self.stream, self.backend = heap, exchange.stream, heap.backend
        index = heap.device.index
        self._streams = Streams(self.backend, self.stream, config.stream == "current",
                                None if self.backend.kind == "host" else index)
        self._boundary = Boundary(self.backend, index, self._streams, config.producer_order)
        self._state = CallState()
        buffers = exchange.buffers
        self._groups = Groups(self.backend, heap.rank, config, buffers, health)
        self._outputs = Outputs(config.outputs, self._streams, self._make_views)
        self._scale = (1.0, 1.0)  # combine's last expert_scale, as given and as the float32 it checked out as
        self._dispatch_plan = self._combine_plan = None
        self._dispatch_record = self._combine_record = None

    @property
    def config(self) -> Config:
        return self._config

    # -- what an implementation provides ------------------------------------------
    # _places, set by the implementation's _open: leg -> {argument name: the host address of its kernel pointer
    # in what the repeater launches from}, for the arguments whose new arrays a repeat may take (PLACED_ARGS)
    def _make_views(self, stream):  # the OutputViews that name `stream`
        raise NotImplementedError

    def _launch_dispatch(self, s, tokens: int, x: int, indices: int, x_scales: int, weights: int, groups: int,
                         ticket: int) -> None:
        raise NotImplementedError

    def _launch_combine(self, s, tokens: int, expert_y: int, weights: int, out: int, scale: float, phase: int,
                        groups: int) -> None:
        raise NotImplementedError

    def _before_combine(self, s, tokens: int, weights: int) -> None:
        """What a combine needs on `s` before its first launch (and, in parts, before the first part's wait for
        its group): nothing here."""

    def _repeater(self, leg: str, tokens: int):
        """A runtime Launcher of the call of `leg` just made ("dispatch", "combine"), for its plan."""
        raise NotImplementedError

    def _plan_conditions(self) -> tuple:
        """(obj, name, want) that this object's plans also need to hold (getattr(obj, name) is want): none here."""
        return ()

    def _refuse_if_closed(self) -> None:
        if self.heap.closed:
            raise A2AError("AllToAll is closed")

    def _usable(self) -> None:
        self._refuse_if_closed()
        if self._state.broken:
            raise A2AError(f"AllToAll is unusable after an earlier failure: {self._state.broken}")
        self._raise_reported()
        self.backend.activate()

    def _raise_reported(self, cause: BaseException | None = None) -> None:
        """A kernel reported an error: this object refuses further calls (peers may be mid-protocol)."""
        error = self._health.error()
        if error is not None:
            self._state.broken = str(error)
            raise error from cause

    def _check_pairing(self, leg: str) -> None:
        """A dispatch recorded into another library's capture is combined in it, one made outside outside:
        each replay of the caller's graph is then a whole call on the device."""
        state = self._state
        if state.pending is None or state.joined is self._streams.joined:
            return
        if state.joined is not None:
            # (the caller's graph may hold this dispatch alone, taking an epoch no combine hands on)
            state.broken = (f"a dispatch() recorded into another library's capture was followed by {leg}() "
                            "outside that capture: each recorded dispatch must be combined in the same capture")
            raise A2AError(state.broken)
        raise A2AError(f"{leg}() is being recorded into another library's capture while a dispatch() made "
                       "outside it awaits its combine(): combine that dispatch before the capture")

    def _take(self, name: str, obj, shape, dtype, s, arrays: list, stage: str | None = None, align: int = 1) -> int:
        """obj's pointer through the boundary (NumPy copied into buffer `stage`); (obj, Taken) joins `arrays`."""
        taken = self._boundary.take(name, obj, shape, dtype, s, capturing=self._streams.capturing is not None,
                                    stage_ptr=self._exchange.buffers[stage].ptr if stage else None, align=align)
        arrays.append((obj, taken))
        return taken.ptr

    def _finish(self, leg: str, s, lead, library, inputs: tuple, args: tuple, arrays: list, tokens: int, groups: int,
                result, changes: tuple, conditions: tuple, repeatable: bool, launch=None):
        """Where every full call ends, its kernels queued on `s`: the readers of its outputs ordered after it,
        its state recorded (`changes`, then what the device may still read and the stream: the one place, as
        a plan records it), and what its next call of the same kind compares itself with. Returns (the plan
        where this call repeats the last one of its kind, the record to keep), both None unless `repeatable`
        (a plan only speeds repeats up, so one that cannot be made warns and never fails the call). `launch`:
        a repeat.Relaunch that queues the call again, for a call whose launches the host takes part in at each
        call (a grouped one's ticket, combine's parts and their bound), its arguments' places in
        `launch.places`; else None: the implementation's repeater."""
        state, streams = self._state, self._streams
        after = self._order_reader(s, lead, library)
        keep = tuple(taken.keep for _, taken in arrays)
        if not streams.keep(keep):  # (a capture's graph keeps them instead)
            changes = (*changes, (state, "keep", keep), (streams, "last", s))
        for obj, name, value, *_ in changes:  # (the full path's value is the call's argument itself)
            setattr(obj, name, value)
        if not repeatable or streams.capturing is not None:
            return None, None
        names, tests = LEG_ARGS[leg]
        alike, places = stand_ins(launch.places if launch else self._places[leg], names, tests, args, arrays)
        record = Record(args, alike, s, lead, inputs, tuple(arrays), tokens, result, after, changes, places,
                        (state, "keep"), groups)
        if not record.same(getattr(self, f"_{leg}_record")):
            return None, record
        plan = plan_or_none(record, conditions + self._plan_conditions(), streams, self.backend,
                            self._exchange.buffers.status.ctypes.data,
                            (lambda: launch) if launch else lambda: self._repeater(leg, tokens),
                            lambda: setattr(self, f"_{leg}_plan", None))
        return plan, record

    # -- calls -------------------------------------------------------------------
    def dispatch(self, x, indices, *, weights=None, x_scales=None, stream=None, groups=None):
        """Send each token to the ranks of its experts. `x` [T, H] in_dtype, `indices` [T, k] int32, T <= M;
        with fp8 x (in_dtype fp8), `x_scales` [T, H / 128] float32: element i of row t stands for
        x[t, i] * x_scales[t, i // 128]. `weights` [T, k] float32, the gate's weights, may come here
        instead of to combine: they then travel with the routing (combine's fastest form). `groups` G:
        our experts' rows become ready group by group (wait_group, group_done: pyhipa2a.groups). Returns a
        DispatchResult of views."""
        plan = self._dispatch_plan
        if plan is not None:
            result = run(plan, x, indices, weights, x_scales, stream, groups)
            if result is not MISSED:
                return result
        return self._dispatch(x, indices, weights, x_scales, stream, groups)

    def _dispatch(self, x, indices, weights, x_scales, stream, groups):
        self._dispatch_plan = None  # (a call that fails leaves none)
        self._usable()
        c, state, streams, outputs = self.config, self._state, self._streams, self._outputs
        s, lead = streams.enter(stream, (x, indices), self.JOINS_CAPTURES)
        try:
            self._check_pairing("dispatch")
            T = checked_dispatch(c, state, x, indices, weights, x_scales)
            G = self._groups.checked_count(groups, weights, streams.joined is not None)
            streams.follow(s)
            self._settle_before_host_copies(s, (x, indices, weights, x_scales))
            arrays: list = []
            # (x may be a combine's y we handed out, expert_y a dispatch's expert_x: our own arrays then)
            x_ptr = self._take("x", outputs.ours_behind(x, lead), (T, c.hidden), c.in_dtype, s, arrays, "x_stage")
            i_ptr = self._take("indices", indices, (T, c.top_k), np.int32, s, arrays, "indices_stage", 4)
            s_ptr = w_ptr = 0
            if x_scales is not None:
                s_ptr = self._take("x_scales", x_scales, (T, c.scale_cols), np.float32, s, arrays, "x_scales_stage", 4)
            if weights is not None:
                checked_weights_shape(weights, T)
                w_ptr = self._take("weights", weights, (T, c.top_k), np.float32, s, arrays, "weights_stage", 4)
            library = outputs.library_of((x, indices, weights, x_scales))
            result = outputs.views(s, library).dispatch_result(T)
            ticketed = None
            if G and c.contiguous and streams.capturing is None:
                # The host is told where the rows lie, under a ticket of the call's, where it can wait (not in a
                # graph): each call draws one, its plan's too.
                ticketed = Relaunch(functools.partial(self._ticketed_dispatch, T, G), PLACED_ARGS["dispatch"],
                                    (x_ptr, i_ptr, s_ptr, w_ptr))
                ticketed(s)
            else:
                self._launch_dispatch(s, T, x_ptr, i_ptr, s_ptr, w_ptr, G, 0)
            self._dispatch_plan, self._dispatch_record = self._finish(
                "dispatch", s, lead, library, (x, indices), (x, indices, weights, x_scales, stream, groups), arrays, T,
                G, result, changes=((state, "pending", result), (state, "sent", weights, DISPATCH_WEIGHTS),
                                 (state, "joined", streams.joined), (self._groups, "count", G),
                                 (self._groups, "finished", frozenset())),
                conditions=((state, "broken", None), (state, "pending", None)), repeatable=True, launch=ticketed)
            return result
        finally:
            streams.leave()

    def _ticketed_dispatch(self, tokens: int, groups: int, s, x: int, indices: int, x_scales: int, weights: int):
        """A grouped contiguous dispatch's launch: a ticket drawn at each call, its plan's too."""
        self._launch_dispatch(s, tokens, x, indices, x_scales, weights, groups, self._groups.next_ticket())

    def combine(self, expert_y, weights=None, *, out=None, stream=None, expert_scale: float = 1.0):
        """Bring expert outputs back: y[t] = sum_j weights[t, j] * expert_y_row(t, j), fp32 accumulation.
        `weights` [T, k] float32, unless they were given to dispatch (then none, or the same array).
        `expert_scale` (this rank's) is a fused epilogue: this rank's expert rows count as expert_y *
        expert_scale (gpu-mode's fake expert is `combine(d.expert_x, w, expert_scale=1 + rank)`)."""
        plan = self._combine_plan
        if plan is not None:
            y = run(plan, expert_y, weights, out, stream, expert_scale)
            if y is not MISSED:
                return y
        return self._combine(expert_y, weights, out, stream, expert_scale)

    def _combine(self, expert_y, weights, given_out, stream, expert_scale):
        self._combine_plan = None  # (a call that fails leaves none)
        self._usable()
        c, state, streams, outputs = self.config, self._state, self._streams, self._outputs
        sent = checked_combine_weights(state, weights)
        pending = state.pending
        T = pending.num_tokens
        groups = self._groups
        inputs = (expert_y, weights, given_out)
        s, lead = streams.enter(stream, inputs, self.JOINS_CAPTURES)
        try:
            G = groups.ready_to_combine()
            self._check_pairing("combine")
            scale = self._checked_scale(expert_scale)
            streams.follow(s)
            self._settle_before_host_copies(s, (expert_y, weights))
            arrays: list = []
            y_shape = (*c.rows_shape, c.hidden)
            host_y = expert_y if isinstance(expert_y, np.ndarray) else None
            if host_y is not None:  # checked now, copied last: a refused call overwrites nothing
                check_numpy_input("expert_y", host_y, y_shape, c.out_dtype, streams.capturing is not None)
                y_ptr = 0
            else:
                y_ptr = self._take("expert_y", outputs.ours_behind(expert_y, lead), y_shape, c.out_dtype, s, arrays)
            w_ptr = 0
            if sent is None:
                checked_weights_shape(weights, T)
                w_ptr = self._take("weights", weights, (T, c.top_k), np.float32, s, arrays, "weights_stage", 4)
            library = None
            if given_out is None:
                library = outputs.library_of((expert_y, weights))
                out = outputs.views(s, library).y(T)
                out_ptr = outputs.ours(s).y(T).ptr
            else:
                check_writable("out", given_out, "a NumPy result comes from combine(...).numpy()")
                out = given_out
                out_ptr = self._take("out", out, (T, c.hidden), c.out_dtype, s, arrays)
            if host_y is not None:  # (the host waits for the stream)
                staging = self.expert_y_buffer()
                self.backend.copy_to_device(staging.ptr, host_y, s)
                y_ptr = staging.ptr
            in_parts = None
            if G:  # its parts, each after its group is done, and the host's bound on their waits: a plan's too
                in_parts = Relaunch(functools.partial(self._combine_in_parts, T, out_ptr, scale[1], G),
                                    PLACED_ARGS["combine"], (y_ptr, w_ptr))
                in_parts(s)
            else:
                self._before_combine(s, T, w_ptr)
                self._launch_combine(s, T, y_ptr, w_ptr, out_ptr, scale[1], WHOLE_COMBINE, 0)
            self._combine_plan, self._combine_record = self._finish(
                "combine", s, lead, library, inputs, (expert_y, weights, given_out, stream, expert_scale), arrays, T,
                G, out, changes=((state, "pending", None), (state, "sent", None), (state, "joined", None),
                              (groups, "count", 0)),
                # (given no weights, combine needs some sent; given the sent weights again, the same array sent)
                conditions=((state, "broken", None), (state, "pending", pending),
                            (state, "weights_sent", True) if weights is None else (state, "sent", sent),
                            (state, "joined", None), (groups, "count", G))
                + (((groups, "all_done", True),) if G else ()),  # (no groups: none can be left undone)
                repeatable=host_y is None, launch=in_parts)
            return out
        finally:
            streams.leave()

    def _combine_in_parts(self, tokens: int, out: int, scale: float, groups: int, s, expert_y: int, weights: int):
        """A grouped combine's launches: its parts, each after its group is done; the host's bound on their waits."""
        self._before_combine(s, tokens, weights)
        self._groups.queue_combine(s, lambda phase: self._launch_combine(
            s, tokens, expert_y, weights, out, scale, phase, groups), self._streams.capturing is not None)

    def _order_reader(self, s, lead, library) -> tuple:
        """Queue the reads of outputs handed to `library` after the call just queued on `s`; the step, for
        the call's plan. None where `s` is that library's current stream, asked for the call (lead) and
        asked again by its plan."""
        if type(lead) is tuple and lead[0] is library:
            return ()
        order = self._outputs.orderer(s, library)
        if order is None:
            return ()
        order()
        return (order,)

    def _checked_scale(self, expert_scale) -> tuple:
        """(expert_scale, as the kernels' float32): the last one's when equal in value and type, else checked."""
        if not same_scale(expert_scale, self._scale[0]):
            self._scale = (expert_scale, check_scale(expert_scale))
        return self._scale

    def _settle_before_host_copies(self, s, inputs: tuple) -> None:
        """A NumPy input's copy waits for `s`, where NCCL may wait for a peer without bound: watch it first."""
        if any(isinstance(obj, np.ndarray) for obj in inputs):
            self._health.settle(s)

    def stream_for(self, *inputs):
        """The stream a call given these inputs and no stream= runs on now (for the caller's own events)."""
        streams = self._streams
        if streams.capturing is not None:
            return streams.capturing
        return streams.chosen(inputs) if streams.follow_library else streams.own
