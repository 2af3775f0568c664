"""Host twins of kernels_hip/exchange.h, shared by both exchange kernels: heap view, epoch, valid slots, poisoning."""
from __future__ import annotations

import time

import numpy as np

from . import STATUS_OK, STATUS_TIMEOUT, Recorder, Status, bases, mem, poll

WAIT_DISPATCH, WAIT_COMBINE_ROW, WAIT_WEIGHTS = 1, 2, 5
# count header bits: the source pushed its tokens; takes its contributions pushed back; its x lies in its x_stage
PUSHED_TOKENS, PUSHED_BACK, X_IN_HEAP = 0x80000000, 0x40000000, 0x20000000


def count_header(value: int, max_tokens: int) -> tuple[int, bool, bool]:
    """A token-count header as (tokens clamped to max_tokens, pushed tokens, takes contributions pushed back)."""
    return (min(value & ~(PUSHED_TOKENS | PUSHED_BACK | X_IN_HEAP), max_tokens), bool(value & PUSHED_TOKENS),
            bool(value & PUSHED_BACK))


class View:
    """This call's geometry and NumPy views of a rank's symmetric buffers."""

    def __init__(self, a, epoch: int):
        h = a.heap
        self.a, self.me, self.W, self.M, self.k = a, h.rank, h.world, a.max_tokens, a.top_k
        self.L, self.E, self.cap = a.local_experts, a.num_experts, h.world * a.max_tokens
        self.parity, self.epoch, self.S = epoch & 1, epoch, a.nseg
        self.base = bases(h)
        self.deadline = time.monotonic() + a.timeout_ns / 1e9
        self.status = Status(self.base[self.me] + a.off_status, a.host_status)
        self.rec = Recorder(a.prof)

    def buf(self, rank: int, name: str, shape, dtype) -> np.ndarray:
        return mem(self.base[rank] + getattr(self.a, "off_" + name), shape, dtype)

    def addr(self, rank: int, name: str, index: int) -> int:
        """The address of 32-bit word `index` of a rank's buffer `name`."""
        return int(self.base[rank] + getattr(self.a, "off_" + name) + int(index) * 4)

    def wait_tagged(self, words: np.ndarray, what: int, peer: int, rows=None):
        """The 32-bit values of tagged `words` (or of its `rows`) once all carry this call's epoch; None (reported)
        past its deadline. `words` must be a view of the memory peers write (a fancy-indexed copy never changes:
        pass `rows`)."""
        seen = words

        def arrived() -> bool:
            nonlocal seen
            seen = (words if rows is None else words[rows]).copy()  # aligned 8-byte words: each is read whole
            return bool(np.all((seen >> np.uint64(32)) == self.epoch))
        if not poll(arrived, self.deadline):
            self.status.report(STATUS_TIMEOUT, peer, what, self.epoch)
            return None
        return (seen & np.uint64(0xFFFFFFFF)).astype(np.uint32)


def take_epoch(a, dispatch: bool) -> int:
    """The epoch words (exchange.h: read_epoch, make_ctx): dispatch advances [0] into [1], combine hands [1] back."""
    words = mem(bases(a.heap)[a.heap.rank] + a.off_epoch, (2,), np.uint32)
    e = int(words[0]) % 0xFFFFFFFE + 1 if dispatch else int(words[1])  # (next_epoch: never 0)
    words[1 if dispatch else 0] = e
    return e


def valid_slots(rows: np.ndarray, num_experts: int) -> np.ndarray:
    """Mask of (token, slot) entries in [0, E) that do not repeat an earlier slot of their row."""
    ok = (rows >= 0) & (rows < num_experts)
    for j in range(1, rows.shape[1]):
        ok[:, j] &= ~(rows[:, :j] == rows[:, j:j + 1]).any(axis=1)
    return ok


def finish(backend, a, v: View, outputs, words=()) -> None:
    """exchange.h's finish: an error status poisons the outputs (all-ones bytes; `words`, (int32 array, value)
    pairs: that value in each word); on_timeout="trap" traps too."""
    code = int(v.status.words[0])
    if code == STATUS_OK:
        return
    for out in outputs:
        out.view(np.uint8)[...] = 0xFF
    for out, value in words:
        out[...] = value
    if a.trap_on_timeout and code == STATUS_TIMEOUT:
        backend.trap(f"a kernel of rank {v.me} timed out with on_timeout='trap'")
