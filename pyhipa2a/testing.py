"""Checking dispatch/combine against the oracle under MPI (tests, scripts/check.py, bench --check): every rank draws
all inputs from one seed and computes the oracle itself; outputs are poisoned (all bits set) so unwritten rows fail."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from . import reference
from .bootstrap import bounded_barrier
from .dtypes import resolve

TOLERANCE = {"float16": (2e-3, 1e-3), "bfloat16": (1.6e-2, 1e-2)}  # vs the float64 oracle: fp32 sums rounded once
GPU_MODE_TOLERANCE = (1e-2, 5e-3)  # gpu-mode's allclose(rtol, atol)
UNIT_ROUNDOFF = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}  # half an ulp at 1.0: one rounding's relative bound


@dataclass
class WorldInputs:
    xs: list[np.ndarray]        # per rank [T_r, H]
    indices: list[np.ndarray]   # per rank [T_r, k] int32
    weights: list[np.ndarray]   # per rank [T_r, k] float32
    x_scales: list[np.ndarray] | None = None  # fp8 xs: per rank [T_r, H / 128] float32

    def quantized(self, fp8_dtype) -> "WorldInputs":
        """These tokens in fp8 with scales, as AllToAll(in_dtype=fp8) takes them; outputs must match quantizing."""
        pairs = [reference.quantize_fp8(x, fp8_dtype) for x in self.xs]
        return WorldInputs([c for c, _ in pairs], self.indices, self.weights, [s for _, s in pairs])


def dispatch(a2a, inputs: WorldInputs, **kw):
    r = a2a.rank
    scales = None if inputs.x_scales is None else inputs.x_scales[r]
    return a2a.dispatch(inputs.xs[r], inputs.indices[r], x_scales=scales, **kw)


def dispatched_tokens(a2a, inputs: WorldInputs):
    """Every rank's tokens as a2a's dispatch delivers them: (rows, scales), scales None unless fp8."""
    if not a2a.config.scale_cols:
        return inputs.xs, None
    fp8 = inputs if inputs.x_scales is not None else inputs.quantized(a2a.config.dispatch_dtype)
    return fp8.xs, fp8.x_scales


def expert_rows(a2a, inputs: WorldInputs) -> list[np.ndarray]:
    """Every rank's tokens as the experts read them: the 16-bit rows, or fp8 rows times their scales."""
    rows, scales = dispatched_tokens(a2a, inputs)
    return rows if scales is None else [reference.dequantize_fp8(c, sc) for c, sc in zip(rows, scales)]


def dtype_arguments(dtype="float16", dispatch_dtype=None, fp8_input: str = "quantize") -> dict:
    """AllToAll's dtype arguments: `dtype` throughout, or fp8 dispatch of x "quantize"d or "given" in fp8."""
    if dispatch_dtype is None or dispatch_dtype == dtype:
        return dict(in_dtype=dtype)
    if fp8_input == "quantize":
        return dict(in_dtype=dtype, dispatch_dtype=dispatch_dtype)
    return dict(in_dtype=dispatch_dtype, out_dtype=dtype)


def layout_arguments(spec: str = "packed") -> dict:
    """AllToAll's row-layout arguments from a test's spec: "packed", "by_source", "contiguous", or
    "contiguous/A" and "contiguous/A/R" (row_align A, max_recv_rows R)."""
    name, *numbers = spec.split("/")
    names = ("row_align", "max_recv_rows")[:len(numbers)]
    return {"row_layout": name, **{n: int(v) for n, v in zip(names, numbers)}}


def inputs_as_given(a2a, inputs: WorldInputs, fp8_input: str = "quantize") -> WorldInputs:
    """The inputs as a2a takes them: with fp8 given, the same tokens quantized, with their scales."""
    return inputs.quantized(a2a.config.dispatch_dtype) if a2a.config.scale_cols and fp8_input == "given" else inputs


def draw_routing(rng, T: int, k: int, E: int, routing: str = "random") -> np.ndarray:
    """k distinct experts per token. 'hot': every token picks expert 0 first (one expert's worst case)."""
    if routing not in ("random", "hot"):
        raise ValueError(f"unknown routing {routing!r}")
    idx = np.argsort(rng.random((T, E)), axis=1)[:, :k].astype(np.int32)
    if routing == "hot":
        has0 = (idx == 0).any(axis=1)
        idx[~has0, 0] = 0            # put expert 0 into every row, keeping rows distinct
    return idx


def draw_world(seed: int, world: int, num_experts: int, top_k: int, hidden: int, max_tokens: int,
               dtype="float16", token_counts=None, routing: str = "random", exact: bool = False) -> WorldInputs:
    """gpu-mode's recipe: T_r in [1, M) unless given, x ~ N(0, 1), weights ~ U[0, 1). exact=True: x = n/64 (|n| <
    2^(p-1), p significant bits), weights = m/16 (|m| <= 16), so combine's fp32 sums are exact (<= 8 ranks, top-8)."""
    rng = np.random.default_rng(seed)
    dtype = resolve(dtype)
    if exact and (world > 8 or top_k > 8):
        raise ValueError("exact inputs keep fp32 sums exact for at most 8 ranks and top-8")
    if token_counts is None:
        token_counts = rng.integers(1, max(max_tokens, 2), size=world)
    half_range = int(0.5 / UNIT_ROUNDOFF[dtype.name])  # 2^(p-1) (u = 2^-p): every |n| below it is exact
    xs, indices, weights = [], [], []
    for r in range(world):
        T = int(token_counts[r])
        if exact:
            xs.append((rng.integers(-half_range + 1, half_range, (T, hidden)) / 64.0).astype(dtype))
            weights.append((rng.integers(-16, 17, (T, top_k)) / 16.0).astype(np.float32))
        else:
            xs.append(rng.standard_normal((T, hidden), dtype=np.float32).astype(dtype))
            weights.append(rng.random((T, top_k), dtype=np.float32))
        indices.append(draw_routing(rng, T, top_k, num_experts, routing))
    return WorldInputs(xs, indices, weights)


def host_copy(a) -> np.ndarray:
    """A host copy of an output, once what wrote it is done: ours (DeviceArray, which raises a failed call's
    error), or PyTorch's, CuPy's or JAX's (pyhipa2a.outputs hands those out; a failed call left poison)."""
    if isinstance(a, np.ndarray):
        return a
    module = type(a).__module__.partition(".")[0]
    if module == "torch":
        import torch
        t = a.detach().cpu()
        if t.dtype == torch.bfloat16:  # (NumPy has no bfloat16 of PyTorch's: through its bits)
            return t.view(torch.int16).numpy().view(resolve("bfloat16"))
        return t.numpy()
    if module == "cupy":
        import cupy
        return cupy.asnumpy(a)
    if module in ("jax", "jaxlib"):
        return np.asarray(a)
    return a.numpy()


def poison(a2a) -> None:
    """Every output byte this rank sees to 0xFF, between barriers: peers may still pull from us, then write to us."""
    a2a.synchronize()  # the last call's stream: every earlier call is queued before it
    comm = getattr(a2a, "comm", None) or a2a.heap.comm  # across nodes: every rank of every node
    bounded_barrier(comm, a2a.config.timeout, "poison")
    for name in ("recv_x", "recv_meta", "recv_scales", "num_tokens", "y", "stage", "tok_hdr", "w_in", "contrib",
                 "rows", "slot_of", "layout", "offsets", "expert_totals", "row_starts"):
        a2a.buffers[name].fill_bytes(0xFF)  # no stream: done when it returns
    for scratch in getattr(a2a, "exchange_buffers", ()):  # across nodes: regions, records, sums, seals
        scratch.fill_bytes(0xFF)
    a2a.expert_y_buffer().fill_bytes(0xFF)  # on a2a.stream
    a2a.backend.stream_synchronize(a2a.stream)
    bounded_barrier(comm, a2a.config.timeout, "poison")


def check_dispatch_against_oracle(a2a, inputs: WorldInputs, result) -> None:
    c, rank = a2a.config, a2a.rank
    if (result.expert_layout is not None, result.expert_offsets is not None) != (c.by_source, c.contiguous):
        raise AssertionError(f"row_layout={c.row_layout!r} but expert_layout is {result.expert_layout!r} and "
                             f"expert_offsets {result.expert_offsets!r}")
    if tuple(result.expert_x.shape) != (*c.rows_shape, c.hidden):
        raise AssertionError(f"row_layout={c.row_layout!r} but expert_x is {tuple(result.expert_x.shape)}")
    tokens, token_scales = dispatched_tokens(a2a, inputs)
    expected = reference.dispatch(tokens, inputs.indices, c.num_experts, token_scales)[rank]
    counts = host_copy(result.expert_num_tokens)
    if not np.array_equal(counts, expected.expert_num_tokens):
        raise AssertionError(f"rank {rank}: expert_num_tokens {counts.tolist()} != "
                             f"expected {expected.expert_num_tokens.tolist()}")
    xs, meta = host_copy(result.expert_x), host_copy(result.expert_meta)
    scales = None if expected.scales is None else host_copy(result.expert_x_scales)
    H = xs.shape[-1]
    xs, meta = xs.reshape(-1, H), meta.reshape(-1, 3)  # (every layout's rows, as indices into these)
    scales = None if scales is None else scales.reshape(-1, scales.shape[-1])
    rows = received_rows(result, counts, meta, expected, rank, c.row_align if c.contiguous else 0)
    for local, want in enumerate(expected.rows):
        got = {tuple(int(v) for v in meta[i]): i for i in rows[local]}
        if set(got) != set(want):
            missing, extra = sorted(set(want) - set(got))[:5], sorted(set(got) - set(want))[:5]
            raise AssertionError(f"rank {rank} expert {local}: rows keyed by (src, token, slot) differ; "
                                 f"missing {missing}, unexpected {extra}")
        for key, i in got.items():
            if xs[i].tobytes() != want[key].tobytes():
                raise AssertionError(f"rank {rank} expert {local} row {i} {key}: token vector differs")
            if scales is not None and scales[i].tobytes() != expected.scales[local][key].tobytes():
                raise AssertionError(f"rank {rank} expert {local} row {i} {key}: scales {scales[i][:4]}... differ "
                                     f"from {expected.scales[local][key][:4]}...")


def received_rows(result, counts: np.ndarray, meta: np.ndarray, expected: reference.ExpectedDispatch,
                  rank: int, row_align: int) -> list:
    """Each expert's rows, as indices into the flattened expert_x and `meta`: packed, an expert's first rows;
    contiguous, from its expert_offsets (checked against the oracle's); by source, each source's first rows from
    row s * M (expert_layout, checked against the oracle's)."""
    if result.expert_offsets is not None:
        offsets = host_copy(result.expert_offsets)
        want = reference.contiguous_offsets(expected.expert_num_tokens, row_align)
        if not np.array_equal(offsets, want):
            raise AssertionError(f"rank {rank}: expert_offsets {offsets.tolist()} != expected {want.tolist()} "
                                 f"(each expert's rows rounded up to {row_align})")
        return [range(int(offsets[local]), int(offsets[local]) + int(n)) for local, n in enumerate(counts)]
    capacity = result.expert_x.shape[1]
    if result.expert_layout is None:
        return [range(local * capacity, local * capacity + int(n)) for local, n in enumerate(counts)]
    layout = host_copy(result.expert_layout)
    L, W = layout.shape[:2]
    M = capacity // W
    rows = []
    for local in range(L):
        want = np.bincount(np.array([src for src, _, _ in expected.rows[local]], np.int64), minlength=W)
        want_layout = np.stack([np.arange(W) * M, want], axis=1)
        if not np.array_equal(layout[local], want_layout):
            raise AssertionError(f"rank {rank} expert {local}: expert_layout {layout[local].tolist()} != expected "
                                 f"{want_layout.tolist()} (first row, rows) by source")
        mine = [(s, local * capacity + s * M + i) for s in range(W) for i in range(int(want[s]))]
        wrong = [(s, row) for s, row in mine if meta[row, 0] != s]
        if wrong:
            s, row = wrong[0]
            raise AssertionError(f"rank {rank} expert {local}: row {row}, in source {s}'s rows, holds a token of "
                                 f"source {meta[row, 0]}")
        rows.append([row for _, row in mine])
    return rows


def combine_error(y: np.ndarray, expected: np.ndarray, dtype, tolerance=None, slack=None) -> float:
    """Largest |y - expected|; raises outside the tolerance (of `dtype` unless given) plus `slack` if given."""
    rtol, atol = tolerance or TOLERANCE[resolve(dtype).name]
    got = y.astype(np.float64)
    if got.shape != expected.shape:
        raise AssertionError(f"combine output shape {got.shape} != expected {expected.shape}")
    # Where the oracle itself is NaN (non-finite inputs), y must be NaN; everywhere else NaN poison fails.
    nan_wanted = np.isnan(expected)
    if not np.array_equal(np.isnan(got) & nan_wanted, nan_wanted):
        at = tuple(np.argwhere(nan_wanted & ~np.isnan(got))[0])
        raise AssertionError(f"combine at {at} is {got[at]}; the oracle says NaN (a NaN or inf input)")
    expected = np.where(nan_wanted, 0.0, expected)
    got = np.where(nan_wanted, 0.0, got)
    err = np.abs(got - expected)
    allowed = atol + rtol * np.abs(expected) + (0.0 if slack is None else slack)
    if got.size and not np.all(err <= allowed):  # NaN poison fails here too
        bad = tuple(np.argwhere(~(err <= allowed))[0])
        extra = "" if slack is None else f", narrow partials' slack {float(slack[bad]):.3g}"
        raise AssertionError(f"combine mismatch at {bad}: got {got[bad]}, "
                             f"expected {expected[bad]} (rtol {rtol}, atol {atol}{extra})")
    return float(err.max()) if got.size else 0.0


_OWN_STREAM = object()


def in_x_buffer(a2a, x: np.ndarray):
    """Host rows `x` written into the first len(x) rows of a2a.x_buffer(), which it returns: where the peers
    read a dispatch's x (x in the heap)."""
    rows = a2a.x_buffer().rows(len(x))
    rows.copy_from(x)
    return rows


def upload_inputs(a2a, inputs: WorldInputs, stream=_OWN_STREAM) -> list:
    """This rank's inputs in DeviceArrays of their own, on a2a's stream unless given (None: none); see free_inputs."""
    from .array import DeviceArray
    b, r = a2a.backend, a2a.rank
    stream = a2a.stream if stream is _OWN_STREAM else stream
    arrays = []
    hosts = [inputs.xs[r], inputs.indices[r], inputs.weights[r]]
    for host in hosts + ([] if inputs.x_scales is None else [inputs.x_scales[r]]):
        arr = DeviceArray(b, b.malloc_ipc(max(host.nbytes, 1)), host.shape, host.dtype, stream=stream)
        arr.copy_from(host)
        arrays.append(arr)
    return arrays


def dispatch_uploaded(a2a, arrays, **kw):
    x, indices, _, *scales = arrays
    return a2a.dispatch(x, indices, x_scales=scales[0] if scales else None, **kw)


def free_inputs(a2a, arrays) -> None:
    for arr in arrays:
        a2a.backend.free(arr.ptr)


@contextlib.contextmanager
def fused_step_graph(a2a, inputs: WorldInputs):
    """The graph of gpu-mode's fused step (dispatch, then combine with expert_scale 1 + rank) on this rank's
    inputs in arrays of their own; the graph and the arrays go on exit."""
    arrays = upload_inputs(a2a, inputs)
    try:
        graph = a2a.capture(lambda: fused_combine(a2a, dispatch_uploaded(a2a, arrays), arrays[2]))
        try:
            yield graph
        finally:
            graph.close()
    finally:
        a2a.synchronize()
        free_inputs(a2a, arrays)


def oracle_expert(a2a, fused: bool):
    """The oracle's fake expert: a kernel of its own (on fp8 rows fp8_fake_expert), or fused into combine."""
    if fused:
        return reference.fused_expert([reference.fake_expert_scale(r) for r in range(a2a.world)])
    return reference.fp8_fake_expert(a2a.config.out_dtype) if a2a.config.scale_cols else reference.fake_expert


def fused_combine(a2a, result, weights, **kw):
    """gpu-mode's fake expert fused into combine (expert_x stands in for expert_y: in_dtype must be out_dtype)."""
    return a2a.combine(result.expert_x, weights, expert_scale=reference.fake_expert_scale(a2a.rank), **kw)


def combine_error_against_oracle(a2a, inputs: WorldInputs, y, tolerance=None, expert=reference.fake_expert) -> float:
    """This rank's combine output `y` against the oracle of `expert`: the largest error (raises outside tolerance)."""
    rank = a2a.rank
    xs = expert_rows(a2a, inputs)
    expected = reference.combine(xs, inputs.indices, inputs.weights, a2a.config.num_experts, expert, ranks=[rank])[rank]
    slack = None
    if a2a.config.narrow_partials and tolerance is None:  # a tolerance given (gpu-mode's) holds as it is
        slack = reference.narrow_partials_slack(xs, inputs.indices, inputs.weights, a2a.config.num_experts,
                                                UNIT_ROUNDOFF[a2a.config.out_dtype.name], expert, ranks=[rank])[rank]
    return combine_error(host_copy(y), expected, a2a.config.out_dtype, tolerance, slack)


def check_combine_exact(a2a, inputs: WorldInputs, y, expert=reference.fake_expert) -> int:
    """exact=True inputs: `y` must equal the oracle of a2a's partials mode; returns how many fp32/narrow ones differ."""
    rank, dtype = a2a.rank, a2a.config.out_dtype

    def oracle(partials_dtype):
        return reference.combine(inputs.xs, inputs.indices, inputs.weights, a2a.config.num_experts, expert,
                                 ranks=[rank], partials_dtype=partials_dtype)[rank].astype(dtype)
    wide, narrow = oracle(None), oracle(dtype)
    want, got = (narrow if a2a.config.narrow_partials else wide), host_copy(y)
    if got.shape != want.shape:
        raise AssertionError(f"rank {rank}: combine output shape {got.shape} != expected {want.shape}")
    same = got.astype(np.float64) == want.astype(np.float64)  # the NaN poison is never equal
    if not same.all():
        at = tuple(np.argwhere(~same)[0])
        raise AssertionError(f"rank {rank}: combine at {at} is {got[at]}, the exact oracle says {want[at]} "
                             f"(narrow_partials={a2a.config.narrow_partials}; with fp32 partials it would be "
                             f"{wide[at]}, with narrow ones {narrow[at]})")
    return int(np.count_nonzero(wide.astype(np.float64) != narrow.astype(np.float64)))


def check_call(a2a, inputs: WorldInputs, result, y, tolerance=None, fused: bool = False) -> float:
    """Check a finished call (dispatch views, combine output `y`) against the oracle; the largest combine error."""
    check_dispatch_against_oracle(a2a, inputs, result)
    return combine_error_against_oracle(a2a, inputs, y, tolerance, oracle_expert(a2a, fused))


def step_buffers(a2a, T: int):
    """The caller's own device arrays (x, indices, weights, y) for a captured step of T tokens; see free_buffers."""
    from .array import DeviceArray
    H, k, b = a2a.config.hidden, a2a.config.top_k, a2a.backend

    def device(shape, dtype):
        nbytes = max(1, int(np.prod(shape)) * np.dtype(dtype).itemsize)
        return DeviceArray(b, b.malloc_ipc(nbytes), shape, dtype, stream=a2a.stream, device_id=a2a.heap.device.index)
    return (device((T, H), a2a.config.in_dtype), device((T, k), np.int32), device((T, k), np.float32),
            device((T, H), a2a.config.out_dtype))


def free_buffers(a2a, buffers) -> None:
    a2a.synchronize()
    free_inputs(a2a, buffers)


def replay_checked(a2a, graph, inputs: WorldInputs, buffers, result) -> float:
    """Inputs into step_buffers, poison, replay `graph`, check against the oracle: the largest combine error."""
    x, idx, w, y = buffers
    me = a2a.rank
    for arr, host in zip((x, idx, w), (inputs.xs[me], inputs.indices[me], inputs.weights[me])):
        arr.copy_from(host)
    poison(a2a)
    y.fill_bytes(0xFF)
    graph.launch()
    a2a.synchronize()
    return check_call(a2a, inputs, result, y)


WEIGHTS_AT = ("combine", "dispatch")  # where a call hands over the gate's weights


def weights_where(weights, weights_at: str) -> tuple[dict, object]:
    """(dispatch's keyword arguments, combine's weights) for weights handed over at `weights_at`."""
    if weights_at not in WEIGHTS_AT:
        raise ValueError(f"weights_at must be one of {WEIGHTS_AT}, got {weights_at!r}")
    return ({"weights": weights}, None) if weights_at == "dispatch" else ({}, weights)


def run_round(a2a, inputs: WorldInputs, *, check: bool = True, tolerance=None, fused: bool = False,
              weights_at: str = "combine") -> float:
    """Poison, dispatch, fake expert (fused into combine when `fused`), combine, check: the largest combine error."""
    rank = a2a.rank
    if check:
        poison(a2a)
    to_dispatch, w = weights_where(inputs.weights[rank], weights_at)
    result = dispatch(a2a, inputs, **to_dispatch)
    expert_y = None if fused else a2a.fake_expert(result)
    if check:
        a2a.synchronize()
        check_dispatch_against_oracle(a2a, inputs, result)
    y = fused_combine(a2a, result, w) if fused else a2a.combine(expert_y, w)
    a2a.synchronize()
    if not check:
        return float("nan")
    return combine_error_against_oracle(a2a, inputs, y, tolerance, oracle_expert(a2a, fused))


def script_verdict(comm, script: str, ok: bool, result: dict, json_path: str | None, before=None) -> int:
    """A checking script's end: `before()` then "<script>: PASS (or FAIL) on N ranks" and the JSON `result` on
    rank 0; the exit code (0 only where every rank passed)."""
    import json
    oks = comm.allgather(bool(ok))
    if comm.Get_rank() == 0:
        if before is not None:
            before()
        print(f"{script}: " + ("PASS" if all(oks) else "FAIL") + f" on {len(oks)} ranks", flush=True)
        if json_path:
            with open(json_path, "w") as f:
                json.dump(result, f, indent=1)
    return 0 if all(oks) else 1


def failure_line(rank: int, error: BaseException, what: str = "") -> str:
    """'rank r<what>: Type: the message's first line', the line scripts gather from every failed rank."""
    return f"rank {rank}{what}: {type(error).__name__}: {(str(error).splitlines() or [''])[0]}"
