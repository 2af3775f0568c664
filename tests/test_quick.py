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
from pyhipa2a.quick import ANY_INPUT, NO_LIBRARY, quick_combine, quick_dispatch, quick_for

from .test_inputs import OURS, FakeCuda, Tensor, boundary, fake_producer_module, take_in_call

TORCH_STREAM = 0x55


class Stream:
    def __init__(self, handle):
        self.handle = handle

    def __int__(self):
        return self.handle


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
    fake_producer_module(monkeypatch, "torch", Tensor, _C=SimpleNamespace(_cuda_getCurrentRawStream=current_stream))
    b, _ = boundary()
    runtime = Runtime()
    b.backend = b.order.backend = runtime
    tensors = SimpleNamespace(x=Tensor(0x1000, (2, 4)), indices=Tensor(0x1800, (2, 4), "int32"),
                              y=Tensor(0x2000, (2, 4)), w=Tensor(0x2800, (2, 4), "float32"))
    for _ in range(2):  # described, then settled
        take_in_call(b, "x", tensors.x, (2, 4), np.float16, TORCH_STREAM)
        b.take("indices", tensors.indices, (2, 4), np.int32, TORCH_STREAM)
        take_in_call(b, "expert_y", tensors.y, (2, 4), np.float16, TORCH_STREAM)
        b.take("weights", tensors.w, (2, 4), np.float32, TORCH_STREAM)
    me = SimpleNamespace(_broken=None, _capturing=None, host_status=[0], _on_current_stream=True, _library_device=0,
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
    me._repeat_dispatch.quick = quick_for(me, (tensors.x, tensors.indices, None, None, None), stream,
                                          lambda s: launched.append(("dispatch", s)), (tensors.x, tensors.indices),
                                          asked)
    out = object()
    prepared = (stream, out, ("y keep", "w keep", None), None)
    me._repeat_combine = Repeat.of((tensors.y, tensors.w, None, stream, me._last_scale, None), ("expert_y", "weights"),
                                   b, 2, prepared)
    me._repeat_combine.quick = quick_for(me, (tensors.y, tensors.w, None, None), stream,
                                         lambda s: launched.append(("combine", s)), (tensors.y, tensors.w, None),
                                         asked)
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


@pytest.mark.parametrize("change", ["broken", "kernel error", "capturing here", "captured elsewhere", "pending",
                                    "other stream", "other array", "other stream given", "moved memory"])
def test_a_call_that_is_not_the_repeat_launches_nothing(monkeypatch, change):
    me, t, _, launched = settled_object(monkeypatch)
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
    before = (me._pending, me._order.last)
    assert dispatch(me, t, **given) is None
    assert launched == [] and (me._pending, me._order.last) == before


@pytest.mark.parametrize("change", ["no dispatch", "other tokens", "other scale", "weights sent", "other out"])
def test_a_combine_that_is_not_the_repeat_launches_nothing(monkeypatch, change):
    me, t, _, launched = settled_object(monkeypatch)
    dispatch(me, t)
    launched.clear()
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
    assert quick_for(me, own + (None, None, None), stream, None, own, None).lead is NO_LIBRARY
    probe = producers.stream_source(t.x)
    mixed = quick_for(me, (t.x, t.indices, None, None, None), stream, None, (t.x, t.indices), {object(): 1})
    assert mixed.lead is ANY_INPUT
    # Each form repeats where the full path would, and only there.
    for lead, other in ((NO_LIBRARY, "last call elsewhere"), (ANY_INPUT, "library elsewhere")):
        me._repeat_dispatch.quick = dataclasses.replace(quick, lead=lead)
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
        record.quick = quick_for(me, q.given, q.stream, q.launch, (t.x, t.indices) if record is me._repeat_dispatch
                                 else (t.y, t.w, None), {producers.stream_source(t.x): TORCH_STREAM})
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
    chose = quick_for(me, quick.given, quick.stream, None, inputs, {probe: TORCH_STREAM, other: 1})
    assert chose.lead == (probe, 0, TORCH_STREAM)
    # (x's library answered nothing when the call chose its stream; another input's did)
    assert quick_for(me, quick.given, quick.stream, None, inputs, {other: 1, probe: TORCH_STREAM}).lead is ANY_INPUT


def test_a_stream_handle_given_as_a_new_int_repeats(monkeypatch):
    me, t, _, launched = settled_object(monkeypatch)
    record = me._repeat_dispatch
    handle = 0x7F00_1234  # (beyond CPython's small ints: each int(...) below is a new object)
    stream = me._stream_outside_capture(handle)
    record.quick = dataclasses.replace(record.quick, given=record.quick.given[:4] + (int(str(handle)),), stream=stream,
                                       follows_library=False)
    assert dispatch(me, t, stream=int(str(handle))) is not None and launched == [("dispatch", stream)]
    me._pending = None
    assert dispatch(me, t, stream=handle + 1) is None and len(launched) == 1


def test_a_quick_form_that_cannot_be_made_fails_the_call_before_anything_is_queued(monkeypatch):
    """The first repeat makes the record's quick form before it queues anything: where that fails (no
    memory for a graph, say), the call raises with nothing launched, waited for or recorded."""
    me, t, _, launched = settled_object(monkeypatch)
    me._repeat_dispatch.quick = None

    def failing(*args):
        raise RuntimeError("no graph")
    me._dispatch_kernel = SimpleNamespace(launch=lambda *a: launched.append(a), repeater=failing)
    me._dispatch_pack, me._repeat_packs, me.blocks, me.block_threads = None, (None, None), 1, 32
    last, waits = me._order.last, list(me.backend.waits)
    with pytest.raises(RuntimeError, match="no graph"):
        AllToAll._dispatch(me, t.x, t.indices, None, None, None)
    assert launched == [] and me._repeat_dispatch is None and me._pending is None
    assert me._order.last is last and me.backend.waits == waits
