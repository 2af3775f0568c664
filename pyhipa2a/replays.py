"""Replays: a call that comes back alike is launched as one graph instead of queued step by step.

A CollectiveMatmul call queues some twenty steps (GEMMs, copies, forks and joins, readiness words), each a
driver call from Python: about 150 us of host time at two ranks, more than the device needs for a 2048-row
GEMM + reduce-scatter, and about 60 us before its first GEMM reaches the device. What a call queues depends
only on its key (the operation, its pointers and row counts), so the second time a key comes, the call is
recorded into a graph on a stream of our own (the caller's may be another library's) and the graph
is launched on the call's stream, then and at every later call with that key: one driver call. A graph
replays the words' values as recorded, which is why the words hold constants (pyhipa2a.signals).
"""
from __future__ import annotations

GRAPHS_KEPT = 8  # keys recorded per object; the least recently used graph goes first


class Replays:
    def __init__(self, backend, origin, kept: int = GRAPHS_KEPT):
        self.backend, self._origin, self._kept = backend, origin, kept
        self._graphs: dict = {}  # key -> (executable graph, what queue() returned), least recent first
        self._seen: dict = {}    # keys of the latest calls queued step by step (a dict as an ordered set)
        self.refused = None      # why a recording failed: calls are queued step by step from then on

    def queue(self, key, s, queue):
        """What `queue(stream)` returns, having queued the call on stream `s`: by replaying the graph kept
        for `key`; by recording one, when `key` came before (among the latest calls); else (and for key None,
        a call that must not be recorded) by calling queue(s)."""
        if key is None or self.refused is not None:
            return queue(s)
        if key not in self._graphs:
            if self._seen.pop(key, None) is None:
                self._seen[key] = True
                while len(self._seen) > 2 * self._kept:
                    del self._seen[next(iter(self._seen))]
                return queue(s)
            kept = self._record(queue)
            if kept is None:
                return queue(s)
            while len(self._graphs) >= self._kept:
                self.backend.graph_destroy(self._graphs.pop(next(iter(self._graphs)))[0])
            self._graphs[key] = kept
        return self.launch(key, s)

    def holds(self, key) -> bool:
        """Whether a graph is kept for `key` (a call with it is replayed)."""
        return key in self._graphs

    def launch(self, key, s):
        """Launch the graph kept for `key` on stream `s`; what its recording's queue() returned."""
        kept = self._graphs.pop(key)
        self._graphs[key] = kept  # (last: the most recently used)
        self.backend.graph_launch(kept[0], s)
        return kept[1]

    def _record(self, queue):
        """(graph, what queue returned), or None where recording failed (refused, with why)."""
        origin = self._origin
        self.backend.capture_begin(origin)
        try:
            result = queue(origin)
        except Exception as e:  # (a step the runtime cannot record, or an error queuing would raise anyway)
            self.refused = f"{type(e).__name__}: {e}"
            try:
                self.backend.capture_end(origin, keep=False)
            except Exception:
                pass  # (the capture was invalidated by the step that failed: nothing of it is kept)
            return None
        try:
            return self.backend.capture_end(origin), result
        except Exception as e:
            self.refused = f"{type(e).__name__}: {e}"
            return None

    def close(self) -> None:
        for graph, _ in self._graphs.values():
            self.backend.graph_destroy(graph)
        self._graphs, self._seen = {}, {}
