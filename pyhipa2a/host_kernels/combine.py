"""Host twin of kernels_hip/combine.hip: raw rows or fp32/narrow partial sums, pulled, posted or pushed, summed by
owners."""
from __future__ import annotations

import time

import numpy as np

from . import f16_and_bf16, mem, tag, wait_flags
from ..kernels import REDUCE_ONLY, WHOLE_COMBINE
from .exchange import WAIT_COMBINE_ROW, WAIT_WEIGHTS, View, count_header, finish, take_epoch, valid_slots


def _combine(backend, a, c, dtype) -> None:
    v = View(a, take_epoch(a, dispatch=False))
    try:
        _combine_body(backend, a, c, dtype, v)
    finally:
        if c.phase in (WHOLE_COMBINE, REDUCE_ONLY):  # (a part that only sends has no output: see combine.hip)
            finish(backend, a, v, (mem(c.out, (c.num_tokens, a.hidden), dtype),))


def last_groups(rows: np.ndarray, here: np.ndarray, L: int, groups: int) -> np.ndarray:
    """After dispatch(groups=G): each token's last group here (the largest l * G // L over its experts l here)."""
    return np.where(here, (rows % L) * groups // L, -1).max(axis=1)


def contribution_slots(v: View, contributor: int, owner: int, posted: bool) -> np.ndarray:
    """[M, 4 * H] bytes: `contributor`'s contributions to `owner`'s tokens where they are not pushed, in the
    owner's memory when the call posts them, else in the contributor's (combine.hip: contribution_slot)."""
    holder, index = (owner, contributor) if posted else (contributor, owner)
    return v.buf(holder, "contrib", (v.W, v.M, 4 * v.a.hidden), np.uint8)[index]


def _combine_body(backend, a, c, dtype, v: View) -> None:
    W, M, k, L, me, p, H = v.W, v.M, v.k, v.L, v.me, v.parity, a.hidden
    T, P = c.num_tokens, a.push_max_tokens
    narrow = bool(a.narrow_partials)  # partial sums travel in the output's 16-bit format
    scale = np.float32(c.expert_scale)  # our expert rows count as expert_y * scale (a fused epilogue)
    if c.weights:
        weights = mem(c.weights, (T, k), np.float32)
    else:  # dispatch sent them, ours into our own w_in
        weights = v.buf(me, "w_in", (W, M, k), np.uint64)[me, :T].astype(np.uint32).view(np.float32)
    expert_y = mem(c.expert_y, (a.recv_rows, H), dtype)
    slot_of = v.buf(me, "slot_of", (W, M, k), np.int32)
    decoded = v.buf(me, "rows", (W, M, k), np.int32)
    headers = v.buf(me, "tok_count", (2, W), np.uint64)[p] & np.uint64(0xFFFFFFFF)  # every count, as dispatch left it
    most = max(count_header(int(h), M)[0] for h in headers)
    posted = W > 1 and a.post_min_tokens and most >= a.post_min_tokens  # (every rank decides alike: exchange.h)
    span = time.monotonic_ns()
    sends, reduces = c.phase != REDUCE_ONLY, c.phase in (WHOLE_COMBINE, REDUCE_ONLY)
    for r in range(W):  # 1. our weights to every peer, as tagged words (unless dispatch sent them)
        if r != me and c.weights and sends:
            t0 = time.monotonic_ns()
            v.buf(r, "w_in", (W, M, k), np.uint64)[me, :T] = tag(weights.view(np.uint32), v.epoch)
            v.rec.record(8, t0, r)
    for src in range(W) if sends else ():  # 2. one contribution per (peer's token, this rank) for its owner,
        if src == me:                         # left in our memory, or posted into the owner's
            continue  # our own tokens are reduced straight from expert_y
        count, _, src_pushed = count_header(int(headers[src]), M)  # it takes its contributions pushed
        rows = decoded[src, :count]
        here = valid_slots(rows, v.E) & (rows // L == me)
        if c.phase != WHOLE_COMBINE:  # this part's tokens alone
            here &= (last_groups(rows, here, L, c.groups) == c.phase - 1)[:, None]
        tokens = np.flatnonzero(here.any(axis=1))
        if len(tokens) == 0:
            continue
        t0 = time.monotonic_ns()
        words = v.wait_tagged(v.buf(me, "w_in", (W, M, k), np.uint64)[src, :count], WAIT_WEIGHTS, src,
                              rows=here)  # dispatch sends only these
        if words is None:
            return
        v.rec.record(9, t0, src)
        w = np.zeros((count, k), np.float32)
        w[here] = words.view(np.float32)
        t0 = time.monotonic_ns()
        contrib = contribution_slots(v, me, src, posted)
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
    # 3. reduce our tokens: our experts' rows from expert_y, peers' contributions from their memory (or our inbox)
    if not reduces:
        return
    _, _, pushed = count_header(int(headers[me]), M)
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
        single, multi = tokens[n[tokens] == 1], tokens[n[tokens] > 1]
        t0 = time.monotonic_ns()
        if pushed:  # rank r's contributions to our tokens, as tagged words in our inbox
            theirs = np.zeros((M, 4 * H), np.uint8)
            for width, pick in ((H // 2, single), (H // 2 if narrow else H, multi)):
                ours = v.buf(me, "push_contrib", (W, P, a.push_row_words), np.uint64)[r, :, :width]
                arrived = v.wait_tagged(ours, WAIT_COMBINE_ROW, r, rows=pick)
                if arrived is None:
                    return
                theirs[pick, :4 * width] = arrived.view(np.uint8).reshape(len(pick), 4 * width)
        else:  # rank r's contributions to our tokens, in its memory (ours when posted) once their flags are in
            needed = (tokens[:, None] * v.S + np.arange(v.S)).ravel()
            if not wait_flags(backend, v.addr(me, "contrib_flag", r * M * v.S), needed, v.epoch, v.deadline,
                              v.status, WAIT_COMBINE_ROW, peer=r):
                return
            theirs = contribution_slots(v, r, me, posted)
        v.rec.record(11, t0, r)
        t0 = time.monotonic_ns()
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


a2a_combine_f16, a2a_combine_bf16 = f16_and_bf16(_combine)
a2a_combine_f16_phased, a2a_combine_bf16_phased = a2a_combine_f16, a2a_combine_bf16  # (one serves all here)
