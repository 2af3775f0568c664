"""A repeated call on the record's own arrays, written down once and run in C.

The loop's usual call is the last one again, on the same arrays (pyhipa2a.quick). Its Python asks
some 40 lines a leg: about 2.5 us of host time on the device machines besides the driver's launch,
close to a third of an eager step with PyTorch tensors (docs/PERFORMANCE.md, thirty-eighth
session). What those lines ask of a record can be listed once, as a plan: the call's arguments
that must be the recorded objects (or, for stream= and expert_scale, ones that stand for them as
quick_dispatch and quick_combine accept them), the attributes and producer answers quick._holds
asks, the ordering Repeat.resume would find nothing to do for (the last call on this stream, or
none pending; every producer on the call's stream), the launcher's own test (CUDA: no stream of
ours recording) and the kernels' status word; then what to make current, what to launch and what
to set. `run(plan, *args)` (csrc/again.c, built by `python -m pyhipa2a.build`) asks and does that in
C, and returns the call's result, or MISSED having done nothing. The Python quick path then runs,
and takes or refuses the call as before (new arrays, another token count, a scale of another
type, the last call on another stream, which it orders after). So a plan only ever narrows that
path, never widens it; a record whose checks a plan cannot state (a stream chosen among several
libraries' inputs, rechecks the call collects, a producer on another stream) gets none: `()`.

Where the helper is not built (no C compiler or no Python.h at install, a free-threaded CPython,
which has no limited API) `run` is None and every repeat takes the Python path, as before.
"""
from __future__ import annotations

import importlib.machinery
import importlib.util
import operator
from pathlib import Path

from .inputs import same_scale
from .quick import ANY_INPUT, NO_LIBRARY, _same_handle

# A check's kinds (csrc/again.c): a[b] is want (a: a dict); the same or None; a(b) is want; a(b) == want.
# An object's attributes are asked in its __dict__ (vars()): the plan reads and sets them there, at
# some 15 ns each where getattr on an AllToAll took 50-70.
ENTRY_IS, ENTRY_IS_OR_NONE, CALL_IS, CALL_EQ = range(4)
PLAN_FIELDS = 9  # (given, alike, checks, status, activate, launch, sets, result, failed): _plan's tuple
_HELPER = Path(__file__).resolve().parent / "_code" / "_again.abi3.so"


def _load():
    """(run, MISSED) of the built helper, or (None, None) where it is not built, where this interpreter
    takes no limited-API extension (a free-threaded build), or where it does not load."""
    if not _HELPER.exists() or ".abi3.so" not in importlib.machinery.EXTENSION_SUFFIXES:
        return None, None
    try:
        loader = importlib.machinery.ExtensionFileLoader("pyhipa2a._again", str(_HELPER))
        spec = importlib.util.spec_from_file_location("pyhipa2a._again", _HELPER, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except (ImportError, OSError):  # (another platform's build, say: the Python path stands)
        return None, None
    if getattr(module, "PLAN_FIELDS", None) != PLAN_FIELDS:  # (a helper left by an older build)
        return None, None
    return module.run, module.MISSED


run, MISSED = _load()
_pending_tokens = operator.attrgetter("_pending.num_tokens")


def plan_dispatch(a2a, repeat) -> tuple:
    """The plan of dispatch's `repeat` (whose Quick has made its launch): quick_dispatch on the record's
    own arrays; () where the record has none."""
    quick = repeat.quick
    checks = _holds_checks(a2a, repeat)
    if checks is None:
        return ()
    given = quick.given
    return _plan(a2a, repeat, "_repeat_dispatch", given, (None, None, None, None, _same_handle),
                 ((ENTRY_IS, vars(a2a), "_pending", None), *checks),
                 (("_pending", repeat.prepared), ("_pending_weights", given[2]), ("_pending_joined", None)),
                 repeat.prepared)


def plan_combine(a2a, repeat) -> tuple:
    """The plan of combine's `repeat` (whose Quick has made its launch): quick_combine on the record's
    own arrays, with the recorded expert_scale (or one same_scale finds equal); () where the record has none."""
    quick = repeat.quick
    checks = _holds_checks(a2a, repeat)
    if checks is None:
        return ()
    scale, sent = repeat.args[4], repeat.args[5]
    _, out, keep, _ = repeat.prepared
    state = vars(a2a)
    leg = ((ENTRY_IS, state, "_pending_joined", None), (ENTRY_IS, state, "_last_scale", scale),
           (CALL_EQ, _pending_tokens, a2a, repeat.tokens), (ENTRY_IS, state, "_pending_weights", sent))
    return _plan(a2a, repeat, "_repeat_combine", (*quick.given, scale[0]), (None, None, None, _same_handle, same_scale),
                 leg + checks, (("_keepalive", keep), ("_pending", None), ("_pending_weights", None)), out)


def _holds_checks(a2a, repeat) -> tuple | None:
    """quick._holds for the record's own arrays, then Repeat.resume's ordering, as checks; None where a
    plan cannot state them."""
    quick, order = repeat.quick, a2a._order
    stream, lead = quick.stream, quick.lead
    if (quick.keys is None or (quick.follows_library and lead is ANY_INPUT)
            or not all(order.same_stream(producer, stream) for producer in repeat.waits)):
        return None  # (per-call rechecks; a stream chosen among libraries, each asked in turn; a producer to wait for)
    state = vars(a2a)
    checks = [(ENTRY_IS, state, "_broken", None), (ENTRY_IS, state, "_capturing", None)]
    # StreamOrder.follow orders nothing where the last call was on this stream or none is pending; the
    # stream of a call that follows no library's is latest(): the last one's, else the object's own.
    last_may_be_none = not (quick.follows_library and lead is NO_LIBRARY and order.default is not stream)
    checks.append((ENTRY_IS_OR_NONE if last_may_be_none else ENTRY_IS, vars(order), "last", stream))
    if quick.ask_capture:
        checks.append((CALL_IS, a2a.backend.stream_capturing, stream, False))
    settled = quick.settled.__self__  # (Boundary.settled is its table's own get)
    checks += [(ENTRY_IS, settled, name, entry) for name, entry in quick.entries]
    checks += [(CALL_EQ, key_of, obj, key) for _, key_of, obj, key in quick.keys]
    if quick.lead_asks is not None:
        checks.append((CALL_EQ, quick.lead_asks, a2a._library_device, lead[2]))
    checks += [(CALL_EQ, probe.stream, obj, named) for probe, obj, named in quick.streams]
    return tuple(checks)


def _plan(a2a, repeat, record: str, given: tuple, alike: tuple, checks: tuple, sets: tuple, result) -> tuple:
    """The plan (csrc/again.c's fields) of a2a's `record`: its leg's checks, then the backend's own (its
    launcher's test, the status word), its launch, and `sets` ((name, value) of a2a) after the stream's."""
    quick, backend = repeat.quick, a2a.backend

    def failed(what: str, code: int | None) -> None:
        """A driver call of the plan's returned `code` (raised here), or its launch function raised (code
        None: the C goes on raising that)."""
        if what != "cuCtxSetCurrent":  # (as quick._relaunch: a launch that fails records nothing)
            setattr(a2a, record, None)
        if code is not None:
            backend.raise_driver_error(what, code)
    launch, must_be_empty = backend.again_launch(quick.launch, quick.stream)
    checks += tuple((CALL_IS, operator.not_, collection, True) for collection in must_be_empty)
    state = vars(a2a)
    sets = ((vars(a2a._order), "last", quick.stream),) + tuple((state, name, value) for name, value in sets)
    # (host_status: the uint32 words the kernels report into, host-mapped; the plan reads the first in place)
    return (given, alike, checks, a2a.host_status.ctypes.data, backend.again_activate(), launch, sets, result,
            failed)
