"""Host twins of kernels_hip/a2a.hip: the same inboxes, flags and steps, in NumPy.

The device code spreads each step over warps; here each step is a loop over
ranks with vectorised copies. The protocol (parity inboxes, epoch flags,
one vector per (token, destination rank), raw-row or fp32 contributions)
is the same, so the Python stack above is exercised as on a GPU.
"""
from __future__ import annotations

import time

import numpy as np

from ..dtypes import bfloat16
from . import STATUS_BAD_INDEX, STATUS_CAPACITY, STATUS_OK, STATUS_TIMEOUT, Recorder, Status, bases, mem, tag, wait_flags, wait_tagged

WAIT_DISPATCH, WAIT_COMBINE_ROW, WAIT_WEIGHTS = 1, 2, 5
PUSHED = 0x80000000  # count header bit: the source pushed its tokens (A2A_PUSHED)


def count_header(value: int, max_tokens: int) -> tuple[int, bool]:
    """A token-count header's value: (tokens, clamped to max_tokens; whether the source pushed)."""
    return min(value & ~PUSHED, max_tokens), bool(value & PUSHED)


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

    def addr(self, rank: int, name: str, index: int, itemsize: int = 4) -> int:
        return int(self.base[rank] + getattr(self.a, "off_" + name) + int(index) * itemsize)


def next_epoch(e: int) -> int:
    return e % 0xFFFFFFFE + 1


def take_epoch(a, dispatch: bool) -> int:
    """The device's epoch words (see take_epoch in a2a.hip): dispatch advances [0] into [1], combine hands [1] back."""
    words = mem(bases(a.heap)[a.heap.rank] + a.off_epoch, (2,), np.uint32)
    e = next_epoch(int(words[0])) if dispatch else int(words[1])
    words[1 if dispatch else 0] = e
    return e


def valid_slots(rows: np.ndarray, num_experts: int) -> np.ndarray:
    """Mask of (token, slot) entries in [0, E) that do not repeat an earlier slot of their row."""
    ok = (rows >= 0) & (rows < num_experts)
    for j in range(1, rows.shape[1]):
        ok[:, j] &= ~(rows[:, :j] == rows[:, j:j + 1]).any(axis=1)
    return ok


def finish(backend, a, v: View, outputs) -> None:
    """The end of every exchange kernel (poison_if_failed and report in a2a.hip): when this rank's
    status holds an error, the call's outputs become all-ones bytes (NaN rows, -1 counts and meta);
    with on_timeout="trap" a timeout then leaves the device unusable, as the GPU's trap does."""
    code = int(v.status.words[0])
    if code == STATUS_OK:
        return
    for out in outputs:
        out.view(np.uint8)[...] = 0xFF
    if a.trap_on_timeout and code == STATUS_TIMEOUT:
        backend.trap(f"a kernel of rank {v.me} timed out with on_timeout='trap'")


def a2a_dispatch(backend, a, c) -> None:
    v = View(a, take_epoch(a, dispatch=True))
    try:
        _dispatch(backend, a, c, v)
    finally:
        finish(backend, a, v, (v.buf(v.me, "recv_x", (v.L, v.cap, a.x_row_bytes), np.uint8),
                               v.buf(v.me, "recv_meta", (v.L, v.cap, 3), np.int32),
                               v.buf(v.me, "num_tokens", (v.L,), np.int32)))


def _dispatch(backend, a, c, v: View) -> None:
    W, M, k, L, me, p = v.W, v.M, v.k, v.L, v.me, v.parity
    T, rb = c.num_tokens, a.x_row_bytes
    indices = mem(c.indices, (T, k), np.int32)
    x = mem(c.x, (T, rb), np.uint8)
    valid = valid_slots(indices, v.E)
    if not valid.all():
        pos = int(np.flatnonzero(~valid)[0])
        v.status.report(STATUS_BAD_INDEX, me, pos, int(indices.flat[pos]))

    push = T <= a.push_max_tokens
    P, words = a.push_max_tokens, rb // 4
    span = time.monotonic_ns()
    for r in range(W):  # 1. headers to every peer as tagged words; the count (and our choice) to us too
        t0 = time.monotonic_ns()
        if r != me:
            v.buf(r, "tok_hdr", (2, W, M, k), np.uint64)[p, me, :T] = tag(indices, v.epoch)
        v.buf(r, "tok_count", (2, W), np.uint64)[p, me] = tag(T | (PUSHED if push else 0), v.epoch)
        if r != me:
            v.rec.record(1, t0, r)
    # 2. every token another rank needs: pushed into its inbox as tagged words, or staged in our
    # own memory (peers pull it) with its flags sent to them
    t0 = time.monotonic_ns()
    needed_by = {r: np.flatnonzero((valid & (indices // L == r)).any(axis=1)) for r in range(W) if r != me}
    if not push:
        tokens = np.flatnonzero((valid & (indices // L != me)).any(axis=1))
        v.buf(me, "stage", (2, M, rb), np.uint8)[p, tokens] = x[tokens]
    for r, tokens in needed_by.items():
        if not push:
            for t in tokens:
                for seg in range(v.S):
                    backend.store_release_u32(v.addr(r, "stage_flag", ((p * W + me) * M + t) * v.S + seg), v.epoch)
        elif len(tokens):  # (a call of no tokens pushes nothing; its rows need not be whole words)
            inbox = v.buf(r, "push_tok", (2, W, P, words), np.uint64)[p, me]
            inbox[tokens] = tag(x[tokens].view(np.uint32), v.epoch)
    v.rec.record(2, t0, me)

    counters = v.buf(me, "counters", (L,), np.uint32)
    expert_x = v.buf(me, "recv_x", (L, v.cap, rb), np.uint8)
    meta = v.buf(me, "recv_meta", (L, v.cap, 3), np.int32)
    slot_of = v.buf(me, "slot_of", (W, M, k), np.int32)
    decoded = v.buf(me, "rows", (W, M, k), np.int32)
    for src in range(W):  # 3. fan each token with experts here out to its experts' rows
        if src == me:
            rows, vecs, count, pushed = indices, x, T, False
        else:
            t0 = time.monotonic_ns()
            n = wait_tagged(v.buf(me, "tok_count", (2, W), np.uint64)[p, src:src + 1], v.epoch, v.deadline,
                            v.status, WAIT_DISPATCH, src)
            count, pushed = count_header(int(n[0]), M) if n is not None else (0, False)
            hdr = wait_tagged(v.buf(me, "tok_hdr", (2, W, M, k), np.uint64)[p, src, :count], v.epoch,
                              v.deadline, v.status, WAIT_DISPATCH, src) if n is not None else None
            if hdr is None:
                return
            v.rec.record(3, t0, src)
            rows = hdr.view(np.int32).reshape(count, k)
            vecs = v.buf(src, "stage", (2, M, rb), np.uint8)[p]
        decoded[src, :count] = rows  # combine reads the routing rows from here
        here = valid_slots(rows, v.E) & (rows // L == me)
        tokens, slots = np.nonzero(here)
        wanted = np.unique(tokens)
        t0 = time.monotonic_ns()
        needed = (wanted[:, None] * v.S + np.arange(v.S)).ravel()
        if src != me and pushed:  # the tokens' words in our inbox, once each carries the epoch
            vecs = np.zeros((count, rb), np.uint8)
            arrived = wait_tagged(v.buf(me, "push_tok", (2, W, P, words), np.uint64)[p, src], v.epoch,
                                  v.deadline, v.status, WAIT_DISPATCH, src, rows=wanted)
            if arrived is None:
                return
            vecs[wanted] = arrived.view(np.uint8).reshape(-1, rb)
        elif src != me and not wait_flags(backend, v.addr(me, "stage_flag", (p * W + src) * M * v.S), needed,
                                          v.epoch, v.deadline, v.status, WAIT_DISPATCH, peer_of=lambda _: src):
            return
        if src != me:
            v.rec.record(4, t0, src)
        t0 = time.monotonic_ns()
        for l in np.unique(rows[tokens, slots] % L):
            pick = rows[tokens, slots] % L == l
            t, j = tokens[pick], slots[pick]
            first = int(counters[l])
            row = first + np.arange(len(t))
            fits = row < v.cap
            if not fits.all():
                v.status.report(STATUS_CAPACITY, me, int(l), int(row[~fits][0]))
            counters[l] = first + len(t)
            t, j, row = t[fits], j[fits], row[fits]
            expert_x[l, row] = vecs[t]
            meta[l, row] = np.stack([np.full_like(t, src), t, j], axis=1)
            slot_of[src, t, j] = l * v.cap + row
        v.rec.record(5, t0, src)

    # 4. publish the counts, zero the counters for the next call
    t0 = time.monotonic_ns()
    v.buf(me, "num_tokens", (L,), np.int32)[:] = np.minimum(counters, v.cap)
    counters[:] = 0
    v.rec.record(6, t0)
    v.rec.record(7, span)


def _combine(backend, a, c, dtype) -> None:
    v = View(a, take_epoch(a, dispatch=False))
    try:
        _combine_body(backend, a, c, dtype, v)
    finally:
        finish(backend, a, v, (mem(c.out, (c.num_tokens, a.hidden), dtype),))


def _combine_body(backend, a, c, dtype, v: View) -> None:
    W, M, k, L, me, p, H = v.W, v.M, v.k, v.L, v.me, v.parity, a.hidden
    T, P = c.num_tokens, a.push_max_tokens
    narrow = bool(a.narrow_partials)  # partial sums travel in the output's 16-bit format
    scale = np.float32(c.expert_scale)  # our expert rows count as expert_y * scale (a fused epilogue)
    weights = mem(c.weights, (T, k), np.float32)
    expert_y = mem(c.expert_y, (L * v.cap, H), dtype)
    slot_of = v.buf(me, "slot_of", (W, M, k), np.int32)

    decoded = v.buf(me, "rows", (W, M, k), np.int32)
    headers = v.buf(me, "tok_count", (2, W), np.uint64)[p] & np.uint64(0xFFFFFFFF)  # every count, as dispatch left it
    span = time.monotonic_ns()
    for r in range(W):  # 1. our weights to every peer, as tagged words
        if r != me:
            t0 = time.monotonic_ns()
            v.buf(r, "w_in", (W, M, k), np.uint64)[me, :T] = tag(weights.view(np.uint32), v.epoch)
            v.rec.record(8, t0, r)

    for src in range(W):  # 2. one contribution per (peer's token, this rank) for its owner, left in our memory
        if src == me:
            continue  # our own tokens are reduced straight from expert_y
        count, src_pushed = count_header(int(headers[src]), M)
        rows = decoded[src, :count]
        here = valid_slots(rows, v.E) & (rows // L == me)
        tokens = np.flatnonzero(here.any(axis=1))
        if len(tokens) == 0:
            continue
        t0 = time.monotonic_ns()
        words = wait_tagged(v.buf(me, "w_in", (W, M, k), np.uint64)[src, :count], v.epoch, v.deadline,
                            v.status, WAIT_WEIGHTS, src)
        if words is None:
            return
        v.rec.record(9, t0, src)
        w = words.view(np.float32).reshape(count, k)
        t0 = time.monotonic_ns()
        contrib = v.buf(me, "contrib", (W, M, 4 * H), np.uint8)[src]
        inbox = v.buf(src, "push_contrib", (W, P, a.push_row_words), np.uint64)[me]  # the owner's
        for t in tokens:
            js = np.flatnonzero(here[t])
            if len(js) == 1:  # the raw row (scaled, rounded to its format); the owner applies the weight
                part = expert_y[slot_of[src, t, js[0]]]
                if scale != 1:
                    part = (part.astype(np.float32) * scale).astype(dtype)
            else:
                part = np.zeros(H, np.float32)
                for j in js:
                    part += (w[t, j] * scale) * expert_y[slot_of[src, t, j]].astype(np.float32)
                if narrow:
                    part = part.astype(dtype)
            if src_pushed:  # straight into the owner's inbox as tagged words, no flag
                bits = part.view(np.uint32)
                inbox[t, :len(bits)] = tag(bits, v.epoch)
                continue
            contrib[t, :part.nbytes] = part.view(np.uint8)
            for seg in range(v.S):
                backend.store_release_u32(v.addr(src, "contrib_flag", (me * M + t) * v.S + seg), v.epoch)
        v.rec.record(10, t0, src)

    # 3. reduce our tokens: our own experts' rows from expert_y, the peers' contributions from their
    # memory, or from our inbox when our dispatch pushed (its header in our own inbox says)
    _, pushed = count_header(int(headers[me]), M)
    rows = decoded[me, :T]
    valid = valid_slots(rows, v.E)
    acc = np.zeros((T, H), np.float32)
    t0 = time.monotonic_ns()
    for t, j in zip(*np.nonzero(valid & (rows // L == me))):
        if slot_of[me, t, j] >= 0:  # a lost slot was reported already
            acc[t] += (weights[t, j] * scale) * expert_y[slot_of[me, t, j]].astype(np.float32)
    v.rec.record(12, t0, me)
    for r in range(W):
        if r == me:
            continue
        here = valid & (rows // L == r)
        n = here.sum(axis=1)
        tokens = np.flatnonzero(n)
        t0 = time.monotonic_ns()
        if pushed:  # rank r's contributions to our tokens, as tagged words in our inbox
            theirs = np.zeros((M, 4 * H), np.uint8)
            for width, pick in ((H // 2, tokens[n[tokens] == 1]), (H // 2 if narrow else H, tokens[n[tokens] > 1])):
                ours = v.buf(me, "push_contrib", (W, P, a.push_row_words), np.uint64)[r, :, :width]
                arrived = wait_tagged(ours, v.epoch, v.deadline, v.status, WAIT_COMBINE_ROW, r, rows=pick)
                if arrived is None:
                    return
                theirs[pick, :4 * width] = arrived.view(np.uint8).reshape(len(pick), 4 * width)
        else:  # rank r's contributions to our tokens, in its memory once their flags are in
            needed = (tokens[:, None] * v.S + np.arange(v.S)).ravel()
            if not wait_flags(backend, v.addr(me, "contrib_flag", r * M * v.S), needed, v.epoch, v.deadline,
                              v.status, WAIT_COMBINE_ROW, peer_of=lambda _: r):
                return
            theirs = v.buf(r, "contrib", (W, M, 4 * H), np.uint8)[me]
        v.rec.record(11, t0, r)
        t0 = time.monotonic_ns()
        single, multi = tokens[n[tokens] == 1], tokens[n[tokens] > 1]
        if len(single):
            j = here[single].argmax(axis=1)
            raw = theirs[single, :2 * H].copy().view(dtype).astype(np.float32)
            acc[single] += weights[single, j][:, None] * raw
        if len(multi) and narrow:
            acc[multi] += theirs[multi, :2 * H].copy().view(dtype).astype(np.float32)
        elif len(multi):
            acc[multi] += theirs[multi].copy().view(np.float32)
        v.rec.record(12, t0, me)
    mem(c.out, (T, H), dtype)[:] = acc.astype(dtype)
    v.rec.record(13, span)


def a2a_combine_f16(backend, a, c) -> None:
    _combine(backend, a, c, np.dtype(np.float16))


def a2a_combine_bf16(backend, a, c) -> None:
    _combine(backend, a, c, bfloat16())


def _scale(x, y, counts, L, capacity, hidden, scale, dtype) -> None:
    """Arguments arrive as the ctypes objects of the device kernel's signature."""
    L, capacity, hidden = L.value, capacity.value, hidden.value
    xs = mem(x.value, (L, capacity, hidden), dtype)
    ys = mem(y.value, (L, capacity, hidden), dtype)
    n = mem(counts.value, (L,), np.int32)
    for l in range(L):
        ys[l, :n[l]] = (xs[l, :n[l]].astype(np.float32) * np.float32(scale.value)).astype(dtype)


def expert_scale_f16(backend, *args) -> None:
    _scale(*args, np.dtype(np.float16))


def expert_scale_bf16(backend, *args) -> None:
    _scale(*args, bfloat16())
