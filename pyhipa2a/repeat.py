"""A repeated call, written down once as a plan and run without its checks.

Once the full path has made the same call twice in a row (`Record.same`), the leg's call becomes a plan:
what must still hold (arguments, attributes, producers' answers, the kernels' status word), then what to
do (make current, wait for producers, launch, set attributes) and the result. The same call may come on
new arrays like the last (a layer's activations are new tensors at every step): where the arguments'
kernel pointers have a place in the launch's arguments, the plan takes the new arrays and writes their
pointers there. `run(plan, *args)` does exactly that, or returns MISSED having done nothing and the full
path takes the call. It is csrc/repeat.c (built by `python -m pyhipa2a.build`) or `interpret` below where
that is not built: the same steps.

A plan's tuple (csrc/repeat.c's fields):
  given     the call's arguments as recorded (compared by identity)
  alike     for each argument None, or f(arg, recorded) -> truthy: another object standing for it (for an
            argument with a place, the pointer the launch takes from it)
  checks    (ATTR_IS, obj, name, want) getattr(obj, name) is want; ATTR_IS_OR_NONE the same or None;
            (CALL_IS, f, arg, want) f(arg) is want; (CALL_EQ, f, arg, want) f(arg) == want; raising misses
  status    the address of a uint32 word that must read 0 (a kernel's error report), or 0
  activate  None; (f,): f(); or (cuCtxGetCurrent, cuCtxSetCurrent, context) as addresses
  waits     f() each, before the launch: the call's stream waits for a producer's
  launch    (f, stream): f(stream); or (cuGraphLaunch, executable graph, stream, keep) as addresses
  after     f() each, once the launch is queued: the stream that reads the outputs waits for the call's
  changes   (obj, name, value) each, set once the launch is queued; (obj, name, value, None): set to the pair
            (the call's arguments, value): what the device reads, whichever arrays stood in; (obj, name,
            value, i): set to the call's argument i (the array given, where one stood in for `value`)
  result    what the call returns
  failed    f(what, code): a driver call here returned `code` (it raises), or the launch raised (code None)
  places    () or, for each argument, None or (address, pointer): where its kernel pointer lies in the
            launch's arguments (a uint64 in host memory), and the recorded argument's pointer
  rehand    None, or f(): the launch takes its arguments anew (after a pointer was written: CUDA's graph)
  stood     a list, written by the executor: for each argument the array that stood in for it at the last
            run, else None. That array given again misses: the full path makes the plan anew with it as
            the recorded one, so a loop on one set of arrays matches them by identity, not by asking
"""
from __future__ import annotations

import ctypes
import functools
import importlib.machinery
import importlib.util
import operator
import warnings
from pathlib import Path
from typing import NamedTuple

from .array import DeviceArray, FreedMemory
from .runtime import Launcher
from .streams import ANY, LAST

ATTR_IS, ATTR_IS_OR_NONE, CALL_IS, CALL_EQ = range(4)
PLAN_FIELDS = 14
PLAN_FORMS = 2  # the forms of a change the executors read (csrc/repeat.c's PLAN_FORMS)
_HELPER = Path(__file__).resolve().parent / "_code" / "_repeat.abi3.so"


class _Missed:
    __slots__ = ()

    def __repr__(self) -> str:
        return "MISSED"


def change_value(change: tuple, args: tuple):
    """What a change sets (see `changes` above): its value, the pair, or the call's argument."""
    if len(change) == 3:
        return change[2]
    return (args, change[2]) if change[3] is None else args[change[3]]


def interpret(plan: tuple, *args):
    """run() in Python: the call's result, or MISSED having done nothing."""
    given, alike, checks, status, activate, waits, launch, after, changes, result, failed, places, rehand, stood = plan
    if len(args) != len(given):
        return MISSED
    pointers = []  # (address, the pointer this call's argument puts there)
    try:
        for i, (arg, recorded, same) in enumerate(zip(args, given, alike)):
            place = places[i] if places else None
            if arg is recorded:
                if place is not None:
                    pointers.append(place)
                continue
            if place is not None and stood[i] is arg:
                return MISSED
            answer = None if same is None else same(arg, recorded)
            if not answer:
                return MISSED
            if place is not None:
                pointers.append((place[0], int(answer)))
        for kind, a, b, want in checks:
            if kind == ATTR_IS or kind == ATTR_IS_OR_NONE:
                got = getattr(a, b)
                if got is not want and (kind == ATTR_IS or got is not None):
                    return MISSED
            elif kind == CALL_IS:
                if a(b) is not want:
                    return MISSED
            elif not a(b) == want:
                return MISSED
    except Exception:
        return MISSED
    if status and ctypes.c_uint32.from_address(status).value:
        return MISSED
    if activate is not None:
        activate[0]()
    for wait in waits:
        wait()
    moved = False
    for address, pointer in pointers:
        held = ctypes.c_uint64.from_address(address)
        if held.value != pointer:
            held.value, moved = pointer, True
    try:
        if moved and rehand is not None:
            rehand()
        launch[0](launch[1])
    except BaseException:
        failed("launch", None)
        raise
    for step in after:
        step()
    for change in changes:
        setattr(change[0], change[1], change_value(change, args))
    if places:
        stood[:] = [None if place is None or arg is recorded else arg
                    for arg, recorded, place in zip(args, given, places)]
    return result


def _load():
    """(run, MISSED) of the built helper, or (interpret, a MISSED of ours) where it is not built, where this
    interpreter takes no limited-API extension (a free-threaded build), or where it does not load."""
    fallback = interpret, _Missed()
    if not _HELPER.exists() or ".abi3.so" not in importlib.machinery.EXTENSION_SUFFIXES:
        return fallback
    try:
        loader = importlib.machinery.ExtensionFileLoader("pyhipa2a._repeat", str(_HELPER))
        spec = importlib.util.spec_from_file_location("pyhipa2a._repeat", _HELPER, loader=loader)
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
    except (ImportError, OSError):  # (another platform's build, say: the Python executor stands)
        return fallback
    if (getattr(module, "PLAN_FIELDS", None), getattr(module, "PLAN_FORMS", None)) != (PLAN_FIELDS, PLAN_FORMS):
        return fallback  # (a helper left by an older build)
    return module.run, module.MISSED


run, MISSED = _load()
COMPILED = run is not interpret


class Relaunch(Launcher):
    """A call the host takes part in at each launch (a grouped dispatch's ticket; a grouped combine's parts and
    the bound on their waits), as Calls._finish's `launch`: it queues `queue(stream, *pointers)`. Its kernel
    pointers are uint64 words in host memory (`places`: argument name -> address), where a plan writes the
    pointer of a new array standing in for the recorded one before it calls again."""

    def __init__(self, queue, names: tuple, pointers: tuple):
        words = (ctypes.c_uint64 * len(names))(*pointers)
        super().__init__(lambda stream: queue(stream, *words))
        base = ctypes.addressof(words)
        self.places = {name: base + 8 * i for i, name in enumerate(names)}


class Record(NamedTuple):
    """What the full path made of a call: its arguments and how each is matched again, its stream and how
    it was chosen (pyhipa2a.streams), the inputs that choice read, each device argument, and the outcome."""
    args: tuple
    alike: tuple
    stream: object
    lead: object
    inputs: tuple
    arrays: tuple   # (object, Taken) of each device argument the call took
    tokens: int
    result: object
    after: tuple    # f() each, once the launch is queued (pyhipa2a.outputs orders the outputs' reader)
    changes: tuple
    places: tuple = ()  # the plan's places (see the module's doc): () where no argument has one
    keep: tuple = ()    # (obj, name) of the change that keeps what the device reads, where places are given
    groups: int = 0     # the groups the call's dispatch was made in (a combine's, which no argument says)

    def same(self, other: "Record | None") -> bool:
        """Whether this call repeats `other`'s: the same stream, tokens and groups, and each argument the same
        or one that stands for it by `other`'s test."""
        return (other is not None and self.stream is other.stream and self.tokens == other.tokens
                and self.groups == other.groups
                and all(a is b or (f is not None and f(a, b)) for a, b, f in zip(self.args, other.args, other.alike)))


def make_plan(record: Record, conditions: tuple, streams, backend, status: int, launch: Launcher, failed,
              compiled: bool = COMPILED) -> tuple | None:
    """The plan of `record`'s call, queued again by `launch`, whose object must still meet `conditions`
    ((obj, name, want)); None where an argument must be asked anew at every call (NumPy, a DLPack export,
    ...) or one library's arrays name different streams. `compiled`: for csrc/repeat.c (driver calls by address)."""
    if not repeatable(record):
        return None
    s, lead = record.stream, record.lead
    checks = [(ATTR_IS, obj, name, want) for obj, name, want in conditions]
    checks.append((ATTR_IS, streams, "capturing", None))
    # (follow() orders nothing where the last call was on this stream or none is pending)
    last_may_be_none = not (lead == LAST and s is not streams.own)
    checks.append((ATTR_IS_OR_NONE if last_may_be_none else ATTR_IS, streams, "last", s))
    if streams.capturable_elsewhere(s):
        checks.append((CALL_IS, backend.stream_capturing, s, False))
    if any(isinstance(obj, DeviceArray) for obj, _ in record.arrays):  # (an owner, maybe another object's, may close)
        checks.append((ATTR_IS, FreedMemory, "epoch", FreedMemory.epoch))
    named, keyed = {}, set()
    for obj, taken in record.arrays:
        recheck = taken.recheck
        if recheck is not None:
            checks.append((CALL_EQ, recheck.probe.key, obj, recheck.key))
            named.setdefault(recheck.probe, {})[id(obj)] = (obj, recheck.stream)
            keyed.add(id(obj))
    if lead == ANY:
        checks.append((CALL_IS, streams.chosen, record.inputs, s))
    elif type(lead) is tuple:
        probe, i, handle = lead
        obj = record.inputs[i]
        # (an array's device never changes: one whose key held, or one on our device now, is asked about our
        # device alone, without its own attributes)
        here = id(obj) in keyed or probe.current_stream(obj, streams.library_device) is not None
        ask = probe.current_stream_here if here else functools.partial(probe.current_stream, obj)
        checks.append((CALL_EQ, ask, streams.library_device, handle))
    for probe, answers in named.items():
        if type(lead) is tuple and probe is lead[0]:
            continue  # (its answer stands for every array of its library, each of which named that stream)
        streams_named = {stream for _, stream in answers.values()}
        if len(streams_named) > 1:
            return None
        obj, stream = next(iter(answers.values()))
        checks.append((CALL_EQ, probe.stream, obj, stream))
    waits = tuple(functools.partial(backend.stream_wait_stream, s, streams.named(w))
                  for w in dict.fromkeys(taken.wait for _, taken in record.arrays if taken.wait is not None))
    launched, must_be_empty = backend.plan_launch(launch, s) if compiled else ((launch.queue, s), ())
    checks += [(CALL_IS, operator.not_, collection, True) for collection in must_be_empty]
    activate = backend.plan_activate() if compiled else (None if backend.kind == "host" else (backend.activate,))
    changes, rehand = record.changes, None
    for change in changes:  # (an argument a change names is checked here, not once the launch is queued)
        if len(change) == 4 and change[3] is not None and not 0 <= change[3] < len(record.args):
            raise ValueError(f"a change names argument {change[3]} of a call of {len(record.args)}")
    if record.places:  # what the device reads is the call's arguments, whichever stood in
        owner, kept = record.keep
        changes = tuple((obj, name, value, None) if obj is owner and name == kept and len(rest) == 0
                        else (obj, name, value, *rest) for obj, name, value, *rest in changes)
        rehand = launch.rehand
    # (record.changes set streams.last already: a plan is made outside a capture only)
    return (record.args, record.alike, tuple(checks), status, activate, waits, launched, record.after,
            changes, record.result, failed, record.places, rehand, [None] * len(record.places))


def repeatable(record: Record) -> bool:
    """Whether each of the call's arrays can be taken again as it was taken (not NumPy's copy, a DLPack export...)."""
    return all(taken.repeatable for _, taken in record.arrays)


def plan_or_none(record: Record, conditions: tuple, streams, backend, status: int, make_launch,
                 drop) -> tuple | None:
    """make_plan for an owner's call, its launch made by `make_launch()` only where the call can repeat: a launch
    whose driver call fails calls `drop()` (the call leaves no plan, as a failed full path) and raises; a plan
    (or launch) that cannot be made warns and is None (a plan only speeds repeats up: it never fails the call)."""
    def failed(what: str, code) -> None:
        if what != "cuCtxSetCurrent":
            drop()
        if code is not None:
            backend.raise_driver_error(what, code)
    try:
        return make_plan(record, conditions, streams, backend, status, make_launch(), failed) \
            if repeatable(record) else None
    except Exception as error:
        warnings.warn(f"pyhipa2a: a repeated call's plan could not be made ({error!r}); its repeats take the "
                      "full path", RuntimeWarning, stacklevel=5)
        return None
