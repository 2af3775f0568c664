"""dispatch(groups=G): the caller's expert GEMMs overlap the exchange, with no multiprocessor spent waiting
(docs/PREFILL.md: what is ordered where, and how the host bounds the waits).

Dispatch raises a readiness word per group once every row of it is written; `wait(g, stream)` makes the caller's
stream wait for it on the device, and `done(g, stream)` says, after the caller's GEMM of the group, that its
expert_y rows are written. Combine then comes in parts on its own stream, part g once groups 0..g are done, the
reduce last. The words are constants (1 raised, 0 lowered), each with one raiser and one lowerer, and combine
refuses to start before done() was queued for every group, so no word is left raised for the next call. On GPUs
the stream waits have no bound of their own: the host bounds combine's waits on the done words (CombineBound),
in capture() at each launch of the graph (`replayed`). Another library's capture, which launches with no word
to us, is refused.
"""
from __future__ import annotations

import threading
import time
import weakref

import numpy as np

from .array import Pinned
from .arguments import is_int
from .errors import STATUS_TIMEOUT, WAIT_GROUP_DONE, A2AError, A2ATimeoutError, status_error
from .kernels import MAX_GROUPS, REDUCE_ONLY
from .runtime.base import WAIT, WRITE
from .signals import PASSED, WAITING, marked_wait
from .watchdog import Watchdog


# The offsets come within microseconds of the launch on a GPU that is not busy: group_rows polls without sleeping
# this long first (a sleep costs tens of microseconds), then yields.
SPIN_SECONDS = 1e-3


class Groups:
    """The readiness words of one object's grouped dispatches, and the pending call's groups. A call's state is
    `count` (G of the pending dispatch, 0: none) and `finished` (the groups done() queued), set by the calls'
    records (and their plans) alike."""

    __slots__ = ("backend", "rank", "local_experts", "timeout", "_ready", "_host_offsets", "_health",
                 "_contiguous", "_bound", "_close_bound", "count", "finished", "ticket", "captured", "__weakref__")

    def __init__(self, backend, rank: int, config, buffers, health):
        self.backend, self.rank, self.local_experts, self.timeout = backend, rank, config.local_experts, config.timeout
        self._host_offsets, self._health, self._contiguous = buffers.host_offsets, health, config.contiguous
        self._bound = CombineBound(backend, rank, config.timeout, buffers.status, health.watches_streams)
        health.bound_waits(self._bound.settle)
        # uint32 [MAX_GROUPS]: in the heap (the dispatch kernel raises them); the done words are the bound's
        self._ready = buffers["group_ready"].ptr
        # (stopped at exit too, while the runtime still answers: its watchdog asks the driver)
        self._close_bound = weakref.finalize(self, self._bound.close)
        self.count, self.finished = 0, frozenset()
        self.ticket = 0  # the last grouped dispatch's (its offsets' tag for the host); counts up from 1
        self.captured = None  # what the grouped combine a capture is recording needs at each launch (recorded())

    def checked_count(self, groups, weights, joined: bool) -> int:
        """dispatch()'s `groups` as a count (0: none), or the error a caller should see; `joined`: the call is
        being recorded into another library's capture."""
        if groups is None:
            return 0
        if not is_int(groups):
            raise TypeError(f"groups must be an int, not {type(groups).__name__}")
        limit = min(self.local_experts, MAX_GROUPS)
        if not 1 <= groups <= limit:
            raise ValueError(f"groups must be in [1, {limit}] (at most one a local expert, and {MAX_GROUPS}); "
                             f"got {groups}")
        if weights is None:
            raise TypeError("dispatch(groups=) needs the gate's weights here (weights=): combine's parts send none")
        if joined:
            raise A2AError("dispatch(groups=) cannot be recorded into another library's capture: its combine's "
                           "waits for your streams are bounded from the host at each launch; record it with capture()")
        refused = self.backend.stream_waits_refused()
        if refused:
            raise A2AError(f"dispatch(groups=): {refused}")
        return int(groups)

    def next_ticket(self) -> int:
        """The ticket of a grouped dispatch about to launch (never 0, which sends no offsets to the host)."""
        self.ticket = self.ticket % 0xFFFFFFFF + 1
        return self.ticket

    def rows(self, group: int, capturing: bool) -> range:
        """Where group `group`'s rows lie in a contiguous expert_x (from its first expert's offset to past its last
        expert's rounded rows): waits on the host until the dispatch has counted every expert's rows (not until
        they land), bounded by the timeout; the call's reported error if it failed."""
        self._check(group, "group_rows", done_too=True)
        if capturing:
            raise A2AError("group_rows() inside capture(): a replay's rows are known on the device only "
                           "(d.expert_offsets[l] .. d.expert_offsets[l + 1] for each expert l of group_experts())")
        if not self._contiguous:
            raise A2AError("group_rows() is for row_layout='contiguous' (otherwise expert l's rows start at row "
                           "l * W * max_num_tokens of expert_x [L, W * M, H])")
        experts = self.experts(group)
        start = time.monotonic()
        deadline, pause = start + self.timeout, 0.0
        want = np.uint64(self.ticket)
        while True:
            words = self._host_offsets[[experts.start, experts.stop]]
            self._health.check()  # (a call whose rows overflowed R placed its offsets all the same)
            if ((words >> np.uint64(32)) == want).all():
                return range(int(words[0] & np.uint64(0xFFFFFFFF)), int(words[1] & np.uint64(0xFFFFFFFF)))
            if time.monotonic() > deadline:
                raise A2ATimeoutError(f"rank {self.rank}: group_rows({group}) waited {self.timeout} s for the "
                                      f"dispatch to count its rows (it never ran, or is stuck)", ranks=(self.rank,))
            if time.monotonic() - start > SPIN_SECONDS:
                time.sleep(pause)
                pause = min(2 * pause + 1e-6, 1e-4)

    def experts(self, group: int) -> range:
        """The local experts of group `group` of the pending dispatch (l with l * G // L == group)."""
        self._check(group, "group_experts", done_too=True)
        L, G = self.local_experts, self.count
        return range(-(-group * L // G), -(-(group + 1) * L // G))

    def wait(self, group: int, stream, refused: str | None) -> None:
        """Work queued on `stream` from now on waits until group `group`'s rows are in. `refused`: why `stream`
        cannot take the wait (a graph that is not the pending dispatch's), or None."""
        self._check(group, "wait_group", refused=refused)
        self.backend.stream_wait_word(stream, self._ready + 4 * group, 1, self.timeout,
                                      lambda: self._never_ready(group))

    def done(self, group: int, stream, refused: str | None) -> None:
        """After the work queued on `stream` so far, group `group`'s expert_y rows are written (lowering its
        ready word after a wait of its own, so a group nobody waited for is lowered as well)."""
        self._check(group, "group_done", refused=refused)
        ready = self._ready + 4 * group
        self.backend.stream_word_ops(stream, ((WAIT, ready, 1), (WRITE, ready, 0), self._bound.done_op(group)),
                                     self.timeout, lambda: self._never_ready(group))
        self.finished = self.finished | {group}

    @property
    def all_done(self) -> bool:
        """Whether done() was queued for every group of the pending dispatch (none: True), as a plan of a
        grouped combine needs."""
        return len(self.finished) == self.count

    def ready_to_combine(self) -> int:
        """The pending dispatch's G (0: not grouped), once done() was queued for every group; else the error."""
        if not self.all_done:
            left = sorted(set(range(self.count)) - self.finished)
            raise A2AError(f"combine() after dispatch(groups={self.count}) needs group_done() of every group "
                           f"first; groups {left} are not done")
        return self.count

    def queue_combine(self, stream, launch, capturing: bool) -> None:
        """Combine's parts on `stream`, `launch(phase)` each: phase g + 1 (sending group g's tokens) once group g
        is done, then the reduce; the host's bound on the waits from before the reduce's launch on (which may
        wait for the stream on the host: across nodes, the MPI engine), or, `capturing`, from each launch of
        the graph on (replayed)."""
        self._bound.begin(self.count)
        for group in range(self.count):
            self._bound.wait(stream, group, lambda g=group: self._never_done(g))
            launch(group + 1)
        if capturing:
            self.captured = self._bound.begun()
        else:
            self._bound.arm(stream)
        launch(REDUCE_ONLY)

    def recorded(self, kept: bool) -> tuple | None:
        """The end of a capture(): what the graph's launches need to bound the grouped combine it recorded last
        (None: it recorded none). A capture given up (not `kept`) leaves no pending groups either."""
        captured, self.captured = self.captured, None
        if not kept:
            self.count, self.finished = 0, frozenset()
            return None
        return captured

    def replayed(self, stream, captured: tuple) -> None:
        """A graph whose step held a grouped combine (`captured`: what queue_combine noted) was launched on
        `stream`: bound its waits as an eager combine's."""
        self._bound.arm(stream, captured)

    def close(self) -> None:
        self._close_bound()

    def _check(self, group: int, what: str, done_too: bool = False, refused: str | None = None) -> None:
        if not self.count:
            raise A2AError(f"{what}() needs a pending dispatch(groups=...)")
        if refused:
            raise A2AError(f"{what}(): {refused}")
        if not is_int(group) or not 0 <= group < self.count:
            raise ValueError(f"{what}(): the group must be an int in [0, {self.count}); got {group!r}")
        if group in self.finished and not done_too:
            raise A2AError(f"{what}(): group {group} is done already (group_done was queued for it)")

    def _never_ready(self, group: int) -> A2ATimeoutError:
        return A2ATimeoutError(f"rank {self.rank}: group {group}'s rows were never ready (its dispatch never ran or "
                               f"never finished)", ranks=(self.rank,))

    def _never_done(self, group: int) -> A2ATimeoutError:
        return A2ATimeoutError(f"rank {self.rank}: combine waited for group_done({group}), whose stream never got "
                               f"there", ranks=(self.rank,))


class CombineBound:
    """The host's bound on a grouped combine's waits for group_done, which a GPU waits for without one: a caller's
    stream that never reaches group_done would hold combine's stream, and every wait behind it, forever.

    The done words and, beside them, a "seen" word a group lie in pinned host memory of its own. Combine's stream
    marks each wait in its seen word (waiting, then passed, tagged with the combine's number). A watchdog gives up
    on the call once a look finds the seen words as the last one did, a timeout before: it writes the timeout into
    the host's mirror of the status words (the parts that start after send and reduce nothing; the caller's next
    call or synchronize() raises it), then raises the done words of every wait not passed, so the stream drains.
    With `streams_watched` (across nodes: NcclEngine.settle bounds what holds a stream), a stream held by no
    group_done is left to that watch. All of it with plain stores, no stream: work queued on any stream may sit
    behind the stuck one (the driver may serve several streams from one hardware queue). (The stores assume a
    host that keeps their order, as x86 does.)"""

    def __init__(self, backend, rank: int, timeout: float, host_status, streams_watched: bool = False):
        self.backend, self.rank, self.timeout, self._host_status = backend, rank, timeout, host_status
        self._streams_watched = streams_watched
        self._pinned = Pinned(backend, (2, MAX_GROUPS), np.uint32)
        self._words = self._pinned.host  # [done, seen][group]
        self.done_words, self._seen = self._pinned.device, self._pinned.device + 4 * MAX_GROUPS  # (for the streams)
        self._event = self._watchdog = None  # made at the first grouped combine
        self._count = self._tag = 0  # the groups and the number of the combine begun last
        self._pending = False  # a combine armed and not yet seen finished
        self._last = None  # the seen words at the watchdog's last look at the pending combine (None: no look yet)
        self.gave_up = None  # when the host gave up on the pending combine (time.monotonic()), or None
        self._left_to_watch = False  # the pending combine is held by no group_done: NcclEngine.settle bounds it
        self._stopped_ahead = False  # the watchdog stopped, leaving a combine held ahead of its waits to that watch
        self._lock = threading.Lock()  # (the watchdog's thread looks)
        self._closed = False

    def marks(self) -> tuple[int, int]:
        """The seen words' values (waiting, passed) of the combine begun last."""
        return self._tag << 2 | WAITING, self._tag << 2 | PASSED

    def begin(self, count: int) -> None:
        """A combine of `count` groups is about to be queued (its waits by wait(), then arm())."""
        with self._lock:
            self._count, self._tag = count, self._tag % ((1 << 30) - 1) + 1

    def begun(self) -> tuple[int, int]:
        """(groups, tag) of the combine begun last: what a graph that recorded it arms again at each launch."""
        return self._count, self._tag

    def done_op(self, group: int) -> tuple:
        """The stream operation that says group `group` is done (group_done), after the stream's work before it."""
        return WRITE, self.done_words + 4 * group, 1

    def wait(self, stream, group: int, timed_out) -> None:
        """Queue on `stream`: wait until group `group` is done, then lower its word; marked in its seen word."""
        word, seen = self.done_words + 4 * group, self._seen + 4 * group
        self.backend.stream_word_ops(stream, marked_wait(word, 1, seen, *self.marks()), self.timeout, timed_out)

    def arm(self, stream, begun: tuple[int, int] | None = None) -> None:
        """The combine begun last (or `begun`, a graph's: its groups and tag, whose marks the graph writes) is
        queued on `stream`: bound it. Behind a combine still pending, the watchdog's next look stays when it
        was (a new call never puts off the bound of one before it), but one that had stopped, leaving the combine
        before to the streams' watch ahead of its waits, starts again. One that stopped after a look found every
        wait passed stays stopped (a graph writes the same marks at every replay, so looks started again would,
        over a long run of replays, take two for a stream standing still)."""
        backend = self.backend
        if backend.stream_done(stream):  # (the host backend: its waits ran, bounded, as they were queued)
            return
        with self._lock:
            if begun is not None:
                self._count, self._tag = begun
            if self._watchdog is None:
                self._event = backend.event_create()
                self._watchdog = Watchdog(backend, self._event, self._look)
            fresh = self.drained()
            backend.event_record(self._event, stream)
            self._pending = True
            restart = fresh or self._stopped_ahead
            if restart:
                self._last, self._left_to_watch, self._stopped_ahead = None, False, False
            if fresh:
                self.gave_up = None
        if restart:
            self._watchdog.arm(time.monotonic() + self.timeout)

    def settle(self) -> None:
        """Before the host waits on a stream (synchronize, reading an output), while a grouped combine is pending:
        poll its event. Once the host gave up on it, a stream that has not drained a timeout later (it may still
        sit behind a stuck one) raises the call's error here, instead of a wait that might never return. A combine
        left to the streams' watch returns, for the host wait's next bound (Health.settle: NcclEngine.settle)."""
        pause = 1e-6
        while self._pending and not self._closed and not self._left_to_watch:
            if self.backend.event_done(self._event):  # (a driver error here is the caller's to see)
                self._pending = False
                return
            gave_up = self.gave_up
            if gave_up is not None and time.monotonic() > gave_up + self.timeout:
                error = status_error(self._host_status.copy(), self.rank, "AllToAll")
                if error is not None:
                    raise error
            time.sleep(pause)
            pause = min(2 * pause, 5e-5)  # (a combine that finishes is seen within 50 us)

    def drained(self) -> bool:
        """Whether no grouped combine may still be on a stream (its words may then be freed)."""
        return not self._pending or self._finished()

    def _look(self) -> None:
        """The watchdog's: give up on the pending combine where its stream made no progress since the last look.
        It looks again a timeout later where the stream moved; it stops where it gave up, and where a look finds
        no group holding the stream (every wait passed, or the combine is left to the streams' watch)."""
        with self._lock:
            if self._closed or self._finished():
                return
            seen = self._words[1].copy()
            if self._last is None or not np.array_equal(seen, self._last):
                self._last = seen
                self._watchdog.arm(time.monotonic() + self.timeout)
                return
            self._give_up(seen)

    def _give_up(self, seen) -> None:
        done = self._words[0]
        waiting, passed = self.marks()
        mine = seen[:self._count]
        standing = (seen & 3) == WAITING  # (this combine's, or one's before it still pending)
        not_passed = np.flatnonzero(mine != passed)
        # The group named: the one the stream stands at, else (still behind other stuck work, say) the first not
        # done. (A group_done that itself waits behind an exchange the watch bounds is still named: the bound
        # cannot tell it from one the caller's stream never reached.)
        choices = [np.flatnonzero(mine == waiting), np.flatnonzero(standing),
                   not_passed[done[not_passed] == 0]]
        if not self._streams_watched:  # (no group_done holds it, but nothing else would bound it: name one)
            choices.append(not_passed)
        group = next((int(choice[0]) for choice in choices if choice.size), None)
        if group is None:  # every wait passed (the kernels bound theirs), or what holds the stream is the watch's
            self._left_to_watch, self._stopped_ahead = self._streams_watched, not_passed.size > 0
            return
        status = self._host_status
        if not status[0]:  # (an error already reported stays the one the caller sees)
            status[1:] = (self.rank, WAIT_GROUP_DONE, group)
            status[0] = STATUS_TIMEOUT  # (last: the parts read this word)
        done[standing] = 1
        done[:self._count][mine != passed] = 1
        self.gave_up = time.monotonic()

    def _finished(self) -> bool:
        try:
            return self.backend.event_done(self._event)
        except Exception:  # (a driver that fails now: the words are released all the same, as plain stores;
            return False   # the caller's next wait sees the driver's error)

    def close(self) -> None:
        """Stops the watchdog. The words are freed where no combine may still use them, and kept otherwise (a
        stream that never drained would write them after)."""
        with self._lock:
            self._closed = True
            watchdog, self._watchdog = self._watchdog, None
        if watchdog is not None:
            watchdog.close()
        if not self.drained():
            self._pinned.keep()
            return
        if self._event is not None:
            self.backend.event_destroy(self._event)
        self._pinned.free()
