"""NumPy oracle of dispatch and combine for the whole world, obviously correct rather than fast, per the contract:

    expert e lives on rank e // L, as local expert e % L   (L = E / W)
    dispatch: rank r's local expert l receives x[s][t], tagged (s, t, j), for every indices[s][t, j] == r * L + l
    combine:  y[s][t] = sum_j weights[s][t, j] * expert_y_row(s, t, j)

fp8 dispatch moves e4m3 codes with a float32 scale per 128 elements (quantize_fp8); experts read code * scale."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from .dtypes import FP8_BLOCK


@dataclass
class ExpectedDispatch:
    """One rank's expected dispatch output, order-free: rows keyed by (src_rank, src_token, src_k)."""
    expert_num_tokens: np.ndarray          # int32 [L]
    rows: list[dict[tuple[int, int, int], np.ndarray]]  # per local expert: meta -> token vector
    scales: list[dict[tuple[int, int, int], np.ndarray]] | None = None  # fp8: meta -> the row's scales


def dispatch(xs: list[np.ndarray], indices: list[np.ndarray], num_experts: int,
             scales: list[np.ndarray] | None = None) -> list[ExpectedDispatch]:
    """`scales`: in fp8 dispatch, every rank's [T, H / 128] scales of its fp8 rows `xs`."""
    world = len(xs)
    L = num_experts // world
    out = [ExpectedDispatch(np.zeros(L, np.int32), [dict() for _ in range(L)],
                            None if scales is None else [dict() for _ in range(L)]) for _ in range(world)]
    for src in range(world):
        for t in range(indices[src].shape[0]):
            for j in range(indices[src].shape[1]):
                e = int(indices[src][t, j])
                dst, local = divmod(e, L)
                out[dst].expert_num_tokens[local] += 1
                out[dst].rows[local][(src, t, j)] = xs[src][t]
                if scales is not None:
                    out[dst].scales[local][(src, t, j)] = scales[src][t]
    return out


def contiguous_offsets(counts: np.ndarray, row_align: int) -> np.ndarray:
    """row_layout="contiguous": where each local expert's rows start in the one [R, H] buffer, [L + 1] int32: after
    the rows of every expert before it, each expert's rounded up to a multiple of row_align."""
    rounded = -(-np.asarray(counts, np.int64) // row_align) * row_align
    return np.concatenate([[0], np.cumsum(rounded)]).astype(np.int32)


def fp8_largest(dtype) -> np.float32:
    import ml_dtypes
    return np.float32(ml_dtypes.finfo(dtype).max)


def to_fp8(values: np.ndarray, dtype) -> np.ndarray:
    """float32 values in fp8 `dtype` (ml_dtypes): to nearest even, saturating at the largest finite value."""
    largest = fp8_largest(dtype)
    with np.errstate(invalid="ignore"):  # NaN stays NaN
        return np.clip(np.asarray(values, np.float32), -largest, largest).astype(dtype)


def quantize_fp8(x: np.ndarray, dtype) -> tuple[np.ndarray, np.ndarray]:
    """16-bit x [T, H] as fp8 codes and float32 scales [T, H / 128], per block in float32: scale = amax / largest, codes
    = to_fp8(x * (largest / amax)); amax 0 or < 2^-112: zeros, scale 0; a NaN or inf in the block: all NaN."""
    dtype = np.dtype(dtype)
    T, H = x.shape
    blocks = x.astype(np.float32).reshape(T, H // FP8_BLOCK, FP8_BLOCK)
    with np.errstate(invalid="ignore"):
        amax = np.abs(blocks).max(axis=2, initial=np.float32(0))  # NaN if the block holds one
    finite = np.isfinite(amax)
    used = finite & (amax >= np.float32(2.0 ** -112))
    largest = fp8_largest(dtype)
    safe = np.where(used, amax, np.float32(1)).astype(np.float32)
    inv = np.where(used, largest / safe, np.float32(0)).astype(np.float32)
    scales = np.where(used, safe / largest, np.float32(0)).astype(np.float32)
    scales[~finite] = np.nan
    with np.errstate(invalid="ignore"):
        codes = to_fp8(blocks * inv[..., None], dtype)
    codes[~finite] = np.array(np.nan, np.float32).astype(dtype)  # (one NaN code for the whole block)
    return codes.reshape(T, H), scales


def dequantize_fp8(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """What the experts read from fp8 rows: code * its block's scale, in float32."""
    return (codes.astype(np.float32) * np.repeat(scales.astype(np.float32), FP8_BLOCK, axis=-1)).astype(np.float32)


def fake_expert_scale(expert_rank: int) -> int:
    """The factor of gpu-mode's fake expert on each rank."""
    return 1 + expert_rank


def fake_expert(x_row: np.ndarray, expert_rank: int, alone: bool = False, out_dtype=None) -> np.ndarray:
    """gpu-mode's stand-in for the grouped GEMM: x * (1 + rank), rounded to out_dtype (default: x's dtype)."""
    out_dtype = x_row.dtype if out_dtype is None else out_dtype
    return (x_row.astype(np.float32) * np.float32(fake_expert_scale(expert_rank))).astype(out_dtype)


def fp8_fake_expert(out_dtype):
    """gpu-mode's fake expert on dequantized (float32) fp8 rows, rounded to the 16-bit out_dtype."""
    return functools.partial(fake_expert, out_dtype=np.dtype(out_dtype))


def fused_expert(scales):
    """The expert of combine(expert_y=x, w, expert_scale=scales[r]): the scale joins the weight in fp32 (x * scale
    unrounded), except a row crossing to its owner alone, rounded to x's dtype as an expert kernel would."""
    def expert(x_row: np.ndarray, expert_rank: int, alone: bool = False) -> np.ndarray:
        scale = np.float32(scales[expert_rank])
        if alone:
            return (x_row.astype(np.float32) * scale).astype(x_row.dtype)
        return x_row.astype(np.float64) * float(scale)
    return expert


def parts_by_rank(xs, indices, weights, num_experts: int, src: int, t: int, expert=fake_expert):
    """Token t of rank src split by host rank: (rank, slots there, their weighted sum in float64) per host."""
    world = len(xs)
    L = num_experts // world
    out = []
    for r in range(world):
        slots = [j for j in range(indices[src].shape[1]) if int(indices[src][t, j]) // L == r]
        if slots:
            row = expert(xs[src][t], r, r != src and len(slots) == 1).astype(np.float64)
            out.append((r, slots, sum(float(weights[src][t, j]) * row for j in slots)))
    return out


def _summed_parts(xs, indices, weights, num_experts: int, expert, ranks, term) -> list:
    """[T, H] float64 per source rank (None outside `ranks`, if given): each token's sum of term(part, narrow) over its
    parts, narrow where narrow_partials rounds the part to 16 bits (a peer's sum of 2+ experts; one row goes raw)."""
    def of(src):
        T, H = indices[src].shape[0], xs[src].shape[1]
        total = np.zeros((T, H), np.float64)
        for t in range(T):
            for r, slots, part in parts_by_rank(xs, indices, weights, num_experts, src, t, expert):
                total[t] += term(part, r != src and len(slots) >= 2)
        return total
    return [of(src) if ranks is None or src in ranks else None for src in range(len(xs))]


def combine(xs, indices, weights, num_experts: int, expert=fake_expert, ranks=None,
            partials_dtype=None) -> list[np.ndarray]:
    """Expected y per rank in float64, for `expert(x_row, expert_rank, alone)`; `partials_dtype`: narrow_partials'
    rounding of each partial sum crossing narrow; `ranks`: only those source ranks (the others get None)."""
    def term(part, narrow):
        return part.astype(partials_dtype).astype(np.float64) if narrow and partials_dtype is not None else part
    return _summed_parts(xs, indices, weights, num_experts, expert, ranks, term)


def narrow_partials_slack(xs, indices, weights, num_experts: int, unit_roundoff: float, expert=fake_expert,
                          ranks=None) -> list[np.ndarray]:
    """Per rank [T, H]: bound on |combine(partials_dtype=...) - combine()|, sum of unit_roundoff * |p| per narrow p."""
    def term(part, narrow):
        return unit_roundoff * np.abs(part) if narrow else 0.0
    return _summed_parts(xs, indices, weights, num_experts, expert, ranks, term)
