"""Where an object's calls run, in what order, and what a capture records (docs/ARRAYS.md).

A call waits for the last call's stream (they hand the device's epoch on) and for its inputs' producers:
one event recorded there and waited for here, nothing when the streams are one, nothing while capturing.
"""
from __future__ import annotations

from . import producers
from .errors import A2AError

LAST = "last"  # a call's stream, chosen as the last call's: no input's library names one
ANY = "any"    # chosen by an input's library, but not the first input's that has one


class Streams:
    __slots__ = ("backend", "own", "follow_library", "library_device", "last", "capturing", "joined", "kept",
                 "capture_source", "_waited", "_by_handle")

    def __init__(self, backend, own, follow_library: bool, library_device: int | None):
        self.backend, self.own = backend, own
        self.follow_library = follow_library
        self.library_device = library_device  # None on the host backend: no library's stream means anything
        self.last = None       # the stream of the last call (or graph launch) queued; None: nothing pending
        self.capturing = None  # the stream a capture records: ours (begin) or another library's (joined)
        self.joined = None     # that stream while one call is recorded into another library's capture
        self.kept = None       # what the capture's graph must keep alive
        self.capture_source = None  # the probe of the first input of the last capture() whose library names streams
        self._waited = []      # (producer, stream) pairs the coming call waits for already
        self._by_handle = {backend.stream_handle(own): own}  # one object a handle: callers compare by it

    # -- a call's stream -------------------------------------------------------
    def enter(self, stream, inputs, may_join: bool = True):
        """(the call's stream, how it was chosen: None, LAST, (probe, input, handle) or ANY). A call on a
        stream another library captures joins that capture until leave(); `may_join` False refuses it."""
        if self.capturing is not None:
            if stream is not None and self.given(stream) is not self.capturing:
                raise A2AError("inside capture(), every call must use the capturing stream (pass no stream=)")
            if self.follow_library and self.capture_source is None and self.joined is None:
                self.capture_source = next(filter(None, map(producers.stream_source, inputs)), None)
            return self.capturing, None
        if stream is None and self.follow_library:
            s, lead = self.current(inputs)  # (one of our stream objects already)
        else:
            s, lead = self.given(stream), None
        if self.captured_elsewhere(s):
            if not may_join:
                raise A2AError("a call between nodes cannot be recorded into another library's capture (its "
                               "exchange between nodes is watched from the host): record it with capture()")
            self.backend.capture_join(s)
            self.capturing, self.kept, self.joined = s, [], s
        return s, lead

    def leave(self) -> None:
        """The end of a call that joined another library's capture (nothing otherwise)."""
        if self.joined is not None:
            self.backend.capture_leave(self.joined)
            self.capturing = self.kept = self.joined = None

    def given(self, stream):
        """The stream object of a call's stream= (None: our own); TypeError for what is no stream."""
        if stream is None:
            return self.own
        handle = producers.foreign_stream_handle(stream)
        if handle is None:
            if not isinstance(stream, self.backend.stream_type):
                raise TypeError(f"stream= must be a stream handle (an int), a CuPy or PyTorch stream, or one of "
                                f"this backend's streams; got {type(stream).__name__}")
            return stream
        return self.stream_of(handle)

    def current(self, inputs):
        """stream="current": (the current stream of the first input's library that names one, how chosen),
        else (the last call's stream, LAST): calls on our own arrays stay in order with those around them."""
        if self.library_device is None:
            return self.latest(), LAST
        first = None
        for i, obj in enumerate(inputs):
            probe = producers.stream_source(obj)
            if probe is None:
                continue
            try:
                handle = probe.current_stream(obj, self.library_device)
            except Exception:  # (the call's own checks then say what is wrong with obj)
                handle = None
            if first is None:
                first = i
            if handle is not None:
                return self.named(handle), ((probe, i, handle) if i == first else ANY)
        return self.latest(), (LAST if first is None else ANY)

    def chosen(self, inputs):
        """The stream current() chooses for `inputs` now (a plan's check of a stream chosen as ANY)."""
        return self.current(inputs)[0]

    def captured_elsewhere(self, s) -> bool:
        """Whether `s`, not our own stream, is being captured: by another library, for a call's stream outside
        capture(); inside, a stream forked into it."""
        return self.capturable_elsewhere(s) and self.backend.stream_capturing(s)

    def capturable_elsewhere(self, s) -> bool:
        """Whether another library may capture `s` (not our own stream, nor CUDA's legacy one)."""
        return s is not self.own and self.backend.capturable(s)

    # -- order -----------------------------------------------------------------
    def follow(self, stream) -> None:
        """Queue the coming call on `stream` behind the last one (not while capturing: a capture may not wait
        for work outside it); its inputs' producers are waited for afresh (wait_for_producer)."""
        if self.capturing is not None:
            return
        self._waited.clear()
        if self.last is not None and self.last is not stream:
            self.backend.stream_wait_stream(stream, self.last)

    def queued(self, stream) -> None:
        """A call (or graph launch) went to `stream`: the next call on another stream waits for it."""
        if self.capturing is None:
            self.last = stream

    def latest(self):
        """The stream to synchronize for every call so far: the last call's, else our own."""
        return self.last if self.last is not None else self.own

    def synchronized(self, stream) -> None:
        """The host waited for `stream`: when that was the last call's, nothing is left to wait for."""
        if self.last is not None and self.backend.stream_handle(stream) == self.backend.stream_handle(self.last):
            self.last = None

    def wait_for_producer(self, producer, stream) -> None:
        """Queue the use of an input on `stream` after its producer's writes (`producer`: one of our streams
        or a foreign handle); once per producer and stream in a call."""
        if self.capturing is not None:
            return
        for p, s in self._waited:
            if s is stream and (p is producer or p == producer):
                return
        self._waited.append((producer, stream))
        if self.same_stream(producer, stream):
            return
        if isinstance(producer, int):
            producer = self.named(producer)
        self.backend.stream_wait_stream(stream, producer)

    def stream_of(self, handle: int):
        """The stream object of a runtime handle, the same one at every call (None: no such stream)."""
        stream = self._by_handle.get(handle)
        if stream is None:
            stream = self.backend.stream_from_handle(handle)
            if stream is not None:
                self._by_handle[handle] = stream
        return stream

    def same_stream(self, producer, stream) -> bool:
        """Whether `producer` (one of our streams, or an interface's handle) is `stream`."""
        if producer is stream:
            return True
        return isinstance(producer, int) and self.runtime_handle(producer) == self.backend.stream_handle(stream)

    def named(self, value: int):
        """The stream object an interface's stream value names (None: no such stream)."""
        return self.stream_of(self.runtime_handle(value))

    def runtime_handle(self, value: int) -> int:
        """An interface's stream value as this runtime's handle (CUDA takes 1 and 2 as they are; HIP's 1 is 0)."""
        return 0 if value == 1 and self.backend.kind != "cuda" else value

    def dlpack_stream(self, stream, capturing: bool):
        """How `__dlpack__(stream=...)` names the stream that will read an input: its handle, where CUDA
        spells the null stream 1 and DLPack reserves 0; None on the host; -1 (do not wait) while capturing."""
        if self.backend.kind == "host":
            return None
        if capturing:
            return -1
        handle = self.backend.stream_handle(stream)
        return handle if handle or self.backend.kind != "cuda" else 1

    # -- capture() -------------------------------------------------------------
    def begin(self, stream) -> None:
        self.backend.capture_begin(stream)
        self.capturing, self.kept, self.capture_source = stream, [], None

    def replay_target(self, captured):
        """A function that names the stream a replay of the capture just ended goes to with no stream=: the
        current stream of the library whose arrays the step took, for calls that follow it, else `captured`."""
        source, device = self.capture_source, self.library_device
        if not self.follow_library or source is None or device is None:
            return lambda: captured

        def current():
            handle = source.current_stream_here(device)
            return captured if handle is None else self.named(handle)
        return current

    def end(self, keep: bool):
        """(the executable graph, or None when not `keep`; what it must keep alive)."""
        stream, kept = self.capturing, self.kept
        self.capturing = self.kept = None
        return self.backend.capture_end(stream, keep=keep), kept

    def keep(self, objects) -> bool:
        """Inside a capture, `objects` live as long as the graph (True); outside, the caller keeps them."""
        if self.capturing is None:
            return False
        self.kept.extend(objects)
        return True
