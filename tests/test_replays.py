"""pyhipa2a.replays on the host backend: a call queued step by step, recorded when its key comes back, replayed
from then on (reading what its pointers hold at each launch), the least recently used graph dropped first, and
a call that cannot be recorded queued step by step ever after."""
from __future__ import annotations

import numpy as np
import pytest

from pyhipa2a.replays import Replays
from pyhipa2a.runtime.host import HostBackend


@pytest.fixture
def host():
    backend = HostBackend()
    yield backend
    backend.close()


class Copies:
    """A call that copies WORDS uint32 from src to dst, counting how often it was queued step by step."""
    WORDS = 4

    def __init__(self, backend):
        self.backend = backend
        self.src, self.dst = backend.malloc_ipc(4 * self.WORDS), backend.malloc_ipc(4 * self.WORDS)
        self.queued = 0

    def queue(self, stream):
        self.queued += 1
        self.backend.copy_device(self.dst, self.src, 4 * self.WORDS, stream)
        return ["what the call awaited"]

    def check(self, value: int) -> None:
        """Fill src with `value` now; after the caller's call, dst must hold it."""
        self.backend.copy_to_device(self.src, np.full(self.WORDS, value, np.uint32))
        self.backend.copy_to_device(self.dst, np.zeros(self.WORDS, np.uint32))

    def holds(self) -> int:
        got = np.empty(self.WORDS, np.uint32)
        self.backend.copy_to_host(got, self.dst)
        assert (got == got[0]).all(), got
        return int(got[0])


def test_a_key_that_comes_back_is_recorded_then_replayed(host):
    replays, call, s = Replays(host, host.stream_create()), Copies(host), host.stream_create()
    for turn, queued_by_then in enumerate([1, 2, 2, 2]):  # step by step, recorded (queued once), replayed
        call.check(10 + turn)
        assert replays.queue(("copy", call.src), s, call.queue) == ["what the call awaited"]
        host.stream_synchronize(s)
        assert call.holds() == 10 + turn, f"turn {turn}"
        assert call.queued == queued_by_then, f"turn {turn}"
    call.check(99)
    replays.queue(None, s, call.queue)  # (a key of None is never recorded)
    assert call.holds() == 99 and call.queued == 3
    replays.close()


def test_least_recently_used_graph_goes_first(host, monkeypatch):
    destroyed = []
    monkeypatch.setattr(host, "graph_destroy", lambda graph: destroyed.append(graph))
    replays, s = Replays(host, host.stream_create(), kept=2), host.stream_create()
    calls = {key: Copies(host) for key in "abc"}
    for key in "ab" * 2 + "a":  # a and b recorded, a used last
        replays.queue(key, s, calls[key].queue)
    assert not destroyed
    for _ in range(2):  # c's recording drops b's graph, not a's
        replays.queue("c", s, calls["c"].queue)
    assert len(destroyed) == 1
    queued = calls["a"].queued
    replays.queue("a", s, calls["a"].queue)
    assert calls["a"].queued == queued  # (still replayed)
    calls["b"].check(7)
    replays.queue("b", s, calls["b"].queue)
    assert calls["b"].holds() == 7 and calls["b"].queued == 3  # (its graph dropped: queued step by step again)


def test_a_call_that_cannot_be_recorded_is_queued_step_by_step(host):
    replays, s = Replays(host, host.stream_create()), host.stream_create()
    call, recording = Copies(host), []

    def queue(stream):
        if host.stream_capturing(stream):
            recording.append(stream)
            raise RuntimeError("not recordable")
        return call.queue(stream)
    for turn in range(3):
        call.check(turn + 1)
        replays.queue("k", s, queue)
        assert call.holds() == turn + 1
    assert len(recording) == 1 and call.queued == 3
    assert replays.refused == "RuntimeError: not recordable"
    assert not host.stream_capturing(recording[0])  # (the failed recording was ended)


def test_streams_forked_from_a_forked_stream_leave_the_capture_at_its_end(host):
    # (as CUDA's capture: a stream that waited for a stream in the capture joined it, however far from its origin;
    # when the capture ends every one of them runs its work at once again, outside the graph)
    origin, first, second = host.stream_create(), host.stream_create(), host.stream_create()
    ran = []
    host.capture_begin(origin)
    host.stream_wait_stream(first, origin, within_capture=True)
    host.stream_wait_stream(second, first, within_capture=True)
    host.enqueue(second, lambda: ran.append("in the graph"))
    host.stream_wait_stream(origin, second, within_capture=True)
    graph = host.capture_end(origin)
    assert ran == [] and not any(map(host.stream_capturing, (origin, first, second)))
    host.enqueue(second, lambda: ran.append("at once"))
    assert ran == ["at once"]
    host.graph_launch(graph, origin)
    assert ran == ["at once", "in the graph"]
