"""Readiness words on the symmetric heap: one rank's stream tells another rank's stream that something is done,
with no kernel and no multiprocessor held while it waits.

A producer's stream raises a word in the consumer's copy of the heap (written after the producer's earlier
work, and after that work's writes are visible: the runtime fences the write); the consumer's stream waits on
the device until the word holds the value, then lowers it. Values are constants, never counters, so a captured
graph replays them as they are. Each word has one producer and one consumer, and a producer raises it again
only after the consumer said it is done with what the word covered (a second kind of word, raised the other
way), so a word is never raised twice before it is lowered. A raised word holds a count (count + 1), which the
consumer's wait must match: ranks that disagree on it (rows a rank, say) are named, not mixed.

GPUs wait without a bound; the host backend bounds each wait. Each wait marks a local "seen" word while a
stream stands at it, so when the host gives up on a call (pyhipa2a.inflight) it names the ranks the streams
are stuck on, and releases exactly those waits. The seen words lie in pinned host memory, which the host reads
with no stream: what the host queues on a stream of its own may sit behind the stuck wait (the driver may
serve several streams from one hardware queue), so the host never waits for such work without a bound.
"""
from __future__ import annotations

import time

import numpy as np

from .array import Pinned
from .bootstrap import poll
from .errors import A2ATimeoutError, ConfigMismatchError
from .runtime.base import WAIT, WRITE

WAITING, PASSED = 2, 1  # a wait's "seen" word: a stream stands at it; a stream went past it (0: never reached)


def marked_wait(word: int, value: int, seen: int, waiting: int = WAITING, passed: int = PASSED) -> tuple:
    """The stream operations of a wait marked in its "seen" word: mark it `waiting`, wait until `word` holds
    `value`, lower `word`, mark it `passed` (Backend.stream_word_ops: one batch where the runtime takes one)."""
    return (WRITE, seen, waiting), (WAIT, word, value), (WRITE, word, 0), (WRITE, seen, passed)


class Signals:
    """Words of `kinds` ([kind][peer] on every rank); `raised_at_start`: kinds whose words start raised (1)."""

    def __init__(self, heap, kinds: tuple[str, ...], raised_at_start: tuple[str, ...] = ()):
        self.heap, self.backend = heap, heap.backend
        self.rank, self.world = heap.rank, heap.world
        self._row = {kind: i for i, kind in enumerate(kinds)}
        shape = (len(kinds), self.world)
        self.words = heap.alloc(shape, np.uint32)
        start = np.zeros(shape, np.uint32)
        for kind in raised_at_start:
            start[self._row[kind]] = 1
        self.words.copy_from(start)  # (before the barrier that ends the owner's setup: peers write these)
        # In pinned host memory, which the host reads with no stream: the seen words, and a copy of the words
        self._pinned = Pinned(self.backend, (2, *shape), np.uint32)
        self._seen, self._copied = self._pinned.host
        self._seen_device = self._pinned.device
        self._copied_device = self._seen_device + self._seen.nbytes
        self._read = None  # the event of the host's reads of the words (made at the first)

    def _offset(self, kind: str, peer: int) -> int:
        return 4 * (self._row[kind] * self.world + peer)

    def raise_on(self, peer: int, kind: str, stream, count: int = 0) -> None:
        """After what `stream` queued so far, raise our word of `kind` in `peer`'s copy, holding `count`."""
        theirs = self.heap.translate(self.words.ptr + self._offset(kind, self.rank), peer)
        self.backend.stream_write_word(stream, theirs, count + 1)

    def wait(self, source: int, kind: str, stream, what: str, count: int = 0) -> None:
        """Queue on `stream`: wait until `source` raised its word of `kind` here with `count`, then lower it, marked
        in its "seen" word (marked_wait). `what` names what was awaited."""
        word, seen = self.words.ptr + self._offset(kind, source), self._seen_device + self._offset(kind, source)
        self.backend.stream_word_ops(stream, marked_wait(word, count + 1, seen), self.heap.timeout,
                                     lambda: self.stuck_error([(source, kind, count, what)], None))

    def waiting(self, awaited) -> list:
        """The (source, kind, ...) entries of `awaited` whose wait a stream stands at now (not those it has
        passed, nor those it has not reached)."""
        seen = self._seen.copy()
        stuck = {}
        for entry in awaited:
            if seen[self._row[entry[1]], entry[0]] == WAITING:
                stuck.setdefault((entry[0], entry[1]), entry)
        return list(stuck.values())

    def stuck_error(self, stuck, watch):
        """The error of waits `stuck` ((source, kind, count, what) entries) that never passed: a rank that
        raised another count disagrees (ConfigMismatchError), one that raised nothing never came (also where
        the words cannot be read on `watch` within a second)."""
        words = self._words_now(watch, min(1.0, self.heap.timeout))
        odd = [] if words is None else [
            (source, int(words[self._row[kind], source]) - 1, count, what)
            for source, kind, count, what in stuck if words[self._row[kind], source] not in (0, count + 1)]
        if odd:
            return ConfigMismatchError("; ".join(f"rank {source} sent {what} with count {theirs}, rank {self.rank} "
                                                 f"expects {count}" for source, theirs, count, what in odd)
                                       + " (ranks disagree)", ranks=tuple(sorted({e[0] for e in odd})))
        ranks = tuple(sorted({e[0] for e in stuck}))
        return A2ATimeoutError(f"rank {self.rank} timed out waiting for "
                               + "; ".join(f"{what} of rank {source}" for source, _, _, what in stuck)
                               + f": rank(s) {', '.join(map(str, ranks))} never arrived or are stuck", ranks=ranks)

    def force(self, stuck, watch) -> None:
        """Queue on `watch`: raise the words of `stuck` ((source, kind, count, ...) entries) here ourselves, so
        waits on a rank that will never raise them pass and the stream drains (the caller poisons what it wrote).
        Returns at once: the writes land when `watch` gets to them."""
        for source, kind, count, *_ in stuck:
            self.backend.stream_write_word(watch, self.words.ptr + self._offset(kind, source), count + 1)

    def _words_now(self, watch, within: float):
        """The words as they are now, copied on `watch` (a stream that waits for nothing) into pinned host memory;
        None where the copy does not land within `within` seconds (it may sit behind a stuck wait)."""
        if self._read is None:
            self._read = self.backend.event_create()
        self.backend.copy_device(self._copied_device, self.words.ptr, self.words.nbytes, watch)
        self.backend.event_record(self._read, watch)
        if not poll(lambda: self.backend.event_done(self._read), time.monotonic() + within):
            return None
        return self._copied.copy()

    def close(self, streams_drained: bool = True) -> None:
        """Frees the pinned memory where the streams drained, and keeps it otherwise: a stream still stuck would
        write its seen words (and a late copy of the words) there after."""
        if self._read is not None:
            self.backend.event_destroy(self._read)
            self._read = None
        if streams_drained:
            self._pinned.free()
        else:
            self._pinned.keep()
