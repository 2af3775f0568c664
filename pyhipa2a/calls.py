"""What a call does alike in AllToAll and HierarchicalAllToAll (pyhipa2a.hierarchy): the checks a
dispatch or combine makes before any kernel runs, its arguments through the array boundary
(pyhipa2a.inputs), the result it hands back, and the record that lets the next call with the same
arguments repeat it without its checks (Repeat)."""
from __future__ import annotations

import operator
from dataclasses import dataclass

import numpy as np

from .array import DeviceArray
from .dtypes import FP8_BLOCK
from .errors import A2AError
from .inputs import check_array, check_indices, require_array
from .kernels import X_FP8


def checked_dispatch(a2a, x, indices, weights, x_scales) -> int:
    """Everything a dispatch() checks before any kernel runs, for AllToAll and HierarchicalAllToAll
    alike (their shared configuration attributes); returns the call's tokens T."""
    if a2a._pending is not None:
        # The device hands the call's epoch from dispatch to combine: a second
        # dispatch would reuse it, and peers would read the last call's data.
        raise A2AError("dispatch() called again before combine(): each dispatch is combined once")
    require_array(x, "x")
    require_array(indices, "indices")
    if (x_scales is None) == (a2a.x_format == X_FP8):
        if x_scales is None:
            raise TypeError(f"x is {a2a.in_dtype.name}: pass its scales as x_scales [T, "
                            f"{a2a.scale_cols}] float32 (one per {FP8_BLOCK} elements of a row)")
        raise TypeError(f"x_scales is for fp8 x (AllToAll(in_dtype='float8_e4m3', ...)); this AllToAll takes "
                        f"{a2a.in_dtype.name} x" + (" and quantizes it itself" if a2a.scale_cols else ""))
    if x_scales is not None:
        require_array(x_scales, "x_scales")
    if weights is not None:
        require_array(weights, "weights")
    shape = getattr(x, "shape", None)
    if shape is None or len(shape) != 2:
        raise ValueError(f"x must have 2 dimensions (T, {a2a.hidden}), got shape {shape}")
    T = int(shape[0])
    if T > a2a.max_tokens:
        raise ValueError(f"x has {T} tokens; this AllToAll was built for max_num_tokens={a2a.max_tokens}")
    if isinstance(indices, np.ndarray):
        check_array("indices", indices.shape, indices.dtype, (T, a2a.top_k), np.int32)
        check_indices(indices, a2a.num_experts)
    return T


def checked_combine_weights(a2a, weights):
    """combine()'s checks of the pending dispatch and of where the weights came: the weights that
    dispatch sent (None: they come here)."""
    if a2a._pending is None:
        raise A2AError("combine() needs a preceding dispatch() (each dispatch is combined once)")
    sent = a2a._pending_weights
    if sent is None and weights is None:
        raise TypeError("combine() needs the weights [T, k] float32: here, or given to dispatch(weights=)")
    if sent is not None and weights is not None and weights is not sent:
        raise ValueError("the weights were given to dispatch(), which sent them: combine() takes none "
                         "(or the same array)")
    return sent


def take_input(boundary, node, obj, name, want_shape, want_dtype, stage: str | None, stream, align: int = 1):
    """(pointer, keepalive) of argument `name` on the device through `boundary` (pyhipa2a.inputs:
    described once, checked, ordered after its producer; NumPy arrays are copied into staging buffer
    `stage`), for a call of `node`, the AllToAll whose capture and staging buffers it uses (AllToAll's
    and HierarchicalAllToAll's `_input` alike)."""
    return boundary.take(name, obj, want_shape, want_dtype, stream, capturing=node._capturing is not None,
                         stage_ptr=node._stage_ptrs[stage] if stage else None, align=align)


def weights_input(a2a, weights, T: int, stream):
    """(pointer, keepalive) of the gate's weights [T, k] float32, for dispatch or combine, through
    `a2a._input` (AllToAll's and HierarchicalAllToAll's alike)."""
    wshape = getattr(weights, "shape", None)
    if wshape is not None and len(wshape) == 2 and wshape[0] != T:
        raise ValueError(f"weights has {wshape[0]} rows but the call has {T} tokens")
    return a2a._input(weights, "weights", (T, a2a.top_k), np.float32, "weights_stage", stream, align=4)


@dataclass(frozen=True)
class DispatchResult:
    expert_num_tokens: DeviceArray  # int32 [L]
    expert_x: DeviceArray           # [L, W*M, H]
    expert_meta: DeviceArray        # int32 [L, W*M, 3]: (src_rank, src_token, src_k)
    num_tokens: int                 # T of this rank's call
    expert_x_scales: DeviceArray | None = None  # float32 [L, W*M, H / 128] in fp8 dispatch, else None
    expert_layout: DeviceArray | None = None  # int32 [L, W, 2] with row_layout="by_source": (first row, rows) of
                                              # each source's rows of each expert; None when packed


class Repeat:
    """A call that the next one may repeat without its checks. It holds the last call's arguments
    (compared by identity) and what that call worked out, and exists only when every device argument
    had settled at the boundary (pyhipa2a.inputs: nothing to ask; at most a wait for a producer's
    stream, made again at every repeat). A loop that hands over the same arrays again (the usual
    case) then costs a few identity checks, those waits and the launch. Anything else takes the full
    path: another array, stream or scale, NumPy inputs (copied at every call: their name's entry is
    dropped), or a capture (its arguments do not settle). The token count is the recorded call's, as
    the arguments' shapes were: like the boundary's settled entries, this trusts our own arrays (and
    any, under producer_order="stream") not to change their shape or memory in place; a PyTorch, CuPy
    or JAX argument is asked again what its probe answered (pyhipa2a.producers: pointer, shape,
    strides, type, and the same producer stream as then: asked once a call for all the arguments of
    one library, and not again where the call asked it to choose its own stream,
    AllToAll(stream="current")). Streams are compared as the
    object's own view of them (one per handle), so a handle given as an int repeats."""

    __slots__ = ("args", "names", "entries", "boundary", "tokens", "prepared", "rechecks", "waits", "quick")

    def __init__(self, args: tuple, names: tuple, entries: tuple, boundary, tokens: int, prepared):
        self.args, self.names, self.entries, self.boundary = args, names, entries, boundary
        self.tokens, self.prepared = tokens, prepared  # what the call worked out: combine's arguments, dispatch's result
        # PyTorch, CuPy and JAX arguments: their producers' answers, asked again at every repeat
        self.rechecks = tuple((entry.recheck, entry.obj) for entry in entries if entry.recheck is not None)
        # and the producer streams they named, other than the call's: waited for at every repeat
        self.waits = tuple(dict.fromkeys(entry.wait for entry in entries if entry.wait is not None))
        self.quick = None  # AllToAll's flat form of the repeat (pyhipa2a.quick), where it has one

    def resume(self, order, stream) -> None:
        """Queue the repeated call on `stream` as its first one was: after our earlier calls, then
        after its arguments' producers (a repeat never runs while a capture records)."""
        order.follow(stream)
        for producer in self.waits:
            order.wait_for_producer(producer, stream)

    @classmethod
    def of(cls, args: tuple, names: tuple, boundary, tokens: int, prepared=None):
        """The record of a call just made with `args` (its stream among them), whose device arguments
        went through the boundary as `names`; None when one of them has not settled."""
        entries = tuple(boundary.settled(name) for name in names)
        if any(entry is None for entry in entries):
            return None
        return cls(args, names, entries, boundary, tokens, prepared)

    def holds(self, args: tuple, asked: dict | None = None) -> bool:
        """`args` are the recorded ones, object for object, and nothing about their use has changed.
        `asked`: the call's producer answers so far ({probe: stream}, see Recheck.holds), filled here."""
        # (map with operator.is_ iterates in C: this is every repeated call's path)
        return all(map(operator.is_, args, self.args)) and self.still(asked)

    def still(self, asked: dict | None = None) -> bool:
        """holds() once the call's arguments are known to be the recorded ones: the boundary still
        holds them as then, and their producers answer as then."""
        if not all(map(operator.is_, map(self.boundary.settled, self.names), self.entries)):
            return False
        if self.rechecks:
            if asked is None:
                asked = {}
            for recheck, obj in self.rechecks:
                if not recheck.holds(obj, asked):
                    return False
        return True


class OutputViews:
    """One stream's views of an object's outputs, made once. The views always show the same buffers,
    so caching them, and the DispatchResult of each token count, keeps object construction off the
    per-call path (AllToAll and HierarchicalAllToAll alike)."""

    def __init__(self, num_tokens: DeviceArray, expert_x: DeviceArray, expert_meta: DeviceArray,
                 expert_x_scales: DeviceArray | None, y: DeviceArray, expert_layout: DeviceArray | None = None):
        self.num_tokens, self.expert_x, self.expert_meta, self.expert_x_scales = (num_tokens, expert_x, expert_meta,
                                                                                  expert_x_scales)
        self.expert_layout = expert_layout
        self.y_rows = [y.rows(t) for t in range(y.shape[0] + 1)]  # y [T, H] of a call of T tokens
        self._results: list[DispatchResult | None] = [None] * len(self.y_rows)

    def dispatch_result(self, tokens: int) -> DispatchResult:
        result = self._results[tokens]
        if result is None:
            result = self._results[tokens] = DispatchResult(self.num_tokens, self.expert_x, self.expert_meta, tokens,
                                                            self.expert_x_scales, self.expert_layout)
        return result
