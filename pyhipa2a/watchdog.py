"""Watchdog: a bound, kept from the host, on device waits that have none of their own (a stream waiting for a
readiness word, pyhipa2a.signals). Its owner arms it with a call's deadline; a thread polls the event recorded
after the call, and once the deadline passes with the event still pending it calls the owner's
`past_deadline()` (InFlight.abandon: name the ranks, release the waits, poison the outputs; CombineBound._look:
look for progress, then arm it again, give up, or leave it stopped). So a rank whose peer never comes is not
held forever even by a host wait outside the library (`torch.cuda.synchronize()`)."""
from __future__ import annotations

import threading
import time

POLL_S = 0.01  # how often an armed watchdog asks the event: far below any timeout, far above its cost


class Watchdog:
    def __init__(self, backend, event, past_deadline):
        self._backend, self._event, self._past_deadline = backend, event, past_deadline
        self._cond = threading.Condition()
        self._deadline = None  # of the call armed last; None: nothing pending
        self._thread = None
        self._closed = False

    def arm(self, deadline: float) -> None:
        """The call just queued (its event recorded) must be done by `deadline` (time.monotonic())."""
        with self._cond:
            idle, self._deadline = self._deadline is None, deadline
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="pyhipa2a-watchdog", daemon=True)
                self._thread.start()
            if idle:  # (an armed thread reads the new deadline at its next poll)
                self._cond.notify()

    def disarm(self) -> None:
        """Nothing is pending: the owner saw the event done."""
        with self._cond:
            self._deadline = None

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        self._backend.activate()  # (this thread's current device: the owner's)
        while True:
            with self._cond:
                while self._deadline is None and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                deadline = self._deadline
            time.sleep(POLL_S)
            try:
                done = self._backend.event_done(self._event)
            except Exception:  # (the owner asks again past the deadline, and keeps what fails for its caller)
                done = False
            with self._cond:
                if self._deadline != deadline:  # (re-armed or disarmed meanwhile: ask again)
                    continue
                if not done and time.monotonic() <= deadline:
                    continue
                self._deadline = None
            if not done:
                self._past_deadline()
