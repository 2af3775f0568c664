"""A repeated call as one flat step: what AllToAll.dispatch() and combine() try first.

A loop hands the same arrays to every call. Once a call has settled (pyhipa2a.calls.Repeat),
the next one with the same arguments needs only to know that the object is still usable, that
the call runs on the same stream with nothing capturing it, that the boundary and the arguments'
producers answer as then, and then the launch. Through AllToAll's layers (usable, joining a
capture, the call's stream, the repeat, the launch site) that took 7-10 us of host time a call
with PyTorch arrays on the H100 machine, 2-3 of them the launch (thirty-second session).

The first repeat of a record makes its Quick (a loop's second call: a pair of arrays used by
turns never pays for one), and from then on each lookup that cannot change between repeats is
one made then: where the call's stream comes from, and the launch itself, a copy of the call's
arguments that the backend may hand to the device once (Kernel.repeater: on CUDA a one-node
graph launched as it is). A quick call either is that repeat, made exactly as the full path
would make it, or returns None having changed nothing: the full path then runs, and raises
where the call is wrong.
"""
from __future__ import annotations

from dataclasses import dataclass

from . import producers
from .inputs import same_scale

_NOT_HERE = object()  # _settled_stream: the call does not run where its record did


@dataclass(frozen=True)
class Quick:
    """A repeat's flat form: the recorded call's arguments as they were given (its stream= too, where
    Repeat.args holds the stream it resolved to), that stream, and its kernel's launch there.
    With AllToAll(stream="current") and no stream= given, the stream is found again at each call, as
    AllToAll._current_stream_of finds it, from `lead`: (probe, i, handle) where the first of the inputs
    whose library has a probe (pyhipa2a.producers), inputs[i], named the stream's handle; NO_LIBRARY
    where none of them has one (the last call's stream, StreamOrder.latest); ANY_INPUT otherwise (a
    mix of libraries: each is asked in turn, as the full path asks them)."""
    given: tuple
    stream: object
    launch: object  # a function of the stream: the recorded launch (Kernel.repeater)
    follows_library: bool  # stream= was None and AllToAll(stream="current")
    lead: object
    ask_capture: bool  # whether another library may capture the stream (AllToAll._capturable_elsewhere)


NO_LIBRARY, ANY_INPUT = "no library", "any input"


def quick_for(a2a, given: tuple, stream, launch, inputs: tuple, asked: dict | None) -> Quick:
    """The Quick of a repeat of the record of a call with arguments `given`, stream= last, that runs on
    `stream` and launches with `launch`; `inputs` and `asked` as AllToAll._call_stream took and gave them
    (the repeat's rechecks may have added other producers' answers to `asked` since: the first entry
    is still the one that chose the stream)."""
    probes = [(i, producers.stream_source(obj)) for i, obj in enumerate(inputs)]
    probes = [(i, probe) for i, probe in probes if probe is not None]
    lead = ANY_INPUT
    if not probes:
        lead = NO_LIBRARY
    elif asked:
        chooser, handle = next(iter(asked.items()))
        if chooser is probes[0][1]:
            lead = (chooser, probes[0][0], handle)
    return Quick(given, stream, launch, given[-1] is None and a2a._on_current_stream, lead,
                 a2a._capturable_elsewhere(stream))


def _settled_stream(a2a, quick: Quick, inputs: tuple):
    """The producer answers the call's stream took ({probe: stream}, or None where none was asked)
    when the object is usable, records no capture, and the call runs on the recorded stream, which no
    other library captures; else _NOT_HERE."""
    if a2a._broken is not None or a2a._capturing is not None or a2a.host_status[0]:
        return _NOT_HERE
    stream, asked = quick.stream, None
    if quick.follows_library:
        lead = quick.lead
        if lead is NO_LIBRARY:
            if a2a._order.latest() is not stream:
                return _NOT_HERE
        elif lead is ANY_INPUT:
            current, asked = a2a._call_stream(None, inputs)  # (as the full path finds it)
            if current is not stream:
                return _NOT_HERE
        else:
            probe, i, handle = lead
            try:
                if probe.current_stream(inputs[i], a2a._library_device) != handle:
                    return _NOT_HERE
            except Exception:  # (the full path says what is wrong with that input)
                return _NOT_HERE
            asked = {probe: handle}
    if quick.ask_capture and a2a.backend.stream_capturing(stream):
        return _NOT_HERE  # (the full path joins that capture)
    return asked


def quick_dispatch(a2a, repeat, x, indices, weights, x_scales, stream):
    """dispatch(x, indices, weights=, x_scales=, stream=) as `repeat` (which has a Quick): its result, or
    None where the call is not that repeat."""
    quick = repeat.quick
    x0, indices0, weights0, scales0, stream0 = quick.given
    if (x is not x0 or indices is not indices0 or weights is not weights0 or x_scales is not scales0
            or not _same_stream_given(stream, stream0) or a2a._pending is not None):
        return None
    asked = _settled_stream(a2a, quick, (x, indices))
    if asked is _NOT_HERE or not repeat.still(asked):
        return None
    _relaunch(a2a, repeat, "_repeat_dispatch")
    result = repeat.prepared
    a2a._pending, a2a._pending_weights, a2a._pending_joined = result, weights, None
    return result


def quick_combine(a2a, repeat, expert_y, weights, out, stream, expert_scale):
    """combine(expert_y, weights, out=, stream=, expert_scale=) as `repeat` (which has a Quick): its
    output, or None where the call is not that repeat."""
    quick = repeat.quick
    y0, weights0, out0, stream0 = quick.given
    pending, scale, sent = a2a._pending, repeat.args[4], repeat.args[5]
    if (expert_y is not y0 or weights is not weights0 or out is not out0 or not _same_stream_given(stream, stream0)
            or pending is None or pending.num_tokens != repeat.tokens or a2a._pending_weights is not sent
            or a2a._pending_joined is not None):
        return None
    asked = _settled_stream(a2a, quick, (expert_y, weights, out))
    if (asked is _NOT_HERE or a2a._last_scale is not scale or not same_scale(expert_scale, scale[0])
            or not repeat.still(asked)):
        return None
    _relaunch(a2a, repeat, "_repeat_combine")
    _, out_arr, keep, _ = repeat.prepared
    a2a._keep(*keep)
    a2a._pending = a2a._pending_weights = None
    return out_arr


def _same_stream_given(stream, recorded) -> bool:
    """stream= as the record's was given: the same object, or the same handle as an int (a loop that
    passes `torch.cuda.current_stream().cuda_stream` or CuPy's `.ptr` makes a new int each time)."""
    return stream is recorded or (type(stream) is int and type(recorded) is int and stream == recorded)


def _relaunch(a2a, repeat, record: str) -> None:
    """Queue `repeat` (a2a's `record`) as the full path queues a repeat: after the last call and its
    arguments' producers, then its launch; the stream is the last call's from then on."""
    quick, order = repeat.quick, a2a._order
    a2a.backend.activate()
    repeat.resume(order, quick.stream)
    try:
        quick.launch(quick.stream)
    except BaseException:
        setattr(a2a, record, None)  # as the full path: a call that fails records nothing
        raise
    order.queued(quick.stream)
