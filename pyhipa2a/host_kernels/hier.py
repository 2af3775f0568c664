"""Host twin of kernels_hip/hier.hip: the steps of a multi-node call around the node's exchange."""
from __future__ import annotations

import numpy as np

from . import STATUS_BAD_INDEX, STATUS_OK, STATUS_PEER, STATUS_TIMEOUT, Status, f16_and_bf16, mem
from .exchange import valid_slots

WAIT_NODES, WAIT_NODES_COMBINE, WAIT_NODES_RECORDS = 6, 7, 8


def _record(a, region: int):
    """(indices [M, k], weights [M, k], tail [2]: tokens, sequence number) of a region's record."""
    base, M, k = a.records + region * a.record_bytes, a.max_tokens, a.top_k
    return (mem(base, (M, k), np.int32), mem(base + 4 * M * k, (M, k), np.float32),
            mem(base + 8 * M * k, (2,), np.uint32))


def hier_stage(backend, a) -> None:
    me, T, M = a.node, a.tokens, a.max_tokens
    indices, weights, tail = _record(a, me)
    if a.whole:
        mem(a.regions_x + me * M * a.x_row_bytes, (T, a.x_row_bytes), np.uint8)[:] = \
            mem(a.x, (T, a.x_row_bytes), np.uint8)
        if a.regions_scales:
            mem(a.regions_scales + me * M * a.scale_bytes, (T, a.scale_bytes), np.uint8)[:] = \
                mem(a.x_scales, (T, a.scale_bytes), np.uint8)
        indices[:T] = mem(a.indices, (T, a.top_k), np.int32)
    if a.weights:
        weights[:T] = mem(a.weights, (T, a.top_k), np.float32)
    sequence = mem(a.sequence, (4,), np.uint32)
    sequence[0] += 1
    tail[0], tail[1] = T, sequence[0]


def _own_status(a) -> int:
    """This rank's status: its words, or where they hold no error the host's mirror (hier.hip: own_status)."""
    status = int(mem(a.status, (4,), np.uint32)[0])
    return status if status != STATUS_OK or not a.mirror else int(mem(a.mirror, (4,), np.uint32)[0])


def hier_seal(backend, a) -> None:
    mem(a.sequence, (4,), np.uint32)[1] = _own_status(a)  # combine's seal: our status goes home with the sums


def hier_localize(backend, a) -> None:
    M, k, me, L = a.max_tokens, a.top_k, a.node, a.node_experts
    seq = int(mem(a.sequence, (4,), np.uint32)[0])
    status = Status(a.status, a.mirror)
    out = mem(a.local_indices, (a.nodes, M, k), np.int32)
    out_w = mem(a.local_weights, (a.nodes, M, k), np.float32)
    out[:], out_w[:] = -1, 0
    for region in range(a.nodes):
        indices, weights, tail = _record(a, region)
        if region != me and int(tail[1]) != seq:  # that node's rank in our place never sent this call's region
            status.report(STATUS_TIMEOUT, region * a.ranks_per_node + a.place,
                          WAIT_NODES if a.whole else WAIT_NODES_RECORDS, seq)
            continue
        T = int(tail[0])
        rows = indices[:T]
        valid = valid_slots(rows, a.num_experts)
        if region == me and not valid.all():  # ours to report, as a flat dispatch reports it
            pos = int(np.flatnonzero(~valid)[0])
            status.report(STATUS_BAD_INDEX, me, pos, int(rows.flat[pos]))
        here = valid & (rows // L == me)
        out[region, :T] = np.where(here, rows % L, -1)
        out_w[region, :T] = weights[:T]


def _hier_sum(backend, a, dtype) -> None:
    N, me, T, H, M = a.nodes, a.node, a.tokens, a.hidden, a.max_tokens
    seq = int(mem(a.sequence, (4,), np.uint32)[0])
    seals = mem(a.seals, (N, 4), np.uint32)
    status = Status(a.status, a.mirror)
    out = mem(a.out, (T, H), dtype)
    reported = False
    for r in range(N):
        peer = r * a.ranks_per_node + a.place
        if r != me and int(seals[r, 0]) != seq:  # its sums never came
            status.report(STATUS_TIMEOUT, peer, WAIT_NODES_COMBINE, seq)
            reported = True
        elif r != me and int(seals[r, 1]) != STATUS_OK:  # they came from a rank whose call had failed
            status.report(STATUS_PEER, peer, WAIT_NODES_COMBINE, int(seals[r, 1]))
            reported = True
    if reported or int(mem(a.sequence, (4,), np.uint32)[1]) != STATUS_OK:  # (our status as the seal took it)
        out.view(np.uint8)[...] = 0xFF  # NaN rows: a failed call's y never reads as data
        return
    acc = mem(a.own, (T, H), dtype).astype(np.float32)
    partials = mem(a.partials, (N, M, H), dtype)
    for r in range(N):
        if r != me:
            acc += partials[r, :T].astype(np.float32)
    out[:] = acc.astype(dtype)


hier_sum_f16, hier_sum_bf16 = f16_and_bf16(_hier_sum)
