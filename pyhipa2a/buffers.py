"""One node exchange's symmetric buffers (the same order and offsets on every rank), the kernels' fixed
arguments over them, the status words (pinned host memory: read without a copy or a wait), the views.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .array import DeviceArray, Pinned
from .config import MAX_GRID_BLOCKS, Config, combine_send_percent
from .kernels import GROUP_STRIPES, MAX_GROUPS, A2AArgs, HeapView, divisor, route_chunk, route_chunks, timeout_ns
from .clock import CLOCK_ROUNDS
from .profile import ProfileBuffer


def layout(config: Config) -> list[tuple[str, tuple, object]]:
    """Every symmetric buffer, in allocation order (identical on all ranks)."""
    W, L, M, k, H = config.world, config.local_experts, config.max_tokens, config.top_k, config.hidden
    S, P, C, rows = config.nseg, config.push_room, config.scale_cols, config.rows_shape
    return [
        # written by peers, as tagged words (value in the low half, epoch in the high half); headers
        # alternate by epoch parity
        ("tok_hdr", (2, W, M, k), np.uint64),
        ("tok_count", (2, W), np.uint64),
        ("expert_counts", (2, W, route_chunks(k, M), L), np.uint64),  # by source and route chunk
        ("w_in", (W, M, k), np.uint64),
        ("stage_flag", (2, W, M, S), np.uint32),   # flags of the data below, in the reader's memory
        ("contrib_flag", (W, M, S), np.uint32),
        # read by peers (they pull): staged tokens by parity, contributions by owner
        ("stage", (2, M, config.token_bytes), np.uint8),
        ("contrib", (W, M, 4 * H), np.uint8),   # a partial sum (fp32, or 16-bit if narrow), or one raw row
        # written by peers when a call pushes: tagged words of tokens, and of contributions
        ("push_tok", (2, W, P, config.push_token_words), np.uint64),
        ("push_contrib", (W, P, config.push_row_words), np.uint64),
        # local
        ("recv_x", (*rows, H), config.dispatch_dtype),
        ("recv_meta", (*rows, 3), np.int32),
        ("recv_scales", (*rows, C), np.float32),
        ("num_tokens", (L,), np.int32),
        ("rows", (W, M, k), np.int32),
        ("slot_of", (W, M, k), np.int32),
        ("layout", (L, W, 2), np.int32),  # expert_layout (row_layout="by_source")
        # row_layout="contiguous": each expert's rows (tagged), first rows (tagged), expert_offsets
        ("expert_totals", (L,), np.uint64),
        ("row_starts", (L,), np.uint64),
        ("offsets", (L + 1,), np.int32),
        # dispatch(groups=): rows landed by warp stripe and group (cleared by combine); readiness words
        ("group_landed", (GROUP_STRIPES, MAX_GROUPS), np.uint32),
        ("group_ready", (MAX_GROUPS,), np.uint32),
        ("part_verdict", (1,), np.uint64),  # a combine part's: whether the rank had failed as it started
        ("work_items", (2, 2), np.uint64),  # the counters dispatch and combine hand out items from, one a parity
        ("epoch", (2,), np.uint32),
        ("status", (4,), np.uint32),
        # clock sync (kernels_hip/clock.hip): box r written by rank r; this rank's stamps with each rank;
        # rank 0's stamps with this rank and its host offset, and their flag; this rank's verdict
        ("clock_box", (W,), np.uint64),
        ("clock_stamps", (W, CLOCK_ROUNDS, 2), np.uint64),
        ("clock_from0", (2 * CLOCK_ROUNDS + 1,), np.uint64),
        ("clock_done", (1,), np.uint32),
        ("clock_verdict", (1,), np.uint32),
        # epoch: block b of the last dispatch / combine is done; last word: the block that poisons
        ("done", (2, MAX_GRID_BLOCKS + 1), np.uint32),
        # staging: NumPy inputs are copied here; y lands here unless out= is given
        ("x_stage", (M, H), config.in_dtype),
        ("x_scales_stage", (M, C), np.float32),
        ("indices_stage", (M, k), np.int32),
        ("weights_stage", (M, k), np.float32),
        ("y", (M, H), config.out_dtype),
    ]


def heap_bytes(config: Config) -> int:
    """The heap that holds layout(config), each buffer aligned as SymmetricHeap.alloc aligns it."""
    return sum(math.prod(shape) * np.dtype(dtype).itemsize + 256 for _, shape, dtype in layout(config))


@dataclass(frozen=True)
class DispatchResult:
    expert_num_tokens: DeviceArray  # int32 [L]
    expert_x: DeviceArray           # [L, W*M, H], or [R, H] contiguous
    expert_meta: DeviceArray        # int32 [L, W*M, 3] (or [R, 3]): (src_rank, src_token, src_k)
    num_tokens: int                 # T of this rank's call
    expert_x_scales: DeviceArray | None = None  # float32 [L, W*M, H / 128] (or [R, ...]) in fp8 dispatch, else None
    expert_layout: DeviceArray | None = None  # int32 [L, W, 2] by_source: (first row, rows) a source; or None
    expert_offsets: DeviceArray | None = None  # int32 [L + 1] contiguous: expert l's rows from expert_offsets[l]


class OutputViews:
    """One stream's views of an object's outputs, made once, with the DispatchResult of each token count:
    the views always show the same buffers, so no object is made on a call's path."""

    def __init__(self, num_tokens: DeviceArray, expert_x: DeviceArray, expert_meta: DeviceArray,
                 expert_x_scales: DeviceArray | None, y: DeviceArray, expert_layout: DeviceArray | None = None,
                 expert_offsets: DeviceArray | None = None):
        self.arrays = (num_tokens, expert_x, expert_meta)
        self.extras = (expert_x_scales, expert_layout, expert_offsets)
        self.y_rows = [y.rows(t) for t in range(y.shape[0] + 1)]  # y [T, H] of a call of T tokens
        self.results: list[DispatchResult | None] = [None] * len(self.y_rows)

    def dispatch_result(self, tokens: int) -> DispatchResult:
        result = self.results[tokens]
        if result is None:
            result = self.results[tokens] = DispatchResult(*self.arrays, tokens, *self.extras)
        return result

    def y(self, tokens: int) -> DeviceArray:
        return self.y_rows[tokens]


class Buffers:
    """The symmetric buffers of one node exchange (`buffers[name]`: a DeviceArray), its status words
    and, with profile=True, its timeline buffer."""

    def __init__(self, heap, config: Config):
        self.heap, self.config, backend = heap, config, heap.backend
        self.arrays = {name: heap.alloc(shape, dtype) for name, shape, dtype in layout(config)}
        heap.verify()
        self._status = Pinned(backend, (4,), np.uint32)
        self.status, self.status_device = self._status.host, self._status.device
        # Contiguous rows: where each expert's begin, for the host (dispatch(groups=) tells group_rows), as
        # tagged words (value, call ticket), so a word of an earlier call is never read as this one's
        self._host_offsets = Pinned(backend, (config.local_experts + 1,), np.uint64)
        self.host_offsets, self.host_offsets_device = self._host_offsets.host, self._host_offsets.device
        warps = config.blocks * max(1, config.block_threads // config.warp)
        self.profile = ProfileBuffer(backend, warps) if config.profile else None

    def __getitem__(self, name: str) -> DeviceArray:
        return self.arrays[name]

    def offset(self, name: str) -> int:
        return self.heap.offset_of(self.arrays[name].ptr)

    def exchange_args(self, args: A2AArgs) -> None:
        """The arguments every exchange kernel shares, fixed for the object's life."""
        c, heap = self.config, self.heap
        args.heap = HeapView.of(heap)
        args.local_base = heap.base
        for name in self.arrays:
            if hasattr(args, "off_" + name):
                setattr(args, "off_" + name, self.offset(name))
        for name in ("num_experts", "local_experts", "top_k", "max_tokens", "hidden", "token_bytes",
                     "push_token_words", "scale_cols", "x_format", "seg_elems", "nseg", "x_seg_elems", "x_nseg",
                     "push_max_tokens", "push_row_words", "post_min_tokens", "narrow_partials", "gpu_fence_publish",
                     "by_source", "void_slots", "region_tokens", "recv_rows"):
            setattr(args, name, int(getattr(c, name)))  # (the configuration's, by the same name)
        args.x_row_bytes, args.y_row_bytes = c.hidden * c.dispatch_dtype.itemsize, c.hidden * c.out_dtype.itemsize
        args.fp8_fnuz = int(c.dispatch_dtype.name == "float8_e4m3fnuz")
        args.host_status, args.host_offsets = self.status_device, self.host_offsets_device
        args.prof = self.profile.ptr if self.profile is not None else 0
        args.route_chunk = route_chunk(c.top_k, c.max_tokens)
        args.div_k, args.div_L, args.div_E = divisor(c.top_k), divisor(c.local_experts), divisor(c.num_experts)
        args.div_x_nseg, args.div_nseg = divisor(c.x_nseg), divisor(c.nseg)
        args.div_W, args.div_peers = divisor(c.world), divisor(max(1, c.world - 1))
        args.div_chunk, args.div_chunks = divisor(args.route_chunk), divisor(route_chunks(c.top_k, c.max_tokens))
        args.combine_send_percent = combine_send_percent()
        args.row_align = c.row_align if c.contiguous else 0
        args.trap_on_timeout, args.timeout_ns = int(c.on_timeout == "trap"), timeout_ns(c.timeout)

    def views(self, stream, health, y: DeviceArray | None = None) -> OutputViews:
        """The outputs as views that name `stream` and carry `health` (y: ours, unless given)."""
        def out(name):
            a = self.arrays[name]
            return DeviceArray(a.backend, a.ptr, a.shape, a.dtype, owner=self.heap, stream=stream, health=health)
        c = self.config
        y = out("y") if y is None else y
        return OutputViews(out("num_tokens"), out("recv_x"), out("recv_meta"),
                           out("recv_scales") if c.scale_cols else None, y, out("layout") if c.by_source else None,
                           out("offsets") if c.contiguous else None)

    def close(self) -> None:
        if self.profile is not None:
            self.profile.free()
        self._status.free()
        self._host_offsets.free()
