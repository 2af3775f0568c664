"""A repeated call's plan (pyhipa2a.repeat): it takes exactly the calls the full path would make the same
way, and misses any other having done nothing, in both executors (csrc/repeat.c where it is built, and
the Python one). The plans here are made from records of calls through the real boundary and streams on
a fake CUDA runtime with fake PyTorch tensors (tests/fakes.py); test_a_loop_* make them on real objects."""
import ctypes
from types import SimpleNamespace

import numpy as np
import pytest

from pyhipa2a import repeat
from pyhipa2a.calls import COMBINE_ALIKE, DISPATCH_ALIKE, DISPATCH_ARGS, DISPATCH_WEIGHTS, CallState, stand_ins
from pyhipa2a.inputs import Boundary
from pyhipa2a.errors import RuntimeFailure
from pyhipa2a.runtime import Launcher
from pyhipa2a.streams import Streams
from tests.fakes import OURS, STRIDED, FakeRuntime, Tensor, fake_producer_module

TORCH_STREAM = 0x55
EXECUTORS = [pytest.param(True, id="c"), pytest.param(False, id="python")]


def executor(compiled: bool):
    if compiled and not repeat.COMPILED:
        pytest.skip("the C helper is not built here (python -m pyhipa2a.build)")
    return repeat.run if compiled else repeat.interpret


class Loop:
    """A loop's calls as pyhipa2a.api takes them on their full path (the stream, each argument through the
    boundary, the changes the call records), on a fake runtime and fake PyTorch tensors written on
    PyTorch's current stream; `plan(leg)` is the plan of the last two calls' of `leg`."""

    def __init__(self, monkeypatch, compiled: bool, follow_library: bool = True):
        self.current, self.asks, self.compiled = [TORCH_STREAM], [], compiled

        def current_stream(device):
            self.asks.append(device)
            return self.current[0]
        fake_producer_module(monkeypatch, "torch", Tensor, strided=STRIDED,
                             _C=SimpleNamespace(_cuda_getCurrentRawStream=current_stream))
        self.runtime = FakeRuntime()
        self.streams = Streams(self.runtime, OURS, follow_library, 0)
        self.boundary = Boundary(self.runtime, 0, self.streams, "protocol")
        self.state, self.status = CallState(), np.zeros(4, np.uint32)
        self.x, self.indices = Tensor(0x1000, (2, 4)), Tensor(0x1800, (2, 4), "int32")
        self.y, self.w = Tensor(0x2000, (1, 2, 4)), Tensor(0x2800, (2, 4), "float32")
        self.result, self.out = SimpleNamespace(num_tokens=2), SimpleNamespace(shape=(2, 4))
        self.launched, self.failures, self.rehands = [], [], []
        self.after = ()  # what a call does once its launch is queued (pyhipa2a.outputs orders the reader)
        self.where = {}  # argument name -> where the launch reads its pointer (none: arrays by identity)

    def _take(self, s, *arguments):
        return tuple((obj, self.boundary.take(name, obj, shape, dtype, s)) for name, obj, shape, dtype in arguments)

    def dispatch(self, x=None, stream=None, w=None) -> repeat.Record:
        x = self.x if x is None else x
        s, lead = self.streams.enter(stream, (x, self.indices))
        self.streams.follow(s)
        arrays = self._take(s, ("x", x, (2, 4), np.float16), ("indices", self.indices, (2, 4), np.int32),
                            *((("weights", w, (2, 4), np.float32),) if w is not None else ()))
        state = self.state
        changes = ((state, "pending", self.result), (state, "sent", w, DISPATCH_WEIGHTS), (state, "joined", None),
                   (state, "keep", tuple(t.keep for _, t in arrays)), (self.streams, "last", s))
        for obj, name, value, *_ in changes:
            setattr(obj, name, value)
        args = (x, self.indices, w, None, stream)
        alike, places = stand_ins(self.where, DISPATCH_ARGS, DISPATCH_ALIKE, args, arrays)
        return repeat.Record(args, alike, s, lead, (x, self.indices), arrays, 2, self.result, self.after, changes,
                             places, (state, "keep"))

    def combine(self, w=None, stream=None, scale=1.0) -> repeat.Record:
        w = self.w if w is None else w
        s, lead = self.streams.enter(stream, (self.y, w, None))
        self.streams.follow(s)
        arrays = self._take(s, ("expert_y", self.y, (1, 2, 4), np.float16), ("weights", w, (2, 4), np.float32))
        state = self.state
        changes = ((state, "pending", None), (state, "sent", None), (state, "joined", None),
                   (state, "keep", tuple(t.keep for _, t in arrays)), (self.streams, "last", s))
        for obj, name, value in changes:
            setattr(obj, name, value)
        return repeat.Record((self.y, w, None, stream, scale), COMBINE_ALIKE, s, lead, (self.y, w, None), arrays, 2,
                             self.out, self.after, changes)

    def plan(self, leg: str, **given):
        """`leg`'s call twice (described, then taken again as the plan's record), then its plan."""
        records = [getattr(self, leg)(**given) for _ in range(2)]
        assert records[1].same(records[0])
        state = self.state
        conditions = (((state, "broken", None), (state, "pending", None)) if leg == "dispatch" else
                      ((state, "broken", None), (state, "pending", self.result), (state, "sent", None),
                       (state, "joined", None)))

        def failed(what, code):
            self.failures.append((what, code))
            if code is not None:
                self.runtime.raise_driver_error(what, code)
        launch = Launcher(lambda s: self.launched.append((leg, s)), rehand=lambda: self.rehands.append(leg))
        return repeat.make_plan(records[1], conditions, self.streams, self.runtime, self.status.ctypes.data,
                                launch, failed, compiled=self.compiled)

    def run(self, plan, leg: str, **changed):
        """The plan run on the loop's arguments, `changed` replacing some."""
        args = (dict(x=self.x, indices=self.indices, weights=None, x_scales=None, stream=None) if leg == "dispatch"
                else dict(expert_y=self.y, weights=self.w, out=None, stream=None, expert_scale=1.0))
        return executor(self.compiled)(plan, *(args | changed).values())


@pytest.mark.parametrize("compiled", EXECUTORS)
def test_a_plan_takes_the_loops_call_asking_the_current_stream_once_a_leg(monkeypatch, compiled):
    loop = Loop(monkeypatch, compiled)
    dispatch = loop.plan("dispatch")
    loop.state.pending = None
    combine = loop.plan("combine")
    s = loop.streams.last
    loop.runtime.capture_queries.clear()
    for _ in range(3):
        loop.asks.clear()
        assert loop.run(dispatch, "dispatch") is loop.result and loop.state.pending is loop.result
        assert len(loop.asks) == 1  # the call's stream; x's and the indices' rechecks took that answer
        loop.asks.clear()
        assert loop.run(combine, "combine") is loop.out
        assert len(loop.asks) == 1 and loop.state.pending is None and len(loop.state.keep) == 2
    assert loop.launched == [("dispatch", s), ("combine", s)] * 3 and loop.streams.last is s
    assert loop.runtime.capture_queries == [s] * 6  # not the object's own stream: asked at every call


@pytest.mark.parametrize("compiled", EXECUTORS)
def test_a_lead_array_on_our_device_is_asked_its_device_once(monkeypatch, compiled):
    """An array that chose the call's stream and was taken without a recheck (a view we handed out) lives on
    our device for good: its plan asks the library for our device's current stream alone, not the array's
    device at every run (that answer is one CuPy reads from the array: about a microsecond)."""
    loop = Loop(monkeypatch, compiled)
    asked = []

    class Probe:
        def current_stream(self, obj, device):
            asked.append("array")
            return TORCH_STREAM if obj is loop.y and device == 0 else None

        def current_stream_here(self, device):
            asked.append("ours")
            return TORCH_STREAM
    record = loop.combine()._replace(lead=(Probe(), 0, TORCH_STREAM), arrays=())
    plan = repeat.make_plan(record, ((loop.state, "broken", None),), loop.streams, loop.runtime,
                            loop.status.ctypes.data, Launcher(loop.launched.append), lambda *_: None,
                            compiled=compiled)
    asked.clear()
    for _ in range(3):
        assert executor(compiled)(plan, loop.y, loop.w, None, None, 1.0) is loop.out
    assert asked == ["ours"] * 3 and len(loop.launched) == 3


@pytest.mark.parametrize("compiled", EXECUTORS)
def test_new_tensors_like_the_last_stand_in_their_pointers_written_where_the_launch_reads_them(monkeypatch,
                                                                                             compiled):
    """Where the arguments' pointers have places in the launch's arguments, a tensor the probe views as it
    viewed the recorded one (shape, strides, element type; our device; the same stream) stands in for it:
    its pointer is written there, the launch takes its arguments anew only when one moved, and what the
    device reads is kept (the call's arguments, beside what the recorded call kept). Another shape, another
    element type, an array of another kind miss, writing nothing."""
    loop = Loop(monkeypatch, compiled)
    held = (ctypes.c_uint64 * 2)(loop.x.ptr, loop.indices.ptr)
    loop.where = {"x": ctypes.addressof(held), "indices": ctypes.addressof(held) + 8}
    plan = loop.plan("dispatch")
    new_x, other_x = Tensor(0x5000, (2, 4)), Tensor(0x7000, (2, 4))
    for x, pointers, rehands in ((loop.x, [0x1000, 0x1800], 0), (new_x, [0x5000, 0x1800], 1),
                                 (other_x, [0x7000, 0x1800], 2), (loop.x, [0x1000, 0x1800], 3)):
        loop.state.pending = None
        assert loop.run(plan, "dispatch", x=x) is loop.result
        assert list(held) == pointers and len(loop.rehands) == rehands, (x.ptr, list(held), loop.rehands)
        arguments, recorded = loop.state.keep
        assert arguments[0] is x and arguments[1] is loop.indices and len(recorded) == 2
    loop.state.pending = None
    launched = len(loop.launched)
    for odd in (Tensor(0x6000, (3, 4)), Tensor(0x6000, (2, 4), "int32"), SimpleNamespace(ptr=0x6000)):
        assert loop.run(plan, "dispatch", x=odd) is repeat.MISSED
        assert list(held) == [0x1000, 0x1800] and len(loop.launched) == launched and loop.state.pending is None
    # The array that stood in at the last run, given again, misses: the full path makes the plan anew with it
    # as the recorded one (a loop on one set of arrays then matches by identity).
    assert loop.run(plan, "dispatch", x=new_x) is loop.result
    loop.state.pending = None
    assert loop.run(plan, "dispatch", x=new_x) is repeat.MISSED and list(held) == [0x5000, 0x1800]
    assert loop.state.pending is None and len(loop.launched) == launched + 1


@pytest.mark.parametrize("compiled", EXECUTORS)
def test_what_dispatch_sent_is_the_weights_that_stood_in(monkeypatch, compiled):
    """Weights given to dispatch are what it sent, for combine to compare with the weights it is given: where a
    new array stands in for the recorded weights, the plan records that array, not the recorded one."""
    loop = Loop(monkeypatch, compiled)
    held = (ctypes.c_uint64 * 1)(loop.w.ptr)
    loop.where = {"weights": ctypes.addressof(held)}
    plan = loop.plan("dispatch", w=loop.w)
    for w in (Tensor(0x5800, (2, 4), "float32"), loop.w):
        loop.state.pending = None
        assert loop.run(plan, "dispatch", weights=w) is loop.result
        assert loop.state.sent is w and held[0] == w.ptr, (hex(w.ptr), loop.state.sent)


@pytest.mark.parametrize("compiled", EXECUTORS)
def test_a_plans_after_steps_run_once_its_launch_is_queued(monkeypatch, compiled):
    """What orders the outputs' reader after the call (pyhipa2a.outputs) runs at every run of the plan,
    after the launch and before the call's changes, as on the full path."""
    loop = Loop(monkeypatch, compiled)
    seen = []
    loop.after = (lambda: seen.append((len(loop.launched), loop.state.pending)),)
    plan = loop.plan("dispatch")
    seen.clear()
    loop.state.pending = None
    for n in (1, 2):
        assert loop.run(plan, "dispatch") is loop.result
        assert seen[-1] == (n, None) and loop.state.pending is loop.result
        loop.state.pending = None
    assert len(seen) == 2


DISPATCH_CHANGES = ["broken", "kernel error", "capturing here", "captured elsewhere", "pending", "other stream",
                    "other array", "other stream given", "moved memory", "last call elsewhere"]


@pytest.mark.parametrize("compiled", EXECUTORS)
@pytest.mark.parametrize("change", DISPATCH_CHANGES)
def test_a_dispatch_that_is_not_the_plans_misses_and_does_nothing(monkeypatch, compiled, change):
    loop = Loop(monkeypatch, compiled)
    plan = loop.plan("dispatch")
    loop.state.pending = None
    given = {}
    if change == "broken":
        loop.state.broken = "an earlier failure"
    elif change == "kernel error":
        loop.status[0] = 3
    elif change == "capturing here":
        loop.streams.capturing = OURS
    elif change == "captured elsewhere":
        loop.runtime.capturing = True
    elif change == "pending":
        loop.state.pending = SimpleNamespace(num_tokens=2)
    elif change == "other stream":
        loop.current[0] = 0x66
    elif change == "other array":
        given = {"x": Tensor(0x1000, (2, 4))}
    elif change == "other stream given":
        given = {"stream": OURS}
    elif change == "moved memory":
        loop.x.ptr = 0x4000
    elif change == "last call elsewhere":
        loop.streams.last = loop.streams.given(0x77)
    before = (loop.state.pending, loop.state.keep, loop.streams.last)
    assert loop.run(plan, "dispatch", **given) is repeat.MISSED
    assert loop.launched == [] and (loop.state.pending, loop.state.keep, loop.streams.last) == before


@pytest.mark.parametrize("compiled", EXECUTORS)
@pytest.mark.parametrize("change", ["no dispatch", "another dispatch", "other scale", "weights sent", "other out",
                                    "joined"])
def test_a_combine_that_is_not_the_plans_misses_and_does_nothing(monkeypatch, compiled, change):
    loop = Loop(monkeypatch, compiled)
    plan = loop.plan("combine")
    loop.state.pending, given = loop.result, {}
    if change == "no dispatch":
        loop.state.pending = None
    elif change == "another dispatch":  # (another stream's views, or another token count's)
        loop.state.pending = SimpleNamespace(num_tokens=2)
    elif change == "other scale":
        given = {"expert_scale": 2.0}
    elif change == "weights sent":
        loop.state.sent = loop.w
    elif change == "other out":
        given = {"out": Tensor(0x3000, (2, 4))}
    elif change == "joined":
        loop.state.joined = 0x77
    pending = loop.state.pending
    assert loop.run(plan, "combine", **given) is repeat.MISSED
    assert loop.launched == [] and loop.state.pending is pending and len(loop.state.keep) == 2


@pytest.mark.parametrize("compiled", EXECUTORS)
def test_an_equal_scale_and_a_new_object_for_the_stream_stand_for_the_recorded_ones(monkeypatch, compiled):
    """A scale worked out afresh (gpu-mode's 1 + rank) repeats the call; -0.0 for 0.0 or an int for an equal
    float does not (a product's sign follows the scale's; the type is part of what was checked). A stream
    handle given as a new int, or a new PyTorch stream object naming it, repeats; another one does not."""
    loop = Loop(monkeypatch, compiled)
    plan = loop.plan("combine", scale=0.0)
    for scale, repeats in ((float("0.0"), True), (-0.0, False), (0, False)):
        loop.state.pending = loop.result
        assert (loop.run(plan, "combine", expert_scale=scale) is not repeat.MISSED) == repeats, scale
    handle = 0x7F00_1234  # (beyond CPython's small ints: each int(str(...)) is a new object)
    loop = Loop(monkeypatch, compiled)
    plan = loop.plan("dispatch", stream=int(str(handle)))
    for stream, repeats in ((int(str(handle)), True), (SimpleNamespace(cuda_stream=handle), True),
                            (SimpleNamespace(ptr=handle), True), (handle + 1, False), (None, False)):
        loop.state.pending = None
        assert (loop.run(plan, "dispatch", stream=stream) is not repeat.MISSED) == repeats, stream


@pytest.mark.parametrize("compiled", EXECUTORS)
def test_a_producer_on_another_stream_is_waited_for_at_every_repeat(monkeypatch, compiled):
    """Calls on our own stream (stream="own") of tensors PyTorch writes on its current stream: each repeat
    waits for that stream on the device, once for both arrays, before its launch."""
    loop = Loop(monkeypatch, compiled, follow_library=False)
    plan = loop.plan("dispatch")
    # (the full path's first call exported each array naming our stream; its second waited once for both)
    assert loop.runtime.waits == [(TORCH_STREAM, OURS)]
    for _ in range(2):
        loop.state.pending = None
        assert loop.run(plan, "dispatch") is loop.result
    assert loop.runtime.waits == [(TORCH_STREAM, OURS)] * 3 and loop.launched == [("dispatch", OURS)] * 2
    loop.current[0] = 0x66  # PyTorch writes elsewhere now: the full path's to wait for
    loop.state.pending = None
    assert loop.run(plan, "dispatch") is repeat.MISSED and len(loop.runtime.waits) == 3


def test_a_combine_after_one_of_other_groups_is_no_repeat(monkeypatch):
    """A combine's groups are no argument of its: the same arguments after a dispatch in other groups (or
    none) are another call, from which no plan is made."""
    loop = Loop(monkeypatch, False)
    plain = loop.combine()
    assert loop.combine().same(plain)
    assert not loop.combine()._replace(groups=4).same(plain)
    grouped = loop.combine()._replace(groups=4)
    assert loop.combine()._replace(groups=4).same(grouped) and not loop.combine()._replace(groups=2).same(grouped)


def test_a_record_a_plan_cannot_state_gets_none(monkeypatch):
    """An argument a repeat cannot take unasked (a tensor the probe does not know: PyTorch's protocol at
    every call), or one library's arrays naming different streams: no plan."""
    loop = Loop(monkeypatch, False)
    assert loop.plan("dispatch") is not None
    record = loop.dispatch()
    taken = record.arrays[0][1]
    odd = record._replace(arrays=((record.arrays[0][0], taken._replace(repeatable=False)), record.arrays[1]))
    assert repeat.make_plan(odd, (), loop.streams, loop.runtime, 0, Launcher(lambda s: None), None, False) is None
    other = taken.recheck._replace(stream=0x99)
    split = record._replace(arrays=(record.arrays[0], (record.arrays[1][0], taken._replace(recheck=other))),
                            lead=None)
    assert repeat.make_plan(split, (), loop.streams, loop.runtime, 0, Launcher(lambda s: None), None, False) is None


@pytest.mark.parametrize("compiled", EXECUTORS)
@pytest.mark.parametrize("raised", [RuntimeError("a deleted array"), KeyboardInterrupt()])
def test_a_check_that_raises_misses_unless_it_is_no_error(monkeypatch, compiled, raised):
    loop = Loop(monkeypatch, compiled)
    plan = loop.plan("dispatch")
    loop.state.pending = None

    def key(obj):
        raise raised
    plan = plan[:2] + (plan[2] + ((repeat.CALL_EQ, key, loop.x, 0),),) + plan[3:]
    if isinstance(raised, Exception):
        assert loop.run(plan, "dispatch") is repeat.MISSED
    else:
        with pytest.raises(KeyboardInterrupt):
            loop.run(plan, "dispatch")
    assert loop.launched == [] and loop.state.pending is None


@pytest.mark.parametrize("compiled", EXECUTORS)
def test_a_launch_that_raises_is_told_to_the_plan_and_changes_nothing(monkeypatch, compiled):
    loop = Loop(monkeypatch, compiled)
    plan = loop.plan("dispatch")
    loop.state.pending = None

    def failing(stream):
        raise RuntimeFailure("launch failed")
    plan = plan[:6] + ((failing, plan[6][1]),) + plan[7:]
    with pytest.raises(RuntimeFailure, match="launch failed"):
        loop.run(plan, "dispatch")
    assert loop.failures == [("launch", None)] and loop.state.pending is None


class DriverCalls:
    """cuCtxGetCurrent, cuCtxSetCurrent and cuGraphLaunch as C functions (ctypes callbacks) answering
    `codes`, the calls recorded: what a plan calls from C on CUDA."""
    GET = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.POINTER(ctypes.c_void_p))
    SET = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)
    LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)

    def __init__(self, current: int):
        self.current, self.calls, self.codes = current, [], {}

        def get(out):
            self.calls.append("get")
            out[0] = self.current
            return self.codes.get("get", 0)

        def set_(context):
            self.calls.append(("set", context))
            return self.codes.get("set", 0)

        def launch(graph, stream):
            self.calls.append(("launch", graph, stream))
            return self.codes.get("launch", 0)
        self.functions = (self.GET(get), self.SET(set_), self.LAUNCH(launch))  # (kept: C calls them)

    def address(self, i: int) -> int:
        return ctypes.cast(self.functions[i], ctypes.c_void_p).value


@pytest.mark.parametrize("fails", [None, "set", "launch"])
def test_a_plan_makes_its_context_current_and_launches_its_graph_from_c(monkeypatch, fails):
    executor(True)
    loop = Loop(monkeypatch, True)
    context, graph, recording = 0x77, 0x99, set()
    driver = DriverCalls(current=0x11)
    loop.runtime.plan_activate = lambda: (driver.address(0), driver.address(1), context)
    loop.runtime.plan_launch = lambda launch, s: ((driver.address(2), graph, int(s), launch), (recording,))
    plan = loop.plan("dispatch")
    s = loop.streams.last
    loop.state.pending = None
    if fails is None:
        assert loop.run(plan, "dispatch") is loop.result
        assert driver.calls == ["get", ("set", context), ("launch", graph, int(s))]
        driver.current, driver.calls, loop.state.pending = context, [], None
        assert loop.run(plan, "dispatch") is loop.result and driver.calls == ["get", ("launch", graph, int(s))]
        recording.add(int(s))  # a capture of ours records somewhere: the launcher's own launch() decides
        driver.calls, loop.state.pending = [], None
        assert loop.run(plan, "dispatch") is repeat.MISSED and driver.calls == []
    else:
        driver.codes[fails] = 700
        what = "cuCtxSetCurrent" if fails == "set" else "cuGraphLaunch"
        with pytest.raises(RuntimeFailure, match=what):
            loop.run(plan, "dispatch")
        assert loop.failures == [(what, 700)] and loop.state.pending is None
    assert loop.launched == [] and loop.runtime.activations == 0  # (from C, by the driver's entries)


def test_a_helper_built_for_another_plan_layout_is_not_loaded(monkeypatch):
    """A helper left by an older build (its PLAN_FIELDS another layout's, or its PLAN_FORMS fewer forms of a
    change) is not loaded: plans run in Python."""
    executor(True)
    assert repeat._load()[0] is not repeat.interpret
    for name in ("PLAN_FIELDS", "PLAN_FORMS"):
        with monkeypatch.context() as patched:
            patched.setattr(repeat, name, getattr(repeat, name) + 1)
            assert repeat._load()[0] is repeat.interpret, name


# -- plans made by real objects (the host backend, one rank, in this process) ---------------------------
@pytest.fixture
def a2a():
    from mpi4py import MPI

    from pyhipa2a import AllToAll
    with AllToAll(MPI.COMM_SELF, num_experts=4, experts_per_token=2, hidden_dim=64, max_num_tokens=8,
                  backend="host") as a2a:
        yield a2a


def checked_step(a2a, watched, arrays, inputs) -> list:
    """One step (dispatch, combine with the fused expert) on `arrays` holding `inputs`, on poisoned outputs,
    against the oracle; whether a plan took each call (calls_watched's `plans`)."""
    from pyhipa2a.testing import check_call, poison
    poison(a2a)
    watched.clear()
    d = a2a.dispatch(arrays[0], arrays[1])
    y = a2a.combine(d.expert_x, arrays[2], expert_scale=1.0 + a2a.rank)
    a2a.synchronize()
    check_call(a2a, inputs, d, y, fused=True)
    return watched.plans


@pytest.mark.parametrize("compiled", EXECUTORS)
def test_a_loop_on_new_arrays_like_the_last_takes_its_plans_from_its_third_call(monkeypatch, a2a, compiled):
    """New arrays of ours at every call, of one shape and stream: the plans take them from the third call,
    each new array's pointer written where the launch reads it (the host kernels read the pack). The last
    call's arrays given again take the full path once (which makes the plans anew with them), then match
    by identity; arrays of another stream take the full path. Every call right on poisoned outputs."""
    from pyhipa2a import calls
    from pyhipa2a.testing import draw_world, upload_inputs
    from tests.cases import calls_watched
    monkeypatch.setattr(calls, "run", executor(compiled))
    with calls_watched() as watched:
        for i in range(5):
            inputs = draw_world(20 + i, 1, 4, 2, 64, 8, token_counts=[5])
            arrays = upload_inputs(a2a, inputs)
            assert checked_step(a2a, watched, arrays, inputs) == ([True, True] if i >= 2 else []), i
        for i in range(3):  # (the same arrays again: their stand-in ends, their own plans take over)
            assert checked_step(a2a, watched, arrays, inputs) == [[False, False], [True, True], [True, True]][i], i
        inputs = draw_world(30, 1, 4, 2, 64, 8, token_counts=[5])
        elsewhere = upload_inputs(a2a, inputs, stream=a2a.backend.stream_create())
        assert checked_step(a2a, watched, elsewhere, inputs) == [False, False]


@pytest.mark.parametrize("compiled", EXECUTORS)
def test_a_loop_on_the_same_arrays_takes_its_plans_from_its_third_call(monkeypatch, a2a, compiled):
    from pyhipa2a import calls
    from pyhipa2a.testing import draw_world, upload_inputs
    from tests.cases import calls_watched
    monkeypatch.setattr(calls, "run", executor(compiled))
    with calls_watched() as watched:
        arrays = upload_inputs(a2a, draw_world(3, 1, 4, 2, 64, 8, token_counts=[5]))
        for i in range(5):
            inputs = draw_world(10 + i, 1, 4, 2, 64, 8, token_counts=[5])
            for arr, fresh in zip(arrays, (inputs.xs[0], inputs.indices[0], inputs.weights[0])):
                arr.copy_from(fresh)
            assert checked_step(a2a, watched, arrays, inputs) == ([True, True] if i >= 2 else []), i
        assert watched.forms == [("python", "python")] * 2  # (the host backend: its launch function, no device)
        # A launch that fails (the device unusable after a trap) raises and leaves no plan.
        a2a.backend.trap("a test's trap")
        watched.clear()
        with pytest.raises(RuntimeFailure, match="a test's trap"):
            a2a.dispatch(arrays[0], arrays[1])
        assert watched.plans == [None]
        with pytest.raises(RuntimeFailure, match="a test's trap"):
            a2a.dispatch(arrays[0], arrays[1])
        assert watched.plans == [None]  # (no plan ran again: the full path, which the device refuses too)


@pytest.mark.parametrize("compiled", EXECUTORS)
def test_an_array_whose_owner_was_closed_is_refused_where_a_plan_took_it(monkeypatch, a2a, compiled):
    """x in another object's memory (its x_buffer(), named on our stream): a loop's plans take it from the third
    call; once that object is closed its memory is freed (unmapped, or another object's by then), so the next call
    on it misses the plan and the full path refuses it before any kernel runs. The object stays usable."""
    from mpi4py import MPI

    from pyhipa2a import AllToAll, calls
    from pyhipa2a.array import DeviceArray
    from pyhipa2a.errors import A2AError
    from pyhipa2a.testing import draw_world, upload_inputs
    from tests.cases import calls_watched
    monkeypatch.setattr(calls, "run", executor(compiled))
    lender = AllToAll(MPI.COMM_SELF, num_experts=4, experts_per_token=2, hidden_dim=64, max_num_tokens=8,
                      backend="host")
    lent = lender.x_buffer()
    x = DeviceArray(a2a.backend, lent.ptr, (5, 64), lent.dtype, owner=lender, stream=a2a.stream)
    arrays = (x, *upload_inputs(a2a, draw_world(3, 1, 4, 2, 64, 8, token_counts=[5]))[1:])
    with calls_watched() as watched:
        for i in range(3):
            inputs = draw_world(40 + i, 1, 4, 2, 64, 8, token_counts=[5])
            for arr, fresh in zip(arrays, (inputs.xs[0], inputs.indices[0], inputs.weights[0])):
                arr.copy_from(fresh)
            assert checked_step(a2a, watched, arrays, inputs) == ([True, True] if i == 2 else []), i
        lender.close()
        watched.clear()
        with pytest.raises(A2AError, match="x was freed by close"):
            a2a.dispatch(*arrays[:2])
        assert watched.plans == [False]  # (the plan missed; the full path refused it)
        inputs = draw_world(50, 1, 4, 2, 64, 8, token_counts=[5])
        checked_step(a2a, watched, upload_inputs(a2a, inputs), inputs)  # (against the oracle, on poisoned outputs)
