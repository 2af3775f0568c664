"""Host twin of kernels_hip/dispatch.hip: the same inboxes, flags and steps, each a loop over ranks in NumPy."""
from __future__ import annotations

import time

import numpy as np

from ..dtypes import bfloat16
from . import STATUS_BAD_INDEX, STATUS_CAPACITY, STATUS_OK, STATUS_PEER, STATUS_TIMEOUT, mem, tag, wait_flags
from .exchange import (PUSHED_BACK, PUSHED_TOKENS, WAIT_DISPATCH, X_IN_HEAP, View, count_header, finish, take_epoch,
                       valid_slots)
from ..kernels import X_COPY, X_FP8, X_QUANTIZE_BF16, route_chunk, route_chunks
from .fp8 import quantize


def a2a_dispatch(backend, a, c) -> None:
    v = View(a, take_epoch(a, dispatch=True))
    try:
        _dispatch(backend, a, c, v)
    finally:
        finish(backend, a, v, (v.buf(v.me, "recv_x", (a.recv_rows, a.x_row_bytes), np.uint8),
                               v.buf(v.me, "recv_meta", (a.recv_rows, 3), np.int32),
                               v.buf(v.me, "num_tokens", (v.L,), np.int32),
                               v.buf(v.me, "recv_scales", (a.recv_rows, a.scale_cols), np.float32),
                               v.buf(v.me, "layout", (v.L, v.W, 2), np.int32)[:v.L if a.by_source else 0]),
               # (contiguous rows' offsets all R: exchange.h's Poison says why)
               words=((v.buf(v.me, "offsets", (v.L + 1,), np.int32)[:v.L + 1 if a.row_align else 0], a.recv_rows),))
        # dispatch(groups=): every group's readiness word, once its rows are in (here: all at once, at the
        # end), or once a failed call's outputs are poisoned (watch_groups and finish in dispatch.hip)
        for group in range(c.groups):
            backend.store_release_u32(v.addr(v.me, "group_ready", group), 1)


a2a_dispatch_fp8 = a2a_dispatch_quantize_f16 = a2a_dispatch_quantize_bf16 = a2a_dispatch  # same steps, other bytes
# (the device compiles contiguous rows and groups into a kernel of their own; here one serves all calls)
a2a_dispatch_placed = a2a_dispatch_fp8_placed = a2a_dispatch_quantize_f16_placed = a2a_dispatch_quantize_bf16_placed = \
    a2a_dispatch


def carried(a, c, T: int) -> np.ndarray:
    """What each of T tokens carries, [T, token_bytes]: its 16-bit row, or fp8 row and scales (given or quantized)."""
    if a.x_format == X_COPY:
        return mem(c.x, (T, a.x_row_bytes), np.uint8)
    H, C = a.hidden, a.scale_cols
    if a.x_format == X_FP8:
        codes, scales = mem(c.x, (T, H), np.uint8), mem(c.x_scales, (T, C), np.float32)
    else:
        dtype = bfloat16() if a.x_format == X_QUANTIZE_BF16 else np.dtype(np.float16)
        codes, scales = quantize(mem(c.x, (T, H), dtype), bool(a.fp8_fnuz))
    out = np.zeros((T, a.token_bytes), np.uint8)
    out[:, :H] = codes
    out[:, H:H + 4 * C] = np.ascontiguousarray(scales, np.float32).view(np.uint8).reshape(T, 4 * C)
    return out


NO_SLOT = 0xFFFFFFFF  # a void routing slot as it travels (A2A_NO_SLOT)


def places(rows: np.ndarray, valid: np.ndarray, num_experts: int, chunk: int) -> tuple[np.ndarray, np.ndarray]:
    """Each valid slot's place among its expert's rows of its `chunk`-token route chunk, and rows per chunk [C, E]."""
    chunks = -(-len(rows) // chunk)
    key = np.where(valid, rows + num_experts * (np.arange(len(rows)) // chunk)[:, None], -1).ravel()
    order = np.argsort(key, kind="stable")
    first = np.searchsorted(key[order], key[order], side="left")
    place = np.empty(key.shape, np.int64)
    place[order] = np.arange(len(key)) - first
    counts = np.bincount(key[key >= 0], minlength=chunks * num_experts).reshape(chunks, num_experts)
    return place.reshape(rows.shape), counts


def row_starts(a, v: View, counts: np.ndarray, ticket: int) -> np.ndarray | None:
    """Contiguous rows: each of our experts' first row, once every source's counts are in (None: one never came),
    into expert_offsets (with a ticket, to the host too, tagged with it), each expert's rows rounded up to
    row_align; rows ending past R are reported, as publish_offsets in dispatch.hip does."""
    totals = np.zeros(v.L, np.int64)
    for src in range(v.W):
        src_counts = v.wait_tagged(counts[src], WAIT_DISPATCH, src)
        if src_counts is None:
            return None
        totals += src_counts.astype(np.int64).sum(axis=0)
    rounded = -(-np.minimum(totals, v.cap) // a.row_align) * a.row_align
    ends = np.cumsum(rounded)
    starts = ends - rounded
    v.buf(v.me, "offsets", (v.L + 1,), np.int32)[:] = np.append(starts, ends[-1])
    if ticket:
        mem(a.host_offsets, (v.L + 1,), np.uint64)[:] = tag(np.append(starts, ends[-1]), ticket)
    over = np.flatnonzero(ends > a.recv_rows)
    if len(over):
        v.status.report(STATUS_CAPACITY, v.me, int(over[0]), int(ends[over[0]]))
    return starts


def _dispatch(backend, a, c, v: View) -> None:
    W, M, k, L, E, me, p = v.W, v.M, v.k, v.L, v.E, v.me, v.parity
    T, rb, tb, S = c.num_tokens, a.x_row_bytes, a.token_bytes, a.x_nseg
    indices = mem(c.indices, (T, k), np.int32)
    x = carried(a, c, T)
    if a.void_slots and v.status.words[0] == STATUS_TIMEOUT:
        return  # a node's part of a multi-node call whose exchange timed out sends nothing (see dispatch.hip)
    valid = valid_slots(indices, E)
    bad = ~valid & ~((indices < 0) if a.void_slots else False)  # void slots of a node's part are no error
    if bad.any():
        pos = int(np.flatnonzero(bad)[0])
        v.status.report(STATUS_BAD_INDEX, me, pos, int(indices.flat[pos]))
    push_back = T <= a.push_max_tokens  # a pushed call; it pushes its tokens too unless flags follow a
    push = push_back and not a.gpu_fence_publish  # GPU-scope fence (exchange.h: A2A_PUSHED_TOKENS)
    # a 16-bit x that lies in our x_stage is pulled from there (exchange.h: x in the heap)
    in_heap = a.x_format == X_COPY and not push and c.x == a.local_base + a.off_x_stage
    header = T | (PUSHED_TOKENS if push else 0) | (PUSHED_BACK if push_back else 0) | (X_IN_HEAP if in_heap else 0)
    P, words = a.push_max_tokens, a.push_token_words
    span = time.monotonic_ns()
    # 1. route by chunks: to every rank, us too, routing rows with places, token count, dense chunk counts, weights
    t0 = time.monotonic_ns()
    chunk, C = route_chunk(k, M), route_chunks(k, M)
    place, chunk_counts = places(indices, valid, E, chunk)
    sent = np.zeros((C, E), np.int64)
    sent[:len(chunk_counts)] = chunk_counts
    packed = np.where(valid, indices + E * place, NO_SLOT)
    for r in range(W):
        v.buf(r, "tok_hdr", (2, W, M, k), np.uint64)[p, me, :T] = tag(packed, v.epoch)
        v.buf(r, "tok_count", (2, W), np.uint64)[p, me] = tag(header, v.epoch)
        v.buf(r, "expert_counts", (2, W, C, L), np.uint64)[p, me] = tag(sent[:, r * L:(r + 1) * L], v.epoch)
    if c.weights:  # each slot's weight to its expert's rank, and all of them to our own w_in (combine's)
        weights = tag(mem(c.weights, (T, k), np.float32).view(np.uint32), v.epoch)
        host = np.where(valid, indices // L, me)
        for r in range(W):
            mine = np.ones_like(valid) if r == me else host == r
            v.buf(r, "w_in", (W, M, k), np.uint64)[me, :T][mine] = weights[mine]
    v.rec.record(1, t0, me)
    # 2. every token another rank needs: pushed to its inbox as tagged words, or staged here with flags sent to it
    t0 = time.monotonic_ns()
    needed_by = {r: np.flatnonzero((valid & (indices // L == r)).any(axis=1)) for r in range(W) if r != me}
    if not push and not in_heap:
        tokens = np.flatnonzero((valid & (indices // L != me)).any(axis=1))
        v.buf(me, "stage", (2, M, tb), np.uint8)[p, tokens] = x[tokens]
    for r, tokens in needed_by.items():
        if not push:
            for t in tokens:
                for seg in range(S):
                    backend.store_release_u32(v.addr(r, "stage_flag", ((p * W + me) * M + t) * S + seg), v.epoch)
        elif len(tokens):  # (a call of no tokens pushes nothing; its rows need not be whole words)
            inbox = v.buf(r, "push_tok", (2, W, P, words), np.uint64)[p, me]
            inbox[tokens, :tb // 4] = tag(x[tokens].view(np.uint32), v.epoch)
    v.rec.record(2, t0, me)
    # Every layout's rows as one run: expert l's row i is row l * W * M + i, or contiguous its first row + i
    expert_x = v.buf(me, "recv_x", (a.recv_rows, rb), np.uint8)
    meta = v.buf(me, "recv_meta", (a.recv_rows, 3), np.int32)
    scales = v.buf(me, "recv_scales", (a.recv_rows, a.scale_cols), np.float32)
    slot_of = v.buf(me, "slot_of", (W, M, k), np.int32)
    decoded = v.buf(me, "rows", (W, M, k), np.int32)
    counts = v.buf(me, "expert_counts", (2, W, C, L), np.uint64)[p]
    starts = row_starts(a, v, counts, c.ticket) if a.row_align else np.zeros(L, np.int64)
    if starts is None:
        return
    per_source = np.zeros((L, W), np.int64)  # rows of each of our experts from each source placed so far
    for src in range(W):  # 3. each source's tokens with experts here, copied to the rows its places give
        t0 = time.monotonic_ns()
        n = v.wait_tagged(v.buf(me, "tok_count", (2, W), np.uint64)[p, src:src + 1], WAIT_DISPATCH, src)
        if n is None:
            return
        count, pushed, _ = count_header(int(n[0]), M)
        src_in_heap = bool(int(n[0]) & X_IN_HEAP)
        hdr = v.wait_tagged(v.buf(me, "tok_hdr", (2, W, M, k), np.uint64)[p, src, :count], WAIT_DISPATCH, src)
        src_counts = None if hdr is None else v.wait_tagged(counts[src], WAIT_DISPATCH, src)
        if src_counts is None:
            return
        v.rec.record(3, t0, src)
        void = hdr == NO_SLOT
        # (as int32 before -1 goes in: NumPy 2.5 refuses -1 in an unsigned array)
        rows = np.where(void, -1, (hdr % E).astype(np.int32)).reshape(count, k)
        place = (hdr // E).astype(np.int64).reshape(count, k)
        if src == me:
            vecs = x
        elif src_in_heap:
            vecs = v.buf(src, "x_stage", (M, rb), np.uint8)
        else:
            vecs = v.buf(src, "stage", (2, M, tb), np.uint8)[p]
        decoded[src, :count] = rows  # combine reads the routing rows from here
        tokens, slots = np.nonzero((rows >= 0) & (rows // L == me))
        wanted = np.unique(tokens)
        t0 = time.monotonic_ns()
        needed = (wanted[:, None] * S + np.arange(S)).ravel()
        if src != me and pushed:  # the tokens' words in our inbox, once each carries the epoch
            vecs = np.zeros((count, tb), np.uint8)
            arrived = v.wait_tagged(v.buf(me, "push_tok", (2, W, P, words), np.uint64)[p, src, :, :tb // 4],
                                    WAIT_DISPATCH, src, rows=wanted)
            if arrived is None:
                return
            vecs[wanted] = arrived.view(np.uint8).reshape(-1, tb)
        elif src != me and not wait_flags(backend, v.addr(me, "stage_flag", (p * W + src) * M * S), needed,
                                          v.epoch, v.deadline, v.status, WAIT_DISPATCH, peer=src):
            return
        if src != me:
            v.rec.record(4, t0, src)
        t0 = time.monotonic_ns()
        local = rows[tokens, slots] % L
        src_counts = src_counts.astype(np.int64)  # [C, L]: the rows of each of src's chunks
        # where each chunk's rows begin: packed, after every earlier source's (contiguous: from the expert's
        # first row); by source, at src * M
        first = src * M if a.by_source else starts + per_source[:, :src].sum(axis=1)
        chunk_start = first + np.cumsum(src_counts, axis=0) - src_counts
        row = chunk_start[tokens // chunk, local] + place[tokens, slots]
        fits = row < (a.recv_rows if a.row_align else v.cap)
        if not fits.all():
            v.status.report(STATUS_CAPACITY, me, int(local[~fits][0]), int(row[~fits][0]))
        t, j, local, row = tokens[fits], slots[fits], local[fits], row[fits]
        if not a.row_align:
            row = local * v.cap + row
        slot_of[src, :count] = -1
        expert_x[row] = vecs[t, :rb]
        if a.scale_cols:
            scales[row] = vecs[t, a.hidden:a.hidden + 4 * a.scale_cols].copy().view(np.float32)
        R = a.region_tokens  # a node's part of a multi-node call names each token's true source
        meta[row] = np.stack([t // R * W + src, t % R, j] if R else [np.full_like(t, src), t, j], axis=1)
        slot_of[src, t, j] = row
        per_source[:, src] = src_counts.sum(axis=0)
        v.rec.record(5, t0, src)
        if src != me and src_in_heap:  # a source that failed while we read its x_stage (check_heap_sources)
            code = int(v.buf(src, "status", (4,), np.uint32)[0])
            if code != STATUS_OK:
                v.status.report(STATUS_PEER, src, WAIT_DISPATCH, code)
    # 4. expert_num_tokens: every source's count of each of our experts
    t0 = time.monotonic_ns()
    v.buf(me, "num_tokens", (L,), np.int32)[:] = np.minimum(per_source.sum(axis=1), v.cap)
    if a.by_source:  # expert_layout: (first row, rows) of each source's rows of each expert
        layout = v.buf(me, "layout", (L, W, 2), np.int32)
        layout[:, :, 0] = np.arange(W) * M
        layout[:, :, 1] = np.minimum(per_source, M)
    v.rec.record(6, t0)
    v.rec.record(7, span)
