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
are stuck on, and releases exactly those waits.
"""
from __future__ import annotations

import numpy as np

from .errors import A2ATimeoutError, ConfigMismatchError

WAITING, PASSED = 2, 1  # a wait's "seen" word: a stream stands at it; a stream went past it (0: never reached)


class Signals:
    """Words of `kinds` ([kind][peer] on every rank); `raised_at_start`: kinds whose words start raised (1)."""

    def __init__(self, heap, kinds: tuple[str, ...], raised_at_start: tuple[str, ...] = ()):
        self.heap, self.backend = heap, heap.backend
        self.rank, self.world = heap.rank, heap.world
        self._row = {kind: i for i, kind in enumerate(kinds)}
        self.words = heap.alloc((len(kinds), self.world), np.uint32)
        self.seen = heap.alloc((len(kinds), self.world), np.uint32)
        start = np.zeros((len(kinds), self.world), np.uint32)
        for kind in raised_at_start:
            start[self._row[kind]] = 1
        self.words.copy_from(start)  # (before the barrier that ends the owner's setup: peers write these)
        self._stride = self.words.dtype.itemsize

    def _word(self, array, kind: str, peer: int) -> int:
        return array.ptr + (self._row[kind] * self.world + peer) * self._stride

    def raise_on(self, peer: int, kind: str, stream, count: int = 0) -> None:
        """After what `stream` queued so far, raise our word of `kind` in `peer`'s copy, holding `count`."""
        self.backend.stream_write_word(stream, self.heap.translate(self._word(self.words, kind, self.rank), peer),
                                       count + 1)

    def wait(self, source: int, kind: str, stream, what: str, count: int = 0) -> None:
        """Queue on `stream`: wait until `source` raised its word of `kind` here with `count`, then lower it. The
        wait's "seen" word reads WAITING while the stream stands at it, PASSED after. `what` names what was
        awaited."""
        word, seen = self._word(self.words, kind, source), self._word(self.seen, kind, source)
        self.backend.stream_write_word(stream, seen, WAITING)
        self.backend.stream_wait_word(stream, word, count + 1, self.heap.timeout,
                                      lambda: self.stuck_error([(source, kind, count, what)], None))
        self.backend.stream_write_word(stream, word, 0)
        self.backend.stream_write_word(stream, seen, PASSED)

    def waiting(self, awaited, watch) -> list:
        """The (source, kind, ...) entries of `awaited` whose wait a stream stands at now (not those it has
        passed, nor those it has not reached), read on `watch` (a stream that waits for nothing)."""
        seen = np.empty(self.seen.shape, np.uint32)
        self.backend.copy_to_host(seen, self.seen.ptr, watch)
        stuck = {}
        for entry in awaited:
            if seen[self._row[entry[1]], entry[0]] == WAITING:
                stuck.setdefault((entry[0], entry[1]), entry)
        return list(stuck.values())

    def stuck_error(self, stuck, watch):
        """The error of waits `stuck` ((source, kind, count, what) entries) that never passed: a rank that
        raised another count disagrees (ConfigMismatchError), one that raised nothing never came."""
        words = np.empty(self.words.shape, np.uint32)
        self.backend.copy_to_host(words, self.words.ptr, watch)
        odd = [(source, int(words[self._row[kind], source]) - 1, count, what)
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
        """Raise the words of `stuck` ((source, kind, count, ...) entries) here ourselves, so waits on a rank that
        will never raise them pass and the stream drains (the caller poisons what it wrote)."""
        for source, kind, count, *_ in stuck:
            self.backend.copy_to_device(self._word(self.words, kind, source), np.array([count + 1], np.uint32),
                                        watch)
