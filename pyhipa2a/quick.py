"""A repeated call as one flat step: what AllToAll.dispatch() and combine() try first.

A loop hands the same arrays to every call, or new arrays like them (a layer's activations, a
router's output). Once a call has settled (pyhipa2a.calls.Repeat), the next one like it needs only
to know that the object is still usable, that the call runs on the same stream with nothing
capturing it, that the boundary and the arguments' producers answer as then, where each new array
lies, and then the launch. Through AllToAll's layers (usable, joining a capture, the call's stream,
the repeat, the launch site) that took 7-10 us of host time a call with PyTorch arrays on the H100
machine, 2-3 of them the launch (thirty-second session), and 35-45 us with new PyTorch tensors.

A record's Quick holds each lookup that cannot change between repeats, made once: where the
call's stream comes from, the boundary entries and producer answers the repeat must find again
(flattened from the record's rechecks, so that a call asks each of them with no layer between:
every Python call here costs the host about 0.1 us on the device machines), and the launch
itself, a copy of the call's arguments that the backend may hand to the device once
(Kernel.repeater: on CUDA a one-node graph launched as it is), made at the first repeat of the
record's own arrays (the object's argument pack holds them while the record lasts). AllToAll
makes a record's Quick with the record, so that a loop that never passes the same arrays twice
takes the quick path from its second call.

An argument may also be a new array standing in for the record's (`Slot`): of the same library
and element type, on our device, compact, aligned, and shaped for the call's tokens, which may
differ from the record's (dispatch takes them from x; combine from its dispatch). A PyTorch, CuPy
or finished JAX array says so through its probe's pointer_of (pyhipa2a.producers: what its view would
show, asked directly), the view the boundary asks of an array it describes without its protocol; one
of our arrays through its own attributes and its stream, the record's. Its producer is the library
whose stream the call asks anyway. Such a call launches from a pack of the object's own for the
purpose (made from the record's arguments at the first such call), with every argument's pointer and
the token count written over them.

A quick call either is the recorded call on those arrays, made exactly as the full path would
make it, or returns None having changed nothing: the full path then runs, and raises where the
call is wrong.
"""
from __future__ import annotations

import functools
import warnings
from dataclasses import dataclass
from typing import NamedTuple

from . import producers
from .array import DeviceArray
from .inputs import same_scale

# Each leg's arguments in the order its quick function takes them (without the stream): their names
# at the boundary, the fields of the kernel's argument pack that take their pointers, and the
# alignment the full path asks of them.
DISPATCH_ARGS = (("x", 1), ("indices", 1), ("weights", 4), ("x_scales", 4))
COMBINE_ARGS = (("expert_y", 1), ("weights", 4), ("out", 1))


class Slot(NamedTuple):
    """What a new array must be to stand in for the record's argument `name` (which has a Settled
    entry): of the record's type, whose probe (PyTorch, CuPy, JAX, while not disowned: pyhipa2a.producers;
    None: one of our DeviceArrays) views it on `device`, compact, with the element type `token` (the
    probe key's, or our array's dtype), `align`-byte aligned, and, for one of our arrays, of `backend`
    and naming the record's producer stream. `hold`: the probe's, where its arrays need one (JAX)."""
    name: str
    align: int
    kind: type
    probe: object
    token: object
    device: int
    stream: object
    backend: object = None
    hold: object = None

    def pointer(self, obj, shape, holds: list) -> int | None:
        """obj's device pointer where it can stand in for the record's argument with shape `shape`, its
        hold appended to `holds` where it needs one; None otherwise (the full path then says what it
        says about obj)."""
        if type(obj) is not self.kind:
            return None
        if self.probe is None:  # one of ours (a DeviceArray)
            if (obj.backend is not self.backend or obj.device_id != self.device or obj.dtype != self.token
                    or obj.stream is not self.stream or obj.shape != shape):
                return None
            ptr = obj.ptr
        else:
            if producers.probe_for(obj) is not self.probe:  # (disowned since the record was made)
                return None
            try:
                ptr = self.probe.pointer_of(obj, self.device, self.token, shape)
            except Exception:  # (as the view's: the full path lets the protocol say what is wrong)
                return None
        if not ptr or ptr % self.align:
            return None
        if self.hold is not None:
            try:
                holds.append(self.hold(obj))
            except Exception:  # (a failed computation, say: its export says so on the full path)
                return None
        return ptr


@dataclass
class Quick:
    """A repeat's flat form: the recorded call's arguments as they were given (its stream= too, where
    Repeat.args holds the stream it resolved to), that stream, and its kernel's launch there.
    With AllToAll(stream="current") and no stream= given, the stream is found again at each call, as
    AllToAll._current_stream_of finds it, from `lead`: (probe, i, handle) where the first of the inputs
    whose library has a probe (pyhipa2a.producers), inputs[i], named the stream's handle; NO_LIBRARY
    where none of them has one (the last call's stream, StreamOrder.latest); ANY_INPUT otherwise (a
    mix of libraries: each is asked in turn, as the full path asks them).
    What the record's arguments must still answer (Repeat.still), flattened: `settled` the boundary's
    lookup and `entries` its (name, entry) pairs; `keys` each probed argument's (position among the
    leg's arguments, probe.key, argument, key), asked where the call passes that same argument;
    `streams` each other library's (probe, an argument of it, the stream it must name), the lead's
    library being asked once, by the lead. None for `keys` and `streams` where the repeat asks
    Repeat.still instead (a stream chosen by ANY_INPUT, whose answers each call collects). `lead_asks`:
    a function of our device that asks the lead's library its current stream (its probe's
    current_stream_here where the lead input's key is among `keys`, so that the call finds it on our
    device before asking), or None where the stream does not follow a lead input. `slots`: for each
    of the leg's arguments, the Slot a new array may take, or None where only the record's may come;
    `shapes` the shape each recorded argument was taken with (None: the argument was None)."""
    given: tuple
    stream: object
    make_launch: object  # makes `launch`, a function of the stream: the record's launch (Kernel.repeater)
    follows_library: bool  # stream= was None and AllToAll(stream="current")
    lead: object
    ask_capture: bool  # whether another library may capture the stream (AllToAll._capturable_elsewhere)
    settled: object = None
    entries: tuple = ()
    keys: tuple | None = None
    streams: tuple | None = None
    lead_asks: object = None
    slots: tuple = ()
    shapes: tuple = ()
    pointers: tuple = ()  # each recorded argument's device pointer (None: the argument was None)
    fields: tuple = ()  # the leg's argument names, in order: the fields of its argument pack
    make_moved: object = None  # makes the pack a call on new arrays launches from (the record's arguments)
    launch: object = None  # (made at the first repeat of the record's own arrays)
    moved: object = None  # (made at the first call on new arrays)
    moved_launches: dict | None = None  # (kernel, threads) -> its launcher from `moved` (Kernel.launcher)
    make_again: object = None  # make_again(repeat) makes `again` (pyhipa2a.again); None: its C helper is not built
    again: tuple = ()  # the record's plan, run in C (made with `launch`); (): none


NO_LIBRARY, ANY_INPUT = "no library", "any input"


def quick_for(a2a, repeat, given: tuple, stream, make_launch, inputs: tuple, asked: dict | None,
              leg_args: tuple = DISPATCH_ARGS, make_moved=None, make_again=None) -> Quick:
    """The Quick of `repeat`, the record of a call with arguments `given` (in `leg_args`' order, stream=
    last) that runs on `stream`, whose launch make_launch() makes, make_moved() the pack that calls
    on new arrays launch from (None: no such calls), and make_again(repeat) its plan once the launch is
    made (pyhipa2a.again; None: none); `inputs` and `asked` as
    AllToAll._call_stream took and gave them (a repeat's rechecks may have added other producers'
    answers to `asked` since: the first entry is still the one that chose the stream). (Every call that
    records makes one: plain loops, since comprehensions cost it microseconds.)"""
    lead = NO_LIBRARY
    for i, obj in enumerate(inputs):
        probe = producers.stream_source(obj)
        if probe is not None:
            lead = ANY_INPUT
            if asked:
                chooser, handle = next(iter(asked.items()))
                if chooser is probe:
                    lead = (chooser, i, handle)
            break
    follows_library = given[-1] is None and a2a._on_current_stream
    entries = dict(zip(repeat.names, repeat.entries))
    device = repeat.boundary.device_index
    slots, shapes, pointers = [], [], []
    for name, align in leg_args:
        entry = entries.get(name)
        if entry is None:
            slots.append(None)
            shapes.append(None)
            pointers.append(None)
            continue
        slots.append(_slot(name, align, entry, device) if make_moved is not None else None)
        shapes.append(entry.want_shape)
        pointers.append(entry.ptr)
    keys, streams = _flat_rechecks(positioned_rechecks(entries, leg_args), lead if follows_library else None)
    return Quick(given, stream, make_launch, follows_library, lead, a2a._capturable_elsewhere(stream),
                 repeat.boundary.settled, tuple(entries.items()), keys, streams,
                 _lead_asks(lead, inputs, keys) if follows_library else None, tuple(slots), tuple(shapes),
                 tuple(pointers), tuple(name for name, _ in leg_args), make_moved, make_again=make_again)


def positioned_rechecks(entries: dict, leg_args: tuple) -> tuple:
    """(position among the leg's arguments, Recheck, argument) of each of a record's `entries` ({name: its
    settled entry}) that has a Recheck, in the leg's order."""
    return tuple((i, entry.recheck, entry.obj) for i, entry in enumerate(map(entries.get, (n for n, _ in leg_args)))
                 if entry is not None and entry.recheck is not None)


def _slot(name: str, align: int, entry, device: int) -> Slot | None:
    """The Slot of a recorded argument's settled `entry`, or None where no new array can be vouched for
    without the full path (an interface or DLPack array of a library whose probe has no view)."""
    obj = entry.obj
    if entry.recheck is None:
        if type(obj) is not DeviceArray:
            return None
        return Slot(name, align, DeviceArray, None, obj.dtype, obj.device_id, obj.stream, obj.backend)
    probe = entry.recheck.probe
    return Slot(name, align, type(obj), probe, entry.recheck.key[3], device, None, None, probe.hold)


def _lead_asks(lead, inputs: tuple, keys: tuple | None):
    """Quick.lead_asks for `lead`, the repeat's arguments being `inputs` (the recorded objects). (A new
    array in the lead's place is found on our device by its Slot before the lead is asked.)"""
    if type(lead) is not tuple:
        return None
    probe, i, _ = lead
    if keys is not None and any(obj is inputs[i] and key_of == probe.key for _, key_of, obj, _ in keys):
        return probe.current_stream_here
    return functools.partial(probe.current_stream, inputs[i])


def _flat_rechecks(rechecks: tuple, lead):
    """(keys, streams) of Quick from a record's (position, Recheck, argument) triples, where the stream
    was chosen by `lead` (None: given, or the object's). As Recheck.holds asks them: each argument's key,
    and each library's stream once a call (the lead's library answered already: its answer stands for
    every argument of it, each of which named that stream when the record was made, since the record
    held)."""
    if lead is ANY_INPUT:
        return None, None
    keys, named = [], {}
    for i, recheck, obj in rechecks:
        keys.append((i, recheck.probe.key, obj, recheck.key))
        named.setdefault(recheck.probe, []).append((obj, recheck.stream))
    streams = []
    for probe, answers in named.items():
        if isinstance(lead, tuple) and probe is lead[0]:
            continue
        if len({stream for _, stream in answers}) > 1:  # (no answer can hold for all: let Repeat.still say no)
            return None, None
        streams.append((probe, answers[0][0], answers[0][1]))
    return tuple(keys), tuple(streams)


def _holds(a2a, repeat, inputs: tuple, args: tuple) -> bool:
    """Whether the call is the record's repeat but for its new arrays (the leg's `args`; those that are not
    the record's were vouched for by their Slots): the object is usable and records no capture, the call
    runs on the recorded stream, which no other library captures, and the boundary and the producers
    answer as they did."""
    if a2a._broken is not None or a2a._capturing is not None or a2a.host_status[0]:
        return False
    quick = repeat.quick
    stream, lead, asked = quick.stream, quick.lead, None
    if quick.follows_library:
        if lead is NO_LIBRARY:
            if a2a._order.latest() is not stream:
                return False
        elif lead is ANY_INPUT:
            current, asked = a2a._call_stream(None, inputs)  # (as the full path finds it)
            if current is not stream:
                return False
    if quick.ask_capture and a2a.backend.stream_capturing(stream):
        return False  # (the full path joins that capture)
    settled = quick.settled
    for name, entry in quick.entries:
        if settled(name) is not entry:
            return False
    if quick.keys is None:
        return repeat.still(asked)
    try:  # (a producer that raises: the full path lets its protocol say what is wrong)
        for i, key_of, obj, key in quick.keys:
            if args[i] is obj and key_of(obj) != key:
                return False
        if quick.lead_asks is not None and quick.lead_asks(a2a._library_device) != lead[2]:
            return False
        for probe, obj, named in quick.streams:
            if probe.stream(obj) != named:
                return False
    except Exception:
        return False
    return True


def _new_pointers(repeat, args: tuple, shapes: tuple, holds: list):
    """((pack field, pointer), ...) of the leg's arguments that are not None: the record's own pointer, or
    a new array's, vouched for by its Slot with its shape in `shapes` (its hold, where it needs one,
    appended to `holds`); None where one cannot be, or where a record's argument would be taken with
    another shape than its own (another token count)."""
    quick, pointers = repeat.quick, []
    for name, obj, recorded, slot, shape, was, ptr in zip(quick.fields, args, quick.given, quick.slots, shapes,
                                                          quick.shapes, quick.pointers):
        if obj is recorded:
            if obj is None:
                continue
            if shape != was:
                return None
        else:
            ptr = slot.pointer(obj, shape, holds) if slot is not None and obj is not None else None
            if ptr is None:
                return None
        pointers.append((name, ptr))
    return pointers


def quick_dispatch(a2a, repeat, x, indices, weights, x_scales, stream):
    """dispatch(x, indices, weights=, x_scales=, stream=) as `repeat` (which has a Quick) on these arrays:
    its result, or None where the call is not that repeat."""
    quick = repeat.quick
    x0, indices0, weights0, scales0, stream0 = quick.given
    if (stream is not stream0 and not _same_handle(stream, stream0)) or a2a._pending is not None:
        return None
    args = (x, indices, weights, x_scales)
    if x is x0 and indices is indices0 and weights is weights0 and x_scales is scales0:
        if not _holds(a2a, repeat, (x, indices), args):
            return None
        _relaunch(a2a, repeat, "_repeat_dispatch")
        result = repeat.prepared
    else:
        try:
            tokens = x.shape[0] if x is not x0 else repeat.tokens
        except Exception:
            return None
        if type(tokens) is not int or not 0 < tokens <= a2a.max_tokens:
            return None
        rows = (tokens, a2a.top_k)
        shapes = ((tokens, a2a.hidden), rows, rows, (tokens, a2a.scale_cols))
        holds = _launch_moved(a2a, repeat, "_repeat_dispatch", args, (x, indices), shapes, tokens, _dispatch_kernel_of)
        if holds is None:
            return None
        result = repeat.prepared if tokens == repeat.tokens else a2a._outputs(quick.stream).dispatch_result(tokens)
        # (AllToAll._keep outside a capture: the device may read them until the next call)
        a2a._keepalive = (*args, *holds)
    a2a._pending, a2a._pending_weights, a2a._pending_joined = result, weights, None
    return result


def quick_combine(a2a, repeat, expert_y, weights, out, stream, expert_scale):
    """combine(expert_y, weights, out=, stream=, expert_scale=) as `repeat` (which has a Quick) on these
    arrays: its output, or None where the call is not that repeat."""
    quick = repeat.quick
    y0, weights0, out0, stream0 = quick.given
    pending, scale, sent = a2a._pending, repeat.args[4], repeat.args[5]
    if ((stream is not stream0 and not _same_handle(stream, stream0)) or pending is None
            or a2a._pending_joined is not None or a2a._last_scale is not scale
            or (expert_scale is not scale[0] and not same_scale(expert_scale, scale[0]))):
        return None
    args, tokens, sent_now = (expert_y, weights, out), pending.num_tokens, a2a._pending_weights
    if (expert_y is y0 and weights is weights0 and out is out0 and tokens == repeat.tokens
            and sent_now is sent):
        if not _holds(a2a, repeat, args, args):
            return None
        _relaunch(a2a, repeat, "_repeat_combine")
        _, out_arr, keep, _ = repeat.prepared
        a2a._keepalive = keep  # (AllToAll._keep outside a capture: a repeat never runs inside one)
    else:
        # The weights dispatch sent are the kernels' already (combine takes none); else new ones may come.
        if (sent is None) != (sent_now is None) or (sent_now is not None and weights is not None):
            return None
        shapes = ((a2a.local_experts, a2a.capacity, a2a.hidden), (tokens, a2a.top_k), (tokens, a2a.hidden))
        holds = _launch_moved(a2a, repeat, "_repeat_combine", args, args, shapes, tokens, _combine_kernel_of)
        if holds is None:
            return None
        out_arr = a2a._outputs(quick.stream).y_rows[tokens] if out is None else out
        # (with what its dispatch kept: a JAX input's hold, under which JAX will not donate it, lasts
        # until the next dispatch, as the boundary's cache keeps a full-path description's)
        a2a._keepalive = (expert_y, weights, out_arr, *holds, a2a._keepalive)
    a2a._pending = a2a._pending_weights = None
    return out_arr


def _dispatch_kernel_of(a2a, tokens: int):
    return a2a._dispatch_kernel, a2a.block_threads


def _combine_kernel_of(a2a, tokens: int):
    return a2a._combine_kernel_for(tokens)  # (the small kernel for few tokens)


def _launch_moved(a2a, repeat, record: str, args: tuple, inputs: tuple, shapes: tuple, tokens: int,
                  kernel_of) -> list | None:
    """Queue `repeat` (a2a's `record`) on the leg's `args`, some of them new arrays, for `tokens` tokens
    (`shapes`: what each argument must be for them; `inputs`: those whose library may choose the stream),
    with the kernel and threads a block kernel_of(a2a, tokens) names: the new arrays' holds
    (pyhipa2a.producers); None, having done nothing, where the call is not that repeat on them."""
    holds = []
    pointers = _new_pointers(repeat, args, shapes, holds)
    if pointers is None or not _holds(a2a, repeat, inputs, args):
        return None
    quick = repeat.quick
    pack = _written(quick, pointers, tokens)
    kernel, threads = kernel_of(a2a, tokens)
    launches = quick.moved_launches
    if launches is None:
        launches = quick.moved_launches = {}
    launch = launches.get((kernel, threads))
    if launch is None:
        try:
            launch = launches[kernel, threads] = kernel.launcher(pack, a2a.blocks, threads)
        except BaseException:
            setattr(a2a, record, None)  # as the full path: a call that fails records nothing
            raise
    _relaunch(a2a, repeat, record, launch)
    return holds


def _written(quick: Quick, pointers: list, tokens: int):
    """The pack of the record's calls on new arrays (made from the record's arguments at the first), with
    `pointers` ((field, pointer) pairs) and the token count written in: its launcher hands the device
    the arguments as they are at the launch (Kernel.launcher)."""
    pack = quick.moved
    if pack is None:
        pack = quick.moved = quick.make_moved()
    call = pack.arguments[1]
    for field, ptr in pointers:
        setattr(call, field, ptr)
    call.num_tokens = tokens
    return pack


def _same_handle(stream, recorded) -> bool:
    """Whether stream= (not the record's object) names the record's stream anew: as a new int (a loop that
    passes `torch.cuda.current_stream().cuda_stream` or CuPy's `.ptr` makes a new int each time) or a new
    PyTorch or CuPy stream object (`torch.cuda.current_stream()` makes a new one each time)."""
    handle = producers.foreign_stream_handle(stream)
    return handle is not None and handle == producers.foreign_stream_handle(recorded)


def _again_of(quick: Quick, repeat) -> tuple:
    """The record's plan (pyhipa2a.again), or () with a warning where it cannot be made: a plan only
    speeds repeats up, so a failure to make one must not fail the call, or every second call after it."""
    try:
        return quick.make_again(repeat)
    except Exception as error:
        warnings.warn(f"pyhipa2a: a repeated call's plan could not be made ({error!r}); its repeats take the "
                      "Python path", RuntimeWarning, stacklevel=4)
        return ()


def _relaunch(a2a, repeat, record: str, launch=None) -> None:
    """Queue `repeat` (a2a's `record`) as the full path queues a repeat (Repeat.resume): after the last
    call and its arguments' producers, then `launch` (a function of the stream; None: the record's own,
    made at its first use with our device current, before anything is queued: one that cannot be made,
    its arguments refused by the driver say, fails the call); the stream is the last call's from then on."""
    quick, order = repeat.quick, a2a._order
    stream = quick.stream
    a2a.backend.activate()
    if launch is None:
        if quick.launch is None:
            try:
                quick.launch = quick.make_launch()
            except BaseException:
                setattr(a2a, record, None)  # as the full path: a call that fails records nothing
                raise
            if quick.make_again is not None:  # (the next repeat like this one runs in C)
                quick.again = _again_of(quick, repeat)
        launch = quick.launch
    repeat.resume(order, stream)
    try:
        launch(stream)
    except BaseException:
        setattr(a2a, record, None)  # as the full path: a call that fails records nothing
        raise
    order.queued(stream)
