"""Bytes each rank sends over links in one dispatch + combine, as kernels_hip/dispatch.hip and combine.hip move them.
Dispatch: a header to every peer (routing rows, token count, chunk counts), each token once to every other rank hosting
its experts. Combine: the weights to every peer (unless dispatch sent each to its expert's rank), one contribution per
(token, expert rank) back: a raw row, or a partial sum of several (fp32; 16-bit when narrow). Calls of at most
push_max_tokens push tokens (if push_tokens) and contributions as tagged words (4 data bytes in 8), flags uncounted."""
from __future__ import annotations

import numpy as np

TAGGED = 8  # bytes of one tagged word (value and epoch), how headers and weights travel


def link_bytes(indices: list[np.ndarray], num_experts: int, hidden: int, in_itemsize: int = 2,
               out_itemsize: int = 2, push_max_tokens: int = 0, push_tokens: bool = True,
               narrow_partials: bool = False, count_chunks: int = 1,
               weights_at: str = "combine") -> tuple[np.ndarray, np.ndarray]:
    """(dispatch, combine) bytes each rank sends; `count_chunks`: kernels.route_chunks; `weights_at`: weights' call."""
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
            combine[r] += widen * (np.count_nonzero(n == 1) * out_itemsize
                                   + np.count_nonzero(n > 1) * partial_itemsize) * hidden
    return dispatch, combine
