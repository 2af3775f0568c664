"""NumPy oracle of dispatch and combine, for the whole world at once.

It takes every rank's inputs and returns every rank's expected outputs. It is
written to be obviously correct, not fast: plain loops over ranks, tokens and
slots, exactly as DESIGN.md states the contract.

    expert e lives on rank e // L, as local expert e % L   (L = E / W)
    dispatch: rank r's local expert l receives x[s][t] for every (s, t, j)
              with indices[s][t, j] == r * L + l, tagged (s, t, j)
    combine:  y[s][t] = sum_j weights[s][t, j] * expert_y_row(s, t, j)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass
class ExpectedDispatch:
    """One rank's expected dispatch output, order-free: rows keyed by (src_rank, src_token, src_k)."""
    expert_num_tokens: np.ndarray          # int32 [L]
    rows: list[dict[tuple[int, int, int], np.ndarray]]  # per local expert: meta -> token vector


def dispatch(xs: list[np.ndarray], indices: list[np.ndarray], num_experts: int) -> list[ExpectedDispatch]:
    world = len(xs)
    L = num_experts // world
    out = [ExpectedDispatch(np.zeros(L, np.int32), [dict() for _ in range(L)]) for _ in range(world)]
    for src in range(world):
        for t in range(indices[src].shape[0]):
            for j in range(indices[src].shape[1]):
                e = int(indices[src][t, j])
                dst, l = divmod(e, L)
                out[dst].expert_num_tokens[l] += 1
                out[dst].rows[l][(src, t, j)] = xs[src][t]
    return out


def fake_expert(x_row: np.ndarray, expert_rank: int) -> np.ndarray:
    """gpu-mode's stand-in for the grouped GEMM: x * (1 + rank), rounded to x's dtype."""
    return (x_row.astype(np.float32) * np.float32(1 + expert_rank)).astype(x_row.dtype)


def for_sources(count: int, ranks, per_source) -> list:
    """[per_source(src) for every source rank], None for those outside `ranks` (None: all of them)."""
    return [per_source(src) if ranks is None or src in ranks else None for src in range(count)]


def combine(xs, indices, weights, num_experts: int, expert=fake_expert, ranks=None) -> list[np.ndarray]:
    """Expected y per rank in float64, given `expert(x_row, expert_rank) -> y_row`.

    `ranks` limits the work to those source ranks (the others get None)."""
    L = num_experts // len(xs)

    def y_of(src):
        T, k = indices[src].shape
        y = np.zeros((T, xs[src].shape[1]), np.float64)
        for t in range(T):
            for j in range(k):
                expert_rank = int(indices[src][t, j]) // L
                row = expert(xs[src][t], expert_rank).astype(np.float64)
                y[t] += float(weights[src][t, j]) * row
        return y

    return for_sources(len(xs), ranks, y_of)


def narrow_partials_slack(xs, indices, weights, num_experts: int, unit_roundoff: float, expert=fake_expert,
                          ranks=None) -> list[np.ndarray]:
    """Per rank [T, H]: how far combine may move off the oracle when partial sums cross in the output's
    16-bit format (AllToAll(narrow_partials=True)) on top of the usual tolerance.

    Each rank r other than the token's owner that hosts two or more of the token's experts rounds
    its partial sum p_r = sum over those slots of weights * row once: at most unit_roundoff * |p_r|
    (round to nearest). The owner's own experts and single rows (sent raw) are not rounded."""
    world = len(xs)
    L = num_experts // world

    def slack_of(src):
        T, k = indices[src].shape
        slack = np.zeros((T, xs[src].shape[1]), np.float64)
        for t in range(T):
            for r in range(world):
                slots = [j for j in range(k) if int(indices[src][t, j]) // L == r]
                if r == src or len(slots) < 2:
                    continue
                part = sum(float(weights[src][t, j]) * expert(xs[src][t], r).astype(np.float64) for j in slots)
                slack[t] += unit_roundoff * np.abs(part)
        return slack

    return for_sources(world, ranks, slack_of)
