"""Bytes each rank sends over links in one dispatch + combine, as the kernels move them.

Mirrors kernels_hip/dispatch.hip and combine.hip: dispatch sends every peer a header (routing rows
with their places, the token count, and for each route chunk its count for each of the peer's
experts), and each token crosses once to every other rank hosting one
of its experts (that rank pulls it); combine sends every peer the weights
(or, when dispatch takes them, dispatch sends each slot's weight to its
expert's rank), and one contribution per (token, expert rank) crosses back to the owner (it
pulls it): the raw row when that rank hosts one of the token's experts, a
partial sum when it hosts several (fp32, or the output's format with
narrow partials). A rank whose call has at most
`push_max_tokens` tokens pushes instead: its tokens (unless `push_tokens` is
False: AllToAll.push_tokens), and the contributions to them, cross as tagged
words (4 bytes of data in 8). Flags (4 bytes per segment) are not counted. Used by
scripts/bench.py for link bandwidth and speed of light.
"""
from __future__ import annotations

import numpy as np

TAGGED = 8  # bytes of one tagged word (value and epoch), how headers and weights travel


def link_bytes(indices: list[np.ndarray], num_experts: int, hidden: int, in_itemsize: int = 2,
               out_itemsize: int = 2, push_max_tokens: int = 0, push_tokens: bool = True,
               narrow_partials: bool = False, count_chunks: int = 1,
               weights_at: str = "combine") -> tuple[np.ndarray, np.ndarray]:
    """(dispatch, combine): bytes each rank sends to other ranks. `count_chunks`: the route chunks whose
    counts every source sends (kernels.route_chunks); `weights_at`: the call that takes the weights."""
    world = len(indices)
    per_rank = num_experts // world
    partial_itemsize = out_itemsize if narrow_partials else 4
    dispatch, combine = np.zeros(world), np.zeros(world)
    for src, idx in enumerate(indices):
        T, k = idx.shape
        peers = world - 1
        widen = TAGGED // 4 if T <= push_max_tokens else 1  # pushed: 4 data bytes per tagged word
        dispatch[src] += peers * (T * k + 1 + per_rank * count_chunks) * TAGGED  # routing rows, T, counts
        ranks = idx // per_rank                           # [T, k] rank of each slot's expert
        if weights_at == "dispatch":                      # each slot's weight to its expert's rank
            dispatch[src] += np.count_nonzero(ranks != src) * TAGGED
        else:                                             # all of them to every peer
            combine[src] += peers * T * k * TAGGED
        for r in range(world):
            if r == src:
                continue
            n = (ranks == r).sum(axis=1)                  # experts of each token on rank r
            dispatch[src] += (widen if push_tokens else 1) * np.count_nonzero(n) * hidden * in_itemsize
            combine[r] += widen * (np.count_nonzero(n == 1) * out_itemsize + np.count_nonzero(n > 1) * partial_itemsize) * hidden
    return dispatch, combine
