"""One CollectiveMatmul call's path, the same for both operations: its plan where the call repeats the last one
that was replayed (pyhipa2a.repeat), else the full path: checks, the call's stream, its arrays taken, its work
queued or replayed (pyhipa2a.replays), noted in flight (pyhipa2a.inflight), and remembered for a plan.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

from .errors import A2AError, RuntimeFailure
from .repeat import MISSED, Record, plan_or_none, run
from .runtime import Launcher


@dataclass(frozen=True)
class Shared:
    """What CollectiveMatmul's operations share, made once by it."""
    backend: object
    heap: object      # pyhipa2a.heap.SymmetricHeap
    signals: object   # pyhipa2a.signals.Signals
    streams: object   # pyhipa2a.streams.Streams: the object's stream and the order of its calls
    arrays: object    # pyhipa2a.collective_arrays.CallerArrays
    flight: object    # pyhipa2a.inflight.InFlight
    replays: object   # pyhipa2a.replays.Replays
    copies: object    # pyhipa2a.collective_ops.CopyStreams
    blas: object      # the vendor's BLAS, or the exception that says why there is none
    world: int
    rank: int
    max_rows: int
    shard_rows: int   # the most rows a rank holds: slots lie this many rows apart
    k: int
    n: int
    dtype: object
    pieces: int

    def vendor(self):
        """The vendor's BLAS (a caller with gemm= of their own may never need it)."""
        if isinstance(self.blas, Exception):
            raise RuntimeFailure(f"the vendor's GEMM is unavailable: {self.blas}") from self.blas
        return self.blas


@dataclass
class Prepared:
    """What an operation made of a call before its work is queued (or replayed)."""
    result: object       # what the call returns
    rows: int            # the rows that name the call (a rank's)
    key: tuple | None    # what its work depends on (pyhipa2a.replays); None: never replayed (gemm= given)
    queue: object        # queue(stream) -> the waits it queued ((source, kind, count, what) each)
    outputs: tuple       # (pointer, bytes) it writes: poisoned if it fails once its words were touched


def failure(e: BaseException) -> str:
    """Why a call that raised `e` once its words were touched leaves the object refusing calls."""
    return f"{type(e).__name__}: {e}"


def lead_rows(lead, name: str, least: int, most: int, per: str) -> int:
    """The rows of a call's first array, a 2-D one of `least` to `most` rows (else a clear error)."""
    shape = getattr(lead, "shape", None)
    if shape is None or len(shape) != 2:
        raise TypeError(f"{name} must be a 2-D array, not {type(lead).__name__}"
                        + ("" if shape is None else f" of shape {tuple(shape)}"))
    rows = int(shape[0])
    if not least <= rows <= most:
        raise ValueError(f"{name} has {rows} rows: this CollectiveMatmul takes {least} to {most}{per}")
    return rows


class Operation:
    """A call of one operation: `op(*inputs, gemm, stream)`. A subclass names itself and its words, checks its
    first array (`check(inputs)`) and makes the call's work (`prepare(take, s, *inputs, gemm)` -> Prepared)."""
    name = ""
    FREED = ""        # the word a receiver raises once done with its slot of ours (raised at the start)
    WORD = ""         # the prefix of each piece's readiness word's kind

    @classmethod
    def words(cls, pieces: int) -> tuple:
        """(kind, what a timeout calls it) of each piece's readiness word."""
        return tuple((f"{cls.WORD}{j}", f"{cls.name} {cls.WORD}, piece {j} (count: rows a rank)")
                     for j in range(pieces))

    @classmethod
    def kinds(cls, pieces: int) -> tuple:
        """Every kind of word the operation uses."""
        return (cls.FREED,) + tuple(kind for kind, _ in cls.words(pieces))

    def __init__(self, shared: Shared):
        self.shared = shared
        self.piece_words = self.words(shared.pieces)
        self._last = None  # the last call's Record
        self._plan = None  # (plan, key of the graph it launches), once a replayed call repeats the last

    def __call__(self, *args):
        planned = self._plan
        if planned is not None and self.shared.replays.holds(planned[1]):  # (a recording may evict its graph)
            result = run(planned[0], *args)
            if result is not MISSED:
                return result
        return self._full(args)

    def _full(self, args: tuple):
        shared, streams = self.shared, self.shared.streams
        *inputs, gemm, stream = args
        self._plan = None  # (a call that fails leaves none)
        if shared.heap.closed:
            raise A2AError("CollectiveMatmul is closed")
        shared.flight.refuse_if_failed(self.name)
        self.check(inputs)
        shared.backend.activate()
        s, lead = streams.current(inputs) if stream is None else (streams.given(stream), None)
        capturing = streams.captured_elsewhere(s)
        if capturing:  # (another library's capture: our launches on s join it as nodes of their own)
            shared.backend.capture_join(s)
        else:
            streams.follow(s)  # after the last call on another stream: our buffers are reused in its order
        try:
            arrays: list = []
            call = self.prepare(shared.arrays.taker(s, capturing, arrays), s, *inputs, gemm)
            try:
                awaited = call.queue(s) if capturing else shared.replays.queue(call.key, s, call.queue)
            except BaseException as e:  # (a timeout where the host backend waits, or anything once words were touched)
                shared.flight.failed(s, call.outputs, failure(e))
                raise
        finally:
            if capturing:
                shared.backend.capture_leave(s)
        if not capturing:  # (else nothing ran: a replay of the graph is the graph's caller's to wait for)
            streams.queued(s)
            shared.flight.queued(s, awaited, call.outputs)
            noted = functools.partial(shared.flight.queued, s, awaited, call.outputs)  # (a plan's launch notes it too)
            self._remember(call, Record(args, (None,) * len(args), s, lead, tuple(inputs), tuple(arrays), call.rows,
                                        call.result, (noted,), ((streams, "last", s),)))
        return call.result

    def _remember(self, call: Prepared, record: Record) -> None:
        """Note the call just queued; where it was replayed and repeats the last call with the same arguments,
        make its plan: the checks that must still hold, then the graph's launch, in one step. A plan only speeds
        repeats up: one that cannot be made warns and never fails the call."""
        if call.key is None:
            return
        shared, key = self.shared, call.key
        last, self._last = self._last, record
        if not (shared.replays.holds(key) and record.same(last)):
            return

        def launch(stream) -> None:
            try:
                shared.replays.launch(key, stream)
            except BaseException as e:
                shared.flight.failed(stream, call.outputs, failure(e))
                raise

        def drop() -> None:
            self._plan = None

        conditions = ((shared.heap, "closed", False), (shared.flight, "broken", None),
                      (shared.flight, "unreported", None))
        plan = plan_or_none(record, conditions, shared.streams, shared.backend, 0, lambda: Launcher(launch), drop)
        if plan is not None:
            self._plan = (plan, key)

    def close(self) -> None:
        """Drop the last call and the plan (the object closes)."""
        self._last = self._plan = None
