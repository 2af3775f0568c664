"""InFlight: a CollectiveMatmul's calls on the device, and what becomes of them when a peer never comes.

The device waits for readiness words without a bound (pyhipa2a.signals), so the bound is kept here, on the
host: by `wait()` (synchronize) and, where nobody waits through us, by a watchdog thread. Past `timeout` the
call is given up on: the ranks never heard from are named, the stuck waits released so the streams drain, the
call's outputs poisoned (NaN), and the failure kept for the caller's next call or synchronize; the object
refuses every call after that."""
from __future__ import annotations

import time

from .errors import A2AError, A2ATimeoutError
from .watchdog import Watchdog


class InFlight:
    def __init__(self, backend, signals, watch, timeout: float, lock):
        self.backend, self.signals, self.watch, self.timeout = backend, signals, watch, timeout
        self._lock = lock  # the owner's: held while a call is queued, and while we give up on one
        self._finished = backend.event_create()  # recorded after each call (its stream may be gone before us)
        self._forced = backend.event_create()  # recorded on `watch` after the words it raised for stuck waits
        self._pending = []     # (stream, awaited waits, outputs) of each call queued and not seen done
        self.unreported = None   # the error of a call given up on, until the caller is handed it
        self.broken = None     # why calls are refused, once one failed
        self._watchdog = Watchdog(backend, self._finished, self.abandon)

    def refuse_if_failed(self, op: str) -> None:
        """Before a call: hand the caller a failure not yet reported, or refuse the call of a broken object."""
        if self.unreported is not None:
            raise self._reported()
        if self.broken is not None:
            raise A2AError(f"CollectiveMatmul: {op} refused: an earlier call failed ({self.broken}); close() it")

    def queued(self, s, awaited, outputs) -> None:
        """A call went to stream `s`: `awaited`, its waits ((source, kind, count, what)); `outputs`, the (pointer,
        bytes) it writes."""
        if self._pending and self.backend.event_done(self._finished):
            self._pending.clear()  # (every call before this one is done)
        self.backend.event_record(self._finished, s)
        self._pending.append((s, awaited, outputs))
        self._watchdog.arm(time.monotonic() + self.timeout)

    def failed(self, s, outputs, why: str = "a peer never came, or disagreed") -> None:
        """The call on `s` failed: its outputs read as poison (NaN) after it, and later calls are refused."""
        for ptr, nbytes in outputs:
            if ptr is not None:
                self.backend.memset(ptr, 0xFF, nbytes, s)
        self.backend.event_record(self._finished, s)
        self.broken = self.broken or why

    def wait(self, stream=None) -> None:
        """Wait for the last call (or for a stream of the caller's), at most `timeout` seconds; then give up."""
        if self.unreported is not None:
            raise self._reported()
        if not self._pending and stream is None:
            return
        def done():
            return self.backend.event_done(self._finished) if stream is None else self.backend.stream_done(stream)
        deadline, pause = time.monotonic() + self.timeout, 1e-5
        while not done():
            if time.monotonic() > deadline:
                self.abandon()
                if self.unreported is not None:
                    raise self._reported()
                if not done():  # (a stream of the caller's, busy with more than our call)
                    raise A2ATimeoutError(f"CollectiveMatmul: the stream did not finish in {self.timeout:g} s")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
        if stream is None:
            with self._lock:
                self._pending.clear()
                self._watchdog.disarm()
        if self.unreported is not None:  # (given up on by the watchdog meanwhile)
            raise self._reported()

    def abandon(self) -> None:
        """Give up on the calls still pending (wait() past its timeout, or the watchdog): keep the error for the
        caller, poison the calls' outputs, and release their stuck waits until the streams drain. Released, a
        wait passes and the next call's wait on the same word may stick in turn: the release repeats (bounded)."""
        with self._lock:
            try:
                self._give_up()
            except Exception as e:  # (the driver failing us now: that is the error to hand the caller)
                if self.unreported is None:
                    self.unreported = e
                self.broken = self.broken or f"giving up on a call failed: {e}"

    def _give_up(self) -> None:
        if not self._pending or self.backend.event_done(self._finished):
            return
        pending, self._pending = self._pending, []
        awaited = [entry for _, waits, _ in pending for entry in waits]
        stuck = self.signals.waiting(awaited)
        self.unreported = self.signals.stuck_error(stuck, self.watch) if stuck else A2ATimeoutError(
            f"CollectiveMatmul: rank {self.signals.rank}'s calls did not finish in {self.timeout:g} s, though "
            "every rank's words came")
        for s, _, outputs in pending:  # (queued behind the stuck work: in place once the streams drain)
            self.failed(s, outputs)
        # Released waits pass and drain the streams; the host waits for none of it past the bound (the writes
        # may sit behind a stuck wait, in one hardware queue), and raises the words again only once they landed.
        deadline = time.monotonic() + self.timeout
        landed = True
        while stuck and time.monotonic() < deadline:
            if landed:
                self.signals.force(stuck, self.watch)
                self.backend.event_record(self._forced, self.watch)
            time.sleep(1e-3)
            if self.backend.event_done(self._finished):
                break
            landed = self.backend.event_done(self._forced)
            stuck = self.signals.waiting(awaited)
        while not self.backend.event_done(self._finished) and time.monotonic() < deadline:
            time.sleep(1e-4)

    def _reported(self) -> BaseException:
        """The kept failure, handed to the caller once (later calls are refused as broken)."""
        failure, self.unreported = self.unreported, None
        return failure

    def close(self) -> None:
        self._watchdog.close()
        self.backend.event_destroy(self._finished)
        self.backend.event_destroy(self._forced)
