"""A repeated call's plan, run in C (pyhipa2a.again), on test_quick's fake CUDA runtime and fake PyTorch
tensors: it launches where the Python quick path launches, doing what that path does, and misses,
having done nothing, wherever that path would not launch (so the plan narrows the quick path, never
widens it); a driver call of its own that fails raises the backend's error and drops the record as a
failed launch does."""
import ctypes
import dataclasses
import os
import sysconfig

import numpy as np
import pytest

from pyhipa2a import again, build, quick
from pyhipa2a.runtime.base import Backend, RuntimeFailure

from .test_quick import (COMBINE_CHANGES, DISPATCH_CHANGES, changed_for_combine, changed_for_dispatch, combine,
                         dispatch, settled_object)

built = pytest.mark.skipif(again.run is None, reason="the C helper is not built here (see test_the_helper_is_built)")


def test_the_helper_is_built_where_a_compiler_is():
    """`pip install` builds it (python -m pyhipa2a.build) wherever there is a C compiler and Python.h: then
    every repeat below runs in C, and this fails if it does not load."""
    if build.find_c_compiler() is None or not os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")):
        pytest.skip("no C compiler or no Python.h: repeats take the Python path")
    assert again.run is not None and again.MISSED is not None


def planned(monkeypatch):
    """test_quick's settled object whose two records have made their launches and plans (a first repeat of
    each leg, on the Python path), the launches made since cleared."""
    me, t, asks, launched = settled_object(monkeypatch)
    me.backend.again_activate = Backend.again_activate.__get__(me.backend)
    me.backend.again_launch = Backend.again_launch.__get__(me.backend)
    for record, plan in (("_repeat_dispatch", again.plan_dispatch), ("_repeat_combine", again.plan_combine)):
        repeat = getattr(me, record)
        repeat.quick.make_again = lambda repeat, plan=plan: plan(me, repeat)
    assert dispatch(me, t) is not None and combine(me, t) is not None
    assert me._repeat_dispatch.quick.again and me._repeat_combine.quick.again
    launched.clear()
    me.backend.capture_queries.clear()
    return me, t, asks, launched


def run_dispatch(me, t, **changed):
    args = dict(x=t.x, indices=t.indices, weights=None, x_scales=None, stream=None) | changed
    return again.run(me._repeat_dispatch.quick.again, *args.values())


def run_combine(me, t, scale=1.0, **changed):
    args = dict(expert_y=t.y, weights=t.w, out=None, stream=None) | changed
    return again.run(me._repeat_combine.quick.again, *args.values(), scale)


@built
def test_a_repeat_runs_as_the_python_path_runs_it(monkeypatch):
    me, t, asks, launched = planned(monkeypatch)
    stream = me._repeat_dispatch.quick.stream
    me._order.last = None  # (after a synchronize: nothing to order after)
    for _ in range(3):
        asks.clear()
        me._pending_joined = me._pending_weights = me._keepalive = "stale"  # (each is set, not kept)
        result = run_dispatch(me, t)
        assert result is me._repeat_dispatch.prepared and me._pending is result and me._pending_joined is None
        assert me._pending_weights is None  # (dispatch's weights=, None here)
        assert len(asks) == 1 and me._order.last is stream  # the call's stream asked once; queued
        asks.clear()
        assert run_combine(me, t) is me._repeat_combine.prepared[1]
        assert len(asks) == 1 and me._pending is None and me._pending_weights is None
        assert me._keepalive == ("y keep", "w keep", None)
    assert launched == [("dispatch", stream), ("combine", stream)] * 3
    assert me.backend.capture_queries == [stream] * 6  # (not the object's own stream: asked at every call)


@built
@pytest.mark.parametrize("change", DISPATCH_CHANGES + ["last call elsewhere", "entry dropped"])
def test_a_call_that_is_not_the_repeat_misses_and_does_nothing(monkeypatch, change):
    """test_quick's changes (the status word among them, read in place), the last call on another stream
    (which the Python path orders this one after), a boundary entry dropped since."""
    me, t, _, launched = planned(monkeypatch)
    given = changed_for_dispatch(me, t, change)
    if change == "last call elsewhere":
        me._order.last = object()
    elif change == "entry dropped":
        me._repeat_dispatch.boundary._settled.pop("indices")
    before = (me._pending, me._order.last, me._pending_weights)
    assert run_dispatch(me, t, **given) is again.MISSED
    assert launched == [] and (me._pending, me._order.last, me._pending_weights) == before
    if change != "last call elsewhere":  # (which the Python path orders and takes)
        assert dispatch(me, t, **given) is None and launched == []  # the Python path refuses it too


@built
@pytest.mark.parametrize("change", COMBINE_CHANGES + ["scale of another type", "joined dispatch", "scale checked since"])
def test_a_combine_that_is_not_the_repeat_misses_and_does_nothing(monkeypatch, change):
    me, t, _, launched = planned(monkeypatch)
    assert run_dispatch(me, t) is not again.MISSED
    launched.clear()
    scale, given = changed_for_combine(me, t, change)
    if change == "scale of another type":
        scale = 1  # (an int: the kernels' product follows the type the full path checks)
    elif change == "joined dispatch":
        me._pending_joined = object()
    elif change == "scale checked since":
        me._last_scale = (1.0, np.float32(1.0))  # (another call's check: the record's is not the kernels')
    me._keepalive = None
    pending, last_scale = me._pending, me._last_scale
    assert run_combine(me, t, scale, **given) is again.MISSED
    assert launched == [] and me._pending is pending and me._keepalive is None and me._last_scale is last_scale


@built
def test_an_equal_scale_stands_for_the_recorded_one(monkeypatch):
    """A scale computed anew at each call is the recorded scale where same_scale says so."""
    me, t, _, launched = planned(monkeypatch)
    assert run_dispatch(me, t) is not again.MISSED
    fresh = float(np.float64(1.0))
    assert fresh is not me._repeat_combine.args[4][0]
    assert run_combine(me, t, fresh) is me._repeat_combine.prepared[1] and len(launched) == 2


@built
def test_a_check_that_raises_misses_unless_it_is_no_error(monkeypatch):
    """A producer that raises (an Exception) leaves the call to the Python path, which lets its protocol
    say what is wrong; an interrupt goes on up."""
    me, t, _, launched = planned(monkeypatch)
    for raised in (ValueError("a producer's failure"), KeyboardInterrupt()):
        def key(obj, raised=raised):
            raise raised
        plan = me._repeat_dispatch.quick.again
        checks = plan[2] + ((again.CALL_EQ, key, t.x, 0),)
        me._repeat_dispatch.quick.again = plan[:2] + (checks,) + plan[3:]
        if isinstance(raised, Exception):
            assert run_dispatch(me, t) is again.MISSED
        else:
            with pytest.raises(KeyboardInterrupt):
                run_dispatch(me, t)
        me._repeat_dispatch.quick.again = plan
    assert launched == [] and me._pending is None


class DriverCalls:
    """cuCtxGetCurrent, cuCtxSetCurrent and cuGraphLaunch as C functions (ctypes callbacks) answering
    `codes`, the calls recorded: what a plan of CUDA's calls from C."""
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


@built
@pytest.mark.parametrize("fails", [None, "set", "launch"])
def test_a_plan_makes_its_context_current_and_launches_its_graph_from_c(monkeypatch, fails):
    me, t, asks, launched = settled_object(monkeypatch)
    context, graph, recording = 0x77, 0x99, set()
    driver = DriverCalls(current=0x11)
    errors = []

    def raise_driver_error(what, code):
        errors.append((what, code))
        raise RuntimeFailure(f"{what} failed: {code}")
    me.backend.again_activate = lambda: (driver.address(0), driver.address(1), context)
    me.backend.again_launch = lambda launch, stream: ((driver.address(2), graph, int(stream), launch), (recording,))
    me.backend.raise_driver_error = raise_driver_error
    repeat = me._repeat_dispatch
    repeat.quick.make_again = lambda repeat: again.plan_dispatch(me, repeat)
    assert dispatch(me, t) is not None and repeat.quick.again  # (the Python path's repeat, which made the plan)
    launched.clear()
    stream = repeat.quick.stream
    me._pending = None
    if fails is None:
        assert run_dispatch(me, t) is repeat.prepared
        assert driver.calls == ["get", ("set", context), ("launch", graph, int(stream))]
        driver.current, driver.calls = context, []
        me._pending = None
        assert run_dispatch(me, t) is repeat.prepared and driver.calls == ["get", ("launch", graph, int(stream))]
        recording.add(int(stream))  # a capture of ours records somewhere: the launcher's own launch() decides
        me._pending, driver.calls = None, []
        assert run_dispatch(me, t) is again.MISSED and driver.calls == []
    else:
        driver.codes[fails] = 700
        what = "cuCtxSetCurrent" if fails == "set" else "cuGraphLaunch"
        with pytest.raises(RuntimeFailure, match=what):
            run_dispatch(me, t)
        assert errors == [(what, 700)] and me._pending is None
        # A launch that fails records nothing (quick._relaunch); a context that cannot be made current
        # fails the call before anything is queued, as activate() does.
        assert (me._repeat_dispatch is None) == (fails == "launch")
    assert launched == []  # (the Python launcher never ran: the plan launched from C)


def test_a_record_the_plan_cannot_state_gets_none(monkeypatch):
    """A stream chosen among several libraries' inputs, rechecks the call collects (keys None), or a
    producer on another stream than the call's (which Repeat.resume waits for): no plan."""
    me, t, _, _ = settled_object(monkeypatch)
    repeat = me._repeat_dispatch
    repeat.quick.launch = lambda stream: None
    me.backend.again_activate = Backend.again_activate.__get__(me.backend)
    me.backend.again_launch = Backend.again_launch.__get__(me.backend)
    assert again.plan_dispatch(me, repeat)
    waits = repeat.waits
    repeat.waits = waits + (0x4242,)
    assert again.plan_dispatch(me, repeat) == ()
    repeat.waits = waits
    recorded = repeat.quick
    repeat.quick = dataclasses.replace(recorded, lead=quick.ANY_INPUT)
    assert again.plan_dispatch(me, repeat) == ()
    repeat.quick = dataclasses.replace(recorded, keys=None)
    assert again.plan_dispatch(me, repeat) == ()


@built
def test_a_launch_that_raises_drops_the_record_as_the_python_path_does(monkeypatch):
    me, t, _, launched = planned(monkeypatch)
    plan = me._repeat_dispatch.quick.again

    def failing(stream):
        raise RuntimeError("launch failed")
    me._repeat_dispatch.quick.again = plan[:5] + ((failing, plan[5][1]),) + plan[6:]
    with pytest.raises(RuntimeError, match="launch failed"):
        run_dispatch(me, t)
    assert me._repeat_dispatch is None and me._pending is None and launched == []


@built
@pytest.mark.parametrize("default_is_the_stream", [False, True])
def test_a_call_following_no_library_runs_on_the_last_calls_stream(monkeypatch, default_is_the_stream):
    """stream="current" with inputs of no library: the call's stream is the last call's, else the object's
    own (StreamOrder.latest). After a synchronize (none pending) the plan takes the recorded stream only
    where it is the object's own; on another last stream it misses, as quick._holds refuses."""
    me, t, _, launched = planned(monkeypatch)
    repeat = me._repeat_dispatch
    stream = repeat.quick.stream
    repeat.quick = dataclasses.replace(repeat.quick, lead=quick.NO_LIBRARY, lead_asks=None)
    if default_is_the_stream:
        me._order.default = stream
    repeat.quick.again = again.plan_dispatch(me, repeat)
    for last in (None, object(), stream):
        me._order.last, me._pending = last, None
        python_takes = (me._order.latest() is stream)
        assert (run_dispatch(me, t) is not again.MISSED) == python_takes, last
        if not python_takes:
            me._order.last = last
            assert dispatch(me, t) is None
    assert len(launched) == (2 if default_is_the_stream else 1)


@built
def test_another_librarys_stream_is_asked_again(monkeypatch):
    """An argument of another library than the one that chose the stream: its library's stream must name
    what it named when the record was made (quick._holds asks quick.streams)."""
    me, t, _, launched = planned(monkeypatch)
    repeat = me._repeat_dispatch
    named = [0x31]
    other = type("OtherProbe", (), {"stream": staticmethod(lambda obj: named[0])})()
    repeat.quick = dataclasses.replace(repeat.quick, streams=((other, t.indices, 0x31),))
    repeat.quick.again = again.plan_dispatch(me, repeat)
    assert run_dispatch(me, t) is not again.MISSED
    me._pending, named[0] = None, 0x32
    assert run_dispatch(me, t) is again.MISSED and dispatch(me, t) is None and len(launched) == 1


def test_a_plan_that_cannot_be_made_leaves_the_call_to_the_python_path(monkeypatch):
    """A plan only speeds repeats up: where making it fails the call still runs (a warning says so) and
    its repeats take the Python path."""
    me, t, _, launched = settled_object(monkeypatch)

    def unmakeable(repeat):
        raise ValueError("no plan")
    me._repeat_dispatch.quick.make_again = unmakeable
    with pytest.warns(RuntimeWarning, match="plan could not be made"):
        assert dispatch(me, t) is me._repeat_dispatch.prepared
    assert me._repeat_dispatch.quick.again == () and launched == [("dispatch", me._repeat_dispatch.quick.stream)]


@built
def test_a_helper_built_for_another_plan_layout_is_not_loaded(monkeypatch):
    assert again._load()[0] is not None
    monkeypatch.setattr(again, "PLAN_FIELDS", again.PLAN_FIELDS + 1)
    assert again._load() == (None, None)
