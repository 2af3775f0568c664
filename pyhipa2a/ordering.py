"""The order of one AllToAll's calls across streams, and after their inputs' producers.

Calls of one object hand the device's epoch and their buffers on in queue
order, so a call on another stream than the last call's must wait for it;
and a device input must be read only after the writes its producer queued.
Both come down to "work on stream B waits for what is queued on stream A
now": one event recorded on A and waited for on B, and nothing when A is B.
No waits while capturing (a capture may not wait for work outside it): the
owner checks that, and dlpack_stream is told.
"""
from __future__ import annotations


class StreamOrder:
    def __init__(self, backend, default_stream):
        self.backend, self.default = backend, default_stream
        self.last = None     # the stream of the last call (or graph launch) queued; None: nothing pending
        self._producers_waited = []  # (producer, stream) pairs the coming call waits for already
        # Streams known by handle, one object each (the GPU backends make a new wrapper at every
        # stream_from_handle; callers compare and cache by the object): our own stream's handle is it.
        self._handles: dict = {backend.stream_handle(default_stream): default_stream}

    def _same(self, a, b) -> bool:
        return self.backend.stream_handle(a) == self.backend.stream_handle(b)

    def wait_for(self, other, stream) -> None:
        """Work queued on `stream` from now on waits for what is queued on `other` now."""
        self.backend.stream_wait_stream(stream, other)

    def follow(self, stream) -> None:
        """Queue the coming call on `stream` behind the last one. It becomes the last one only once
        it is queued (`queued`): a call refused after this is not. A call starts here: its inputs'
        producers are waited for afresh (wait_for_producer)."""
        if self._producers_waited:
            self._producers_waited.clear()
        if self.last is not None and self.last is not stream:  # (the same object: nothing to order)
            self.wait_for(self.last, stream)

    def queued(self, stream) -> None:
        """A call (or graph launch) went to `stream`: the next call on another stream waits for it."""
        self.last = stream

    def latest(self):
        """The stream to synchronize for every call so far: the last call's (every earlier call is
        queued before it), else the object's own."""
        return self.last if self.last is not None else self.default

    def synchronized(self, stream) -> None:
        """The host waited for `stream`: when that was the last call's, nothing is left to wait for."""
        if self.last is not None and self._same(stream, self.last):
            self.last = None

    def wait_for_producer(self, producer, stream) -> None:
        """Queue the use of an input on `stream` after its producer's writes: `producer` is one of our
        streams (a DeviceArray's) or a foreign stream handle (an int, as a __cuda_array_interface__ or a
        producer's probe names it).
        Once per producer and stream in a call: its inputs usually share one producer, and nothing can
        be queued on it between them."""
        for p, s in self._producers_waited:
            if s is stream and (p is producer or p == producer):
                return
        self._producers_waited.append((producer, stream))
        if self.same_stream(producer, stream):  # the call's own stream: in order already
            return
        if isinstance(producer, int):
            producer = self.stream_of(self.runtime_handle(producer))
        self.wait_for(producer, stream)

    def stream_of(self, handle: int):
        """The stream object of a runtime stream handle, the same one at every call (None where the
        backend knows no such stream)."""
        stream = self._handles.get(handle)
        if stream is None:
            stream = self.backend.stream_from_handle(handle)
            if stream is not None:
                self._handles[handle] = stream
        return stream

    def same_stream(self, producer, stream) -> bool:
        """Whether `producer` (one of our streams, or a __cuda_array_interface__ handle) is `stream`."""
        if producer is stream:
            return True
        return isinstance(producer, int) and self.runtime_handle(producer) == self.backend.stream_handle(stream)

    def runtime_handle(self, value: int) -> int:
        """A __cuda_array_interface__ stream value as this runtime's handle: CUDA's driver takes 1
        (legacy default) and 2 (per-thread) as they are; HIP's null stream is 0."""
        return 0 if value == 1 and self.backend.kind != "cuda" else value

    def dlpack_stream(self, stream, capturing: bool):
        """How `__dlpack__(stream=...)` names the stream that will read an input: its handle, where
        CUDA spells the null stream 1 (legacy default) and DLPack reserves 0; None on the host; -1
        (do not wait) while capturing, since a capture may not wait for work outside it."""
        if self.backend.kind == "host":
            return None
        if capturing:
            return -1
        handle = self.backend.stream_handle(stream)
        return handle if handle or self.backend.kind != "cuda" else 1
