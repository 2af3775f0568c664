"""A repeated call's flat form (pyhipa2a.quick), on a fake CUDA runtime and fake PyTorch tensors: it
launches exactly where the full path would repeat the call, asking PyTorch its current stream once a
leg, and anywhere else returns None having launched and changed nothing (the full path then runs)."""
import dataclasses
import functools
from types import SimpleNamespace

import numpy as np
import pytest

from pyhipa2a import producers
from pyhipa2a.a2a import AllToAll
from pyhipa2a.calls import Repeat
from pyhipa2a.quick import (ANY_INPUT, COMBINE_ARGS, NO_LIBRARY, _flat_rechecks, _lead_asks, positioned_rechecks,
                            quick_combine, quick_dispatch, quick_for)

DISPATCH = (("x", 1), ("indices", 1), ("weights", 4), ("x_scales", 4))  # (pyhipa2a.quick.DISPATCH_ARGS)

from .test_inputs import OURS, STRIDED, FakeCuda, Tensor, boundary, fake_producer_module, take_in_call

TORCH_STREAM = 0x55


class Stream:
    def __init__(self, handle):
        self.handle = handle

    def __int__(self):
        return self.handle


class Kernel(SimpleNamespace):
    """A kernel as the quick path keys its launchers by it (pyhipa2a.kernels.Kernel: by identity)."""
    __hash__ = object.__hash__


class Runtime(FakeCuda):
    def __init__(self):
        super().__init__()
        self.capturing, self.capture_queries = False, []

    def stream_from_handle(self, handle):
        return Stream(handle)  # a new object for each: as the bindings' stream wrappers

    def capturable(self, stream):
        return True

    def stream_capturing(self, stream):
        self.capture_queries.append(stream)
        return self.capturing


def settled_object(monkeypatch):
    """An AllToAll as the quick functions see it (stream="current"), PyTorch's current stream 0x55, and
    dispatch's x and indices and combine's expert_y and weights settled at the boundary on that stream:
    (object, tensors, the current-stream answers asked, the launches made)."""
    asks, current = [], [TORCH_STREAM]

    def current_stream(device):
        asks.append(device)
        return current[0]
    fake_producer_module(monkeypatch, "torch", Tensor, strided=STRIDED, _C=SimpleNamespace(_cuda_getCurrentRawStream=current_stream))
    b, _ = boundary()
    runtime = Runtime()
    b.backend = b.order.backend = runtime
    tensors = SimpleNamespace(x=Tensor(0x1000, (2, 4)), indices=Tensor(0x1800, (2, 4), "int32"),
                              y=Tensor(0x2000, (1, 2, 4)), w=Tensor(0x2800, (2, 4), "float32"))
    for _ in range(2):  # described, then settled
        take_in_call(b, "x", tensors.x, (2, 4), np.float16, TORCH_STREAM)
        b.take("indices", tensors.indices, (2, 4), np.int32, TORCH_STREAM)
        take_in_call(b, "expert_y", tensors.y, (1, 2, 4), np.float16, TORCH_STREAM)
        b.take("weights", tensors.w, (2, 4), np.float32, TORCH_STREAM)
    me = SimpleNamespace(_broken=None, _capturing=None, host_status=np.zeros(4, np.uint32), _on_current_stream=True, _library_device=0,
                         max_tokens=2, top_k=4, hidden=4, scale_cols=0, local_experts=1, capacity=2,
                         _order=b.order, stream=OURS, backend=runtime, _pending=None, _pending_weights=None,
                         _pending_joined=None, _joined=None, _keepalive=None, _last_scale=(1.0, np.float32(1.0)),
                         _repeat_dispatch=None, _repeat_combine=None, current=current)
    for name in ("_current_stream_of", "_stream_outside_capture", "_call_stream", "_capturable_elsewhere",
                 "_checked_scale", "_keep"):
        setattr(me, name, functools.partial(getattr(AllToAll, name), me))
    launched = []
    stream = me._stream_outside_capture(TORCH_STREAM)  # (the object's one view of the handle, as a call resolves it)
    result = SimpleNamespace(num_tokens=2)
    me._repeat_dispatch = Repeat.of((tensors.x, tensors.indices, None, None, stream), ("x", "indices"), b, 2, result)
    asked = {producers.stream_source(tensors.x): TORCH_STREAM}  # (what the recorded calls' streams took)
    me._repeat_dispatch.quick = quick_for(me, me._repeat_dispatch, (tensors.x, tensors.indices, None, None, None), stream,
                                          lambda: lambda s: launched.append(("dispatch", s)), (tensors.x, tensors.indices),
                                          asked)
    out = object()
    prepared = (stream, out, ("y keep", "w keep", None), None)
    me._repeat_combine = Repeat.of((tensors.y, tensors.w, None, stream, me._last_scale, None), ("expert_y", "weights"),
                                   b, 2, prepared)
    me._repeat_combine.quick = quick_for(me, me._repeat_combine, (tensors.y, tensors.w, None, None), stream,
                                         lambda: lambda s: launched.append(("combine", s)), (tensors.y, tensors.w, None),
                                         asked, COMBINE_ARGS)
    return me, tensors, asks, launched


def dispatch(me, t, **changed):
    args = dict(x=t.x, indices=t.indices, weights=None, x_scales=None, stream=None) | changed
    return quick_dispatch(me, me._repeat_dispatch, *args.values())


def combine(me, t, scale=1.0, **changed):
    args = dict(expert_y=t.y, weights=t.w, out=None, stream=None) | changed
    return quick_combine(me, me._repeat_combine, *args.values(), scale)


def test_a_repeat_launches_asking_the_current_stream_once_a_leg(monkeypatch):
    me, t, asks, launched = settled_object(monkeypatch)
    stream = me._repeat_dispatch.quick.stream
    for _ in range(3):
        asks.clear()
        result = dispatch(me, t)
        assert result is me._repeat_dispatch.prepared and me._pending is result
        assert len(asks) == 1  # the call's stream; x's and indices' rechecks took that answer
        asks.clear()
        assert combine(me, t) is me._repeat_combine.prepared[1]
        assert len(asks) == 1 and me._pending is None and me._keepalive == ("y keep", "w keep", None)
    assert launched == [("dispatch", stream), ("combine", stream)] * 3
    assert me._order.last is stream  # queued: a call on another stream waits for it
    assert me.backend.capture_queries == [stream] * 6  # not the object's own stream: asked at every call


DISPATCH_CHANGES = ["broken", "kernel error", "capturing here", "captured elsewhere", "pending", "other stream",
                    "other array", "other stream given", "moved memory"]


def changed_for_dispatch(me, t, change: str) -> dict:
    """Make `change` to test_a_call_that_is_not_the_repeat_launches_nothing's object and tensors: the
    dispatch() arguments it changes (shared with test_again: the plan misses wherever this path refuses)."""
    given = {}
    if change == "broken":
        me._broken = "an earlier failure"
    elif change == "kernel error":
        me.host_status[0] = 3
    elif change == "capturing here":
        me._capturing = OURS
    elif change == "captured elsewhere":
        me.backend.capturing = True
    elif change == "pending":
        me._pending = SimpleNamespace(num_tokens=2)
    elif change == "other stream":
        me.current[0] = 0x66
    elif change == "other array":
        given = {"x": Tensor(0x1000, (2, 4))}
    elif change == "other stream given":
        given = {"stream": OURS}
    elif change == "moved memory":
        t.x.ptr = 0x4000
    return given


@pytest.mark.parametrize("change", DISPATCH_CHANGES)
def test_a_call_that_is_not_the_repeat_launches_nothing(monkeypatch, change):
    me, t, _, launched = settled_object(monkeypatch)
    given = changed_for_dispatch(me, t, change)
    before = (me._pending, me._order.last)
    assert dispatch(me, t, **given) is None
    assert launched == [] and (me._pending, me._order.last) == before


COMBINE_CHANGES = ["no dispatch", "other tokens", "other scale", "weights sent", "other out"]


def changed_for_combine(me, t, change: str) -> tuple:
    """Make `change` to a dispatched object (test_a_combine_that_is_not_the_repeat_launches_nothing): the
    scale and the combine() arguments it changes (shared with test_again)."""
    scale, given = 1.0, {}
    if change == "no dispatch":
        me._pending = None
    elif change == "other tokens":
        me._pending = SimpleNamespace(num_tokens=1)
    elif change == "other scale":
        scale = 2.0
    elif change == "weights sent":
        me._pending_weights = t.w
    elif change == "other out":
        given = {"out": Tensor(0x3000, (2, 4))}
    return scale, given


@pytest.mark.parametrize("change", COMBINE_CHANGES)
def test_a_combine_that_is_not_the_repeat_launches_nothing(monkeypatch, change):
    me, t, _, launched = settled_object(monkeypatch)
    dispatch(me, t)
    launched.clear()
    scale, given = changed_for_combine(me, t, change)
    pending, last_scale = me._pending, me._last_scale
    assert combine(me, t, scale, **given) is None
    assert launched == [] and me._pending is pending and me._keepalive is None
    assert me._last_scale is last_scale  # (the full path checks a new scale)


def test_a_combine_after_a_kernel_error_leaves_its_scale_to_the_full_path(monkeypatch):
    """A reported error is the full path's to raise, before it looks at a scale it would refuse."""
    me, t, _, launched = settled_object(monkeypatch)
    dispatch(me, t)
    launched.clear()
    me.host_status[0] = 3
    assert combine(me, t, float("inf")) is None and launched == []


def test_a_failed_launch_leaves_no_record(monkeypatch):
    me, t, _, _ = settled_object(monkeypatch)

    def failing(stream):
        raise RuntimeError("launch failed")
    me._repeat_dispatch.quick = dataclasses.replace(me._repeat_dispatch.quick, launch=failing)
    with pytest.raises(RuntimeError, match="launch failed"):
        dispatch(me, t)
    assert me._repeat_dispatch is None and me._pending is None


def test_where_a_repeat_finds_its_stream_again(monkeypatch):
    """stream="current": a repeat asks the library of its first probed input alone where that input named
    the recorded stream; asks none where no input has a library (the last call's stream, as the full
    path takes it); and asks each in turn, as the full path does, where another input named it."""
    me, t, asks, launched = settled_object(monkeypatch)
    quick = me._repeat_dispatch.quick
    assert quick.lead == (producers.stream_source(t.x), 0, TORCH_STREAM)
    stream = quick.stream
    own = (object(), object())
    record = me._repeat_dispatch
    assert quick_for(me, record, own + (None, None, None), stream, None, own, None).lead is NO_LIBRARY
    probe = producers.stream_source(t.x)
    mixed = quick_for(me, record, (t.x, t.indices, None, None, None), stream, None, (t.x, t.indices), {object(): 1})
    assert mixed.lead is ANY_INPUT
    # Each form repeats where the full path would, and only there.
    for lead, other in ((NO_LIBRARY, "last call elsewhere"), (ANY_INPUT, "library elsewhere")):
        keys, streams = _flat_rechecks(positioned_rechecks(dict(zip(record.names, record.entries)), DISPATCH), lead)
        record.quick = dataclasses.replace(quick, lead=lead, keys=keys, streams=streams,
                                           lead_asks=_lead_asks(lead, (t.x, t.indices), keys))
        me._order.last, me._pending = stream, None
        assert dispatch(me, t) is not None
        me._pending, asks[:] = None, []
        if other == "last call elsewhere":
            me._order.last = me._stream_outside_capture(0x77)
        else:
            me.current[0] = 0x66
        assert dispatch(me, t) is None and me._pending is None
        me.current[0] = TORCH_STREAM
    assert probe is not None and len(launched) == 2


def test_a_stream_that_cannot_be_captured_is_not_asked(monkeypatch):
    """(CUDA's legacy stream, PyTorch's default: Backend.capturable) nor is the object's own stream."""
    me, t, _, launched = settled_object(monkeypatch)
    monkeypatch.setattr(Runtime, "capturable", lambda self, stream: False)
    for record in (me._repeat_dispatch, me._repeat_combine):
        q = record.quick
        dispatching = record is me._repeat_dispatch
        record.quick = quick_for(me, record, q.given, q.stream, q.make_launch, (t.x, t.indices) if dispatching
                                 else (t.y, t.w, None), {producers.stream_source(t.x): TORCH_STREAM},
                                 *(() if dispatching else (COMBINE_ARGS,)))
        assert not record.quick.ask_capture
    assert dispatch(me, t) is not None and combine(me, t) is not None
    assert me.backend.capture_queries == [] and len(launched) == 2


def test_the_library_that_chose_the_stream_is_the_one_asked_again(monkeypatch):
    """The repeat's rechecks add every producer's answer to the call's `asked` after the stream was
    chosen: the lead is the first entry's library, and only where that is the first probed input's;
    otherwise each library is asked in turn, as the full path asks them."""
    me, t, _, _ = settled_object(monkeypatch)
    probe, other = producers.stream_source(t.x), object()
    quick = me._repeat_dispatch.quick
    inputs = (t.x, t.indices)
    record = me._repeat_dispatch
    chose = quick_for(me, record, quick.given, quick.stream, None, inputs, {probe: TORCH_STREAM, other: 1})
    assert chose.lead == (probe, 0, TORCH_STREAM)
    # (x's library answered nothing when the call chose its stream; another input's did)
    assert quick_for(me, record, quick.given, quick.stream, None, inputs, {other: 1, probe: TORCH_STREAM}).lead is ANY_INPUT


def test_a_stream_handle_given_as_a_new_int_repeats(monkeypatch):
    me, t, _, launched = settled_object(monkeypatch)
    record = me._repeat_dispatch
    handle = 0x7F00_1234  # (beyond CPython's small ints: each int(...) below is a new object)
    stream = me._stream_outside_capture(handle)
    keys, streams = _flat_rechecks(positioned_rechecks(dict(zip(record.names, record.entries)), DISPATCH), None)
    record.quick = dataclasses.replace(record.quick, given=record.quick.given[:4] + (int(str(handle)),), stream=stream,
                                       follows_library=False, keys=keys, streams=streams, lead_asks=None)
    assert dispatch(me, t, stream=int(str(handle))) is not None and launched == [("dispatch", stream)]
    me._pending = None
    assert dispatch(me, t, stream=handle + 1) is None and len(launched) == 1


def test_a_stream_given_as_a_new_torch_stream_object_repeats(monkeypatch):
    """torch.cuda.current_stream() makes a new object at every call: one that names the record's stream
    handle repeats the record; one naming another stream, or nothing, does not."""
    me, t, _, launched = settled_object(monkeypatch)
    record = me._repeat_dispatch
    handle = 0x7F00_1234
    stream = me._stream_outside_capture(SimpleNamespace(cuda_stream=handle))
    assert stream is me._stream_outside_capture(handle)  # (one object per handle, however it is named)
    keys, streams = _flat_rechecks(positioned_rechecks(dict(zip(record.names, record.entries)), DISPATCH), None)
    given = record.quick.given[:4] + (SimpleNamespace(cuda_stream=handle),)
    record.quick = dataclasses.replace(record.quick, given=given, stream=stream, follows_library=False, keys=keys,
                                       streams=streams, lead_asks=None)
    torch_stream = SimpleNamespace(cuda_stream=handle)  # (a new object, as PyTorch's)
    assert dispatch(me, t, stream=torch_stream) is not None and launched == [("dispatch", stream)]
    me._pending = None
    assert dispatch(me, t, stream=handle) is not None and len(launched) == 2  # (the handle as an int)
    me._pending = None
    for other in (SimpleNamespace(cuda_stream=handle + 1), SimpleNamespace(ptr=handle + 1), Stream(handle)):
        assert dispatch(me, t, stream=other) is None and len(launched) == 2


def test_a_launch_that_cannot_be_made_fails_the_call_before_anything_is_queued(monkeypatch):
    """The first repeat of the record's own arrays makes the record's launch before it queues anything:
    where that fails (no memory for a graph, say), the call raises with nothing launched, waited for or
    recorded."""
    me, t, _, launched = settled_object(monkeypatch)

    def failing():
        raise RuntimeError("no graph")
    me._repeat_dispatch.quick.make_launch = failing
    last, waits = me._order.last, list(me.backend.waits)
    with pytest.raises(RuntimeError, match="no graph"):
        dispatch(me, t)
    assert launched == [] and me._repeat_dispatch is None and me._pending is None
    assert me._order.last is last and me.backend.waits == waits


def test_a_stream_given_asks_each_library_its_producer_stream_once_a_call(monkeypatch):
    """With stream= given, the library is not asked for the call's stream, but its arrays' producer stream
    must be the one they named when the record was made: asked once a call for all arrays of one
    library, and a repeat after it moved (PyTorch's current stream here) launches nothing."""
    me, t, asks, launched = settled_object(monkeypatch)
    record = me._repeat_dispatch
    stream = record.quick.stream
    keys, streams = _flat_rechecks(positioned_rechecks(dict(zip(record.names, record.entries)), DISPATCH), None)
    assert len(keys) == 2 and [(s[1], s[2]) for s in streams] == [(t.x, TORCH_STREAM)]
    record.quick = dataclasses.replace(record.quick, given=record.quick.given[:4] + (stream,), follows_library=False,
                                       keys=keys, streams=streams, lead_asks=None)
    asks.clear()
    assert dispatch(me, t, stream=stream) is record.prepared and len(asks) == 1 and len(launched) == 1
    me._pending, me.current[0] = None, 0x66
    assert dispatch(me, t, stream=stream) is None and len(launched) == 1 and me._pending is None


def test_arrays_of_one_library_that_named_different_streams_take_the_records_own_check(monkeypatch):
    """(No answer of the library can hold for both: the flat form leaves the verdict to Repeat.still.)"""
    me, t, _, _ = settled_object(monkeypatch)
    probe = producers.stream_source(t.x)
    rechecks = tuple((i, SimpleNamespace(probe=probe, key=(i,), stream=stream), obj)
                     for i, (stream, obj) in enumerate(((0x55, t.x), (0x66, t.indices))))
    assert _flat_rechecks(rechecks, None) == (None, None)
    assert _flat_rechecks(rechecks, ANY_INPUT) == (None, None)
    assert _flat_rechecks(rechecks[:1], None) == (((0, probe.key, t.x, (0,)),), ((probe, t.x, 0x55),))
    assert _flat_rechecks(rechecks[:1], (probe, 0, 0x55)) == (((0, probe.key, t.x, (0,)),), ())


def test_the_lead_is_asked_without_its_arrays_device_where_its_key_is_checked_first(monkeypatch):
    """A lead input whose key the repeat checks lives on our device when asked (its pointer is the one
    described there); one without a key check is asked as the full path asks it, array and all."""
    me, t, _, _ = settled_object(monkeypatch)
    record = me._repeat_dispatch
    probe = producers.stream_source(t.x)
    lead = (probe, 0, TORCH_STREAM)
    keys, _ = _flat_rechecks(positioned_rechecks(dict(zip(record.names, record.entries)), DISPATCH), lead)
    assert _lead_asks(lead, (t.x, t.indices), keys) == probe.current_stream_here
    asks = _lead_asks(lead, (t.x, t.indices), keys[1:])  # (x's key left out)
    assert asks.func == probe.current_stream and asks.args == (t.x,)
    assert _lead_asks(NO_LIBRARY, (t.x, t.indices), keys) is None
    t.x.ptr = 0x4000  # moved: the key check refuses before the lead is asked
    asked = []
    record.quick = dataclasses.replace(record.quick, lead_asks=lambda device: asked.append(device) or TORCH_STREAM)
    assert dispatch(me, t) is None and asked == []


def test_each_probe_names_the_same_stream_for_an_array_known_to_be_on_our_device(monkeypatch):
    """current_stream_here(device) answers as current_stream(array, device) does for an array on that
    device: the library's current stream there (1 for the legacy one), None where the library's
    current device is another (CuPy names the stream of its current device)."""
    from .test_inputs import fake_cupy, ndarray
    current = [0x55]
    fake_producer_module(monkeypatch, "torch", Tensor, strided=STRIDED, _C=SimpleNamespace(_cuda_getCurrentRawStream=lambda d: current[0]))
    t = Tensor(0x1000, (2, 4))
    torch_probe = producers.stream_source(t)
    for value, named in ((0x55, 0x55), (0, 1)):
        current[0] = value
        assert torch_probe.current_stream_here(0) == torch_probe.current_stream(t, 0) == named
    fake_cupy(monkeypatch, current)
    cupy_probe = producers.stream_source(ndarray(0x3000, (2, 4), stream=7))
    current[0] = 7
    assert cupy_probe.current_stream_here(0) == 7 and cupy_probe.current_stream_here(1) is None
    current[0] = 0
    assert cupy_probe.current_stream_here(0) == 1


def moving_object(monkeypatch):
    """settled_object whose dispatch record takes new tensors (a pack of its own for them, recorded)."""
    me, t, asks, launched = settled_object(monkeypatch)
    record = me._repeat_dispatch
    q = record.quick
    moved = SimpleNamespace(arguments=(None, SimpleNamespace(x=None, indices=None, weights=None, x_scales=None,
                                                             num_tokens=None)))
    record.quick = quick_for(me, record, q.given, q.stream, q.make_launch, (t.x, t.indices),
                             {producers.stream_source(t.x): TORCH_STREAM}, make_moved=lambda: moved)
    # (a launcher reads the pack at each launch, as Kernel.launcher's do)
    me._dispatch_kernel = Kernel(launcher=lambda pack, grid, block: lambda s: launched.append(
        ("moved", s, tuple(vars(pack.arguments[1]).values()))))
    me.blocks, me.block_threads = 1, 32
    me._outputs = lambda s: SimpleNamespace(dispatch_result=lambda tokens: ("result of", tokens))
    return me, t, asks, launched


@pytest.mark.parametrize("tokens", [2, 1])
def test_new_tensors_like_the_records_launch_on_their_pointers(monkeypatch, tokens):
    """New tensors of the record's type and element type, on our device, compact and aligned, stand in for
    the record's: the call launches from the moved pack with their pointers and token count (a new
    count: the result for it), asking PyTorch its stream once, and keeps them alive."""
    me, t, asks, launched = moving_object(monkeypatch)
    x, indices = Tensor(0x5000, (tokens, 4)), Tensor(0x5800, (tokens, 4), "int32")
    asks.clear()
    result = dispatch(me, t, x=x, indices=indices)
    assert launched == [("moved", me._repeat_dispatch.quick.stream, (0x5000, 0x5800, None, None, tokens))]
    assert result == (me._repeat_dispatch.prepared if tokens == 2 else ("result of", 1)) and me._pending is result
    assert len(asks) == 1 and me._keepalive[:2] == (x, indices)
    me._pending = None
    assert dispatch(me, t) is me._repeat_dispatch.prepared  # the record's own tensors: its own launch
    assert launched[-1] == ("dispatch", me._repeat_dispatch.quick.stream)


def test_a_launcher_that_cannot_be_made_fails_the_call_and_drops_the_record(monkeypatch):
    """A call on new arrays whose launcher cannot be made (the driver refusing its site, say) raises, queues
    nothing, and leaves no record to repeat, as a failed call on the full path."""
    me, t, _, launched = moving_object(monkeypatch)

    def refused(pack, grid, block):
        raise RuntimeError("refused")
    me._dispatch_kernel = Kernel(launcher=refused)
    with pytest.raises(RuntimeError, match="refused"):
        dispatch(me, t, x=Tensor(0x5000, (2, 4)), indices=Tensor(0x5800, (2, 4), "int32"))
    assert launched == [] and me._repeat_dispatch is None and me._pending is None


@pytest.mark.parametrize("odd", ["element type", "device", "not compact", "negated", "requires grad", "too many tokens",
                                 "shapes disagree", "record's indices for other tokens", "another type",
                                 "disowned type"])
def test_a_new_tensor_unlike_the_records_takes_the_full_path(monkeypatch, odd):
    me, t, _, launched = moving_object(monkeypatch)
    x, indices = Tensor(0x5000, (2, 4)), Tensor(0x5800, (2, 4), "int32")
    if odd == "element type":
        x = Tensor(0x5000, (2, 4), "float32")
    elif odd == "device":
        x.device = 1
    elif odd == "not compact":
        x.strides = (1, 2)
    elif odd == "negated":
        x.neg = True
    elif odd == "requires grad":
        x.requires_grad = True
    elif odd == "too many tokens":
        x, indices = Tensor(0x5000, (3, 4)), Tensor(0x5800, (3, 4), "int32")
    elif odd == "shapes disagree":
        indices = Tensor(0x5800, (1, 4), "int32")
    elif odd == "record's indices for other tokens":
        x, indices = Tensor(0x5000, (1, 4)), t.indices
    elif odd == "another type":
        x = TensorLike(0x5000, (2, 4))
    elif odd == "disowned type":  # (its view disagreed with its protocol since the record was made)
        producers.disown(x)
    assert dispatch(me, t, x=x, indices=indices) is None
    assert launched == [] and me._pending is None and me._keepalive is None


class TensorLike(Tensor):
    """(A subclass: not the record's type.)"""


def moving_combine(monkeypatch, sent=False):
    """settled_object whose combine record takes new tensors; the dispatch before it pending (its weights
    sent with it where `sent`): (object, tensors, launches, the moved pack's call)."""
    me, t, _, launched = settled_object(monkeypatch)
    record = me._repeat_combine
    q = record.quick
    call = SimpleNamespace(expert_y=None, weights=None, out=None, num_tokens=None)
    record.quick = quick_for(me, record, q.given, q.stream, q.make_launch, (t.y, t.w, None),
                             {producers.stream_source(t.x): TORCH_STREAM}, COMBINE_ARGS,
                             make_moved=lambda: SimpleNamespace(arguments=(None, call)))
    small, bulk = Kernel(name="small"), Kernel(name="bulk")
    for kernel in (small, bulk):
        kernel.launcher = lambda pack, grid, block, kernel=kernel: lambda s: launched.append(
            (kernel.name, s, dict(vars(pack.arguments[1]))))
    me._combine_kernel_for = lambda tokens: (small, 32) if tokens == 1 else (bulk, 256)
    me.blocks = 1
    me._outputs = lambda s: SimpleNamespace(y_rows=["y of 0", "y of 1", "y of 2"])
    dispatch(me, t)
    launched.clear()
    if sent:
        me._pending_weights = t.w
    return me, t, launched, call


@pytest.mark.parametrize("tokens", [2, 1])
def test_a_combine_with_new_weights_launches_on_their_pointer(monkeypatch, tokens):
    """New weights (and a new token count from the dispatch: the small kernel at one token, the rows of y
    for it) stand in for the record's; expert_y is the record's (its shape does not follow the tokens)."""
    me, t, launched, call = moving_combine(monkeypatch)
    me._pending = SimpleNamespace(num_tokens=tokens)
    w = Tensor(0x6000, (tokens, 4), "float32")
    dispatch_kept = me._keepalive
    y = combine(me, t, weights=w)
    pointers = {"expert_y": 0x2000, "weights": 0x6000, "out": None, "num_tokens": tokens}
    assert launched == [("small" if tokens == 1 else "bulk", me._repeat_combine.quick.stream, pointers)]
    assert y == f"y of {tokens}" and me._pending is None
    assert me._keepalive == (t.y, w, y, dispatch_kept)  # (its dispatch's too: until the next dispatch)


@pytest.mark.parametrize("odd", ["misaligned", "other rows", "weights sent, none given", "sent and given"])
def test_a_combine_unlike_the_records_takes_the_full_path(monkeypatch, odd):
    me, t, launched, _ = moving_combine(monkeypatch, sent=odd.startswith("weights sent") or odd == "sent and given")
    w = Tensor(0x6002 if odd == "misaligned" else 0x6000, (1 if odd == "other rows" else 2, 4), "float32")
    if odd == "weights sent, none given":  # (the record's weights were given to combine: the kernels differ)
        w = None
    pending = me._pending
    assert combine(me, t, weights=w) is None
    assert launched == [] and me._pending is pending


def test_weights_sent_with_dispatch_need_none_at_combine(monkeypatch):
    """A record whose weights went with its dispatch repeats on new weights sent with the next dispatch:
    combine takes none, and launches with no weights pointer of its own."""
    me, t, _, launched = settled_object(monkeypatch)
    record = me._repeat_combine
    q = record.quick
    record.args = record.args[:5] + (t.w,)  # (sent: the weights given to the recorded dispatch)
    record.quick = quick_for(me, record, (t.y, None, None, None), q.stream, q.make_launch, (t.y, None, None),
                             None, COMBINE_ARGS, make_moved=lambda: SimpleNamespace(arguments=(None, SimpleNamespace(
                                 expert_y=None, weights=0, out=None, num_tokens=None))))
    moved = Kernel(launcher=lambda pack, grid, block: lambda s: launched.append("moved"))
    me._combine_kernel_for = lambda tokens: (moved, 256)
    me.blocks, me._outputs = 1, lambda s: SimpleNamespace(y_rows=["y of 0", "y of 1", "y of 2"])
    me._pending, me._pending_weights = SimpleNamespace(num_tokens=1), Tensor(0x6000, (1, 4), "float32")
    launched.clear()
    assert combine(me, t, weights=None) == "y of 1" and launched == ["moved"]


def _as_the_view_says(probe, obj, element_type, shape):
    """What a Slot took from the probe's view before pointer_of: the pointer where the view shows obj on
    device 0, compact, of `element_type` and `shape`."""
    key = producers.view_here(probe, obj, 0)
    return key[0] if key is not None and key[3] == element_type and key[1] == shape else None


def test_pointer_of_answers_as_the_view_for_every_odd_array(monkeypatch):
    """A probe's pointer_of (what a Slot asks a new array at every call) takes exactly the arrays its view
    takes, of the element type and shape asked: PyTorch, CuPy and JAX arrays, each way an array can be
    unfit (another device, not compact, negated, conjugated, needing grad, nested, sparse, not CUDA,
    another element type or shape; a JAX array unfinished, deleted, elsewhere)."""
    from .test_inputs import KDL_CPU, ArrayImpl, fake_cupy, fake_jax, ndarray
    fake_producer_module(monkeypatch, "torch", Tensor, strided=STRIDED, _C=SimpleNamespace(_cuda_getCurrentRawStream=lambda d: 1))
    tensors = [Tensor(0x5000, (2, 4)) for _ in range(10)] + [Tensor(0x5000, (2, 4), "float32"), Tensor(0x5000, (3, 4))]
    for t, (name, value) in zip(tensors, [("device", 1), ("strides", (1, 2)), ("neg", True), ("conj", True),
                                          ("requires_grad", True), ("is_nested", True), ("layout", object()),
                                          ("is_cuda", False), ("device", -1)]):
        setattr(t, name, value)
    probe = producers.stream_source(tensors[0])
    answers = [probe.pointer_of(t, 0, "torch.float16", (2, 4)) for t in tensors]
    assert answers == [_as_the_view_says(probe, t, "torch.float16", (2, 4)) for t in tensors]
    assert answers[-3] == 0x5000 and answers.count(None) == len(tensors) - 1  # (only the untouched one is taken)
    fake_cupy(monkeypatch, [7])
    arrays = [ndarray(0x3000, (2, 4), stream=7), ndarray(0x3000, (3, 4), stream=7)]
    probe = producers.stream_source(arrays[0])
    for shape, element_type in (((2, 4), np.dtype(np.float16)), ((2, 4), np.dtype(np.float32)), ((3, 4), np.dtype(np.float16))):
        answers = [probe.pointer_of(a, 0, element_type, shape) for a in arrays]
        assert answers == [_as_the_view_says(probe, a, element_type, shape) for a in arrays]
    assert probe.pointer_of(arrays[0], 1, np.dtype(np.float16), (2, 4)) is None
    fake_jax(monkeypatch)
    arrays = [ArrayImpl(0x5000, (3, 4)) for _ in range(6)] + [ArrayImpl(0x5000, (3, 4), "float32")]
    arrays[1].ready, arrays[2].deleted, arrays[3].hardware_id, arrays[4].dlpack_kind = False, True, 1, KDL_CPU
    arrays[5].major_to_minor = (1, 0)
    probe = producers.stream_source(arrays[0])
    dtype = arrays[0].dtype
    answers = [probe.pointer_of(a, 0, dtype, (3, 4)) for a in arrays]
    assert answers == [_as_the_view_says(probe, a, dtype, (3, 4)) for a in arrays]
    assert answers[0] == 0x5000 and answers[1:] == [None] * 6


def test_new_finished_jax_arrays_stand_in_for_the_records(monkeypatch):
    """A settled JAX argument's Slot takes a new array of its element type whose computation has
    finished, on our GPU and shaped for the call, and holds it (its plain export, kept with the call's
    arrays); not one still queued (its export must order it), deleted, failed or elsewhere, nor another
    element type, shape or type. A PyTorch Slot holds nothing."""
    from pyhipa2a.quick import _slot

    from .test_inputs import KDL_CPU, ArrayImpl, fake_jax
    fake_jax(monkeypatch)
    b, _ = boundary()
    for _ in range(2):
        take_in_call(b, "x", ArrayImpl(0x1000, (2, 4)), (2, 4), np.float16)
    slot, holds = _slot("x", 1, b.settled("x"), 0), []
    new = ArrayImpl(0x5000, (3, 4))
    assert slot.pointer(new, (3, 4), holds) == 0x5000 and new.asked == [None] and len(holds) == 1
    odd = [ArrayImpl(0x5000, (3, 4)) for _ in range(5)]
    odd[0].ready, odd[1].deleted, odd[2].failed, odd[3].hardware_id, odd[4].dlpack_kind = False, True, True, 1, KDL_CPU
    for a in odd + [ArrayImpl(0x5000, (3, 4), "float32"), ArrayImpl(0x5000, (2, 4)), Tensor(0x5000, (3, 4))]:
        assert slot.pointer(a, (3, 4), holds) is None
    assert len(holds) == 1


def test_a_call_on_new_jax_arrays_keeps_their_holds(monkeypatch):
    """The quick path's call on new arrays keeps what holds them with its arrays (AllToAll._keepalive),
    until the next call replaces them."""
    me, t, _, launched = moving_object(monkeypatch)
    holds = []

    class Held(Tensor):  # (a PyTorch tensor whose Slot holds it, as a JAX array's does)
        pass
    record = me._repeat_dispatch
    held = lambda obj: holds.append(obj) or "hold"  # noqa: E731
    record.quick.slots = tuple(None if s is None else s._replace(kind=Held, hold=held) for s in record.quick.slots)
    x, indices = Held(0x5000, (2, 4)), Held(0x5800, (2, 4), "int32")
    monkeypatch.setitem(producers._by_type, Held, producers.stream_source(t.x))
    assert dispatch(me, t, x=x, indices=indices) is not None
    assert holds == [x, indices] and me._keepalive == (x, indices, None, None, "hold", "hold")
