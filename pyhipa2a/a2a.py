"""AllToAll: expert-parallel dispatch and combine on one node.

    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        d = a2a.dispatch(x, indices)        # x [T, H], indices [T, k] int32
        ...expert_y = experts(d.expert_x, d.expert_num_tokens)...
        y = a2a.combine(expert_y, weights)  # weights [T, k] float32 -> y [T, H]

fp8 dispatch: AllToAll(..., in_dtype="bfloat16", dispatch_dtype="float8_e4m3") quantizes x on the
way (one float32 scale per 128 elements of a row); AllToAll(..., in_dtype="float8_e4m3",
out_dtype="bfloat16") takes x already in fp8 with dispatch(x, indices, x_scales=s). Either way
expert_x is fp8 and d.expert_x_scales [L, W*M, H/128] float32 holds its scales; combine stays 16-bit.

Every rank calls the same sequence. Nothing here waits for the device:
counts stay on the device and the outputs are views of the symmetric heap,
valid until the next dispatch (expert_x, expert_meta, expert_num_tokens, and
expert_layout with row_layout="by_source") or
the next combine (y, unless `out=` was given). `synchronize()` waits and
raises what a kernel reported (A2ATimeoutError naming the late rank, bad
indices seen on the device).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import weakref

import numpy as np

from . import producers
from .again import MISSED, plan_combine, plan_dispatch
from .again import run as run_again
from .array import DeviceArray
from .bootstrap import bounded_barrier, world_size
from .calls import (DispatchResult, OutputViews, Repeat, checked_combine_weights, checked_dispatch, take_input,
                    weights_input)
from .dtypes import FP8_BLOCK, fp8_for_arch, plan_dtypes
from .errors import A2AError, A2ATimeoutError, ConfigMismatchError, Health
from .graph import Graph
from .heap import SymmetricHeap
from .inputs import Boundary, check_numpy_input, check_scale, same_scale
from .kernels import (DISPATCH_KERNELS, X_COPY, X_FP8, X_QUANTIZE_BF16, X_QUANTIZE_F16, A2AArgs,
                      HeapView, KernelLibrary, divisor, route_chunk, route_chunks, timeout_ns)
from .ordering import StreamOrder
from .runtime.base import RuntimeFailure
from .profile import CLOCK_ROUNDS, ClockSync, ProfileBuffer, clock_offset, clock_sync_from_stamps
from .quick import COMBINE_ARGS, DISPATCH_ARGS, quick_combine, quick_dispatch, quick_for

MAX_LOCAL_EXPERTS = 1024   # A2A_MAX_LOCAL_EXPERTS in kernels_hip/exchange.h
MAX_TOP_K = 32             # a token's slots are one bit each of a 32-bit mask (A2A kernels)
MAX_WORLD = 32             # A2A_MAX_WORLD
MAX_WARPS_PER_BLOCK = 32   # A2A_MAX_WARPS_PER_BLOCK
MAX_BLOCK_THREADS = 512    # A2A_MAX_BLOCK_THREADS: the kernels' register budget assumes it
MAX_GRID_BLOCKS = 4096     # A2A_MAX_GRID: blocks of an exchange kernel's launch (a done flag each)
DEFAULT_BLOCK_THREADS = 256
DEFAULT_BLOCKS_PER_MP = 2  # two blocks per CU/SM: more warps to hide the link's latency (PERFORMANCE.md)
SEGMENT_LANE_ELEMS = 32    # 4 chunks of 8 elements per lane (A2A_CHUNKS in kernels_hip/exchange.h)
MIN_WARP, MAX_WARP = 32, 64
# A call pushes its tokens as tagged words (one link crossing, no flags, twice
# the bytes) instead of staging them for peers to pull when at most this many
# bytes of token copies leave the rank, a token counted once per peer it can
# reach (min(top_k, ranks - 1)); see "Pushed calls" in kernels_hip/exchange.h.
# PERFORMANCE.md: with 2 ranks pushing won up to ~0.75 MB and lost at 1.3 MB;
# with 4 ranks a 0.47 MB call (E=128 k=4 H=2880), whose copies go to 2-3
# peers, lost (combine 27 us pushed, 23 pulled). These were measured with tokens
# pushed; on sm_90, where such a call now pulls its tokens (GPU_FENCE_PUBLISH_ARCHS),
# the limit decides only whether contributions come back pushed, and was not
# measured again for that: DEFAULT_PUSH_BACK_BYTES below is. Rows count at 16 bits
# an element whatever dispatch sends: contributions come back 16-bit or wider, and
# fp8 rows counted at their own size pushed contributions back at twice the tokens,
# where pulling them is faster (two H200s, 64 tokens of H = 7168: combine
# 23.0-23.4 us pushed, 19.6-20.5 pulled).
DEFAULT_PUSH_BYTES = 768 * 1024
# Where tokens are pulled (GPU_FENCE_PUBLISH_ARCHS), contributions come back pushed
# up to this many bytes of 16-bit rows instead. Two H200s, combine of the fused
# expert, contributions always pulled against always pushed (twenty-eighth
# session, sweeps at H = 2048, 4096, 7168): pushing won 1.6-2.2 us up to 64 KB, 0.8
# at 131 KB, broke even at 262 KB (both H), and lost 0.5-1.4 us at 459-524 KB and
# 3-4 us at 0.9-1 MB; the gpu-mode shape of 2880-element rows and 49 / 120 tokens
# took 16.9 us pulled against 18.5-18.7 pushed.
DEFAULT_PUSH_BACK_BYTES = 256 * 1024
# Combine has two kernels (kernels_hip/combine.hip): the bulk one gives a warp a segment of a token,
# the small one a chunk (8 elements a lane) with a token's experts loaded at once. The small one is
# used when its warps take at most this many chunk items each (tokens * segments * chunks a segment,
# over its warps); PYHIPA2A_COMBINE_KERNEL=small|bulk forces one (benchmarks, tests).
SMALL_COMBINE_ITEMS_PER_WARP = 1
COMBINE_KERNEL_CHOICES = ("auto", "small", "bulk")
# A flag over a segment that its sender left in its own memory for a peer to read (dispatch's staged
# tokens, combine's pulled contributions) follows a GPU-scope fence on these architectures, where a
# peer reads that memory through the sender's L2, and a system-scope release elsewhere
# (kernels_hip/portability.h: a2a_publish_own_sys; PERFORMANCE.md, twenty-first session: 1.1 us a
# flag on two H100s). With the fence, pulled tokens arrive sooner than pushed ones at every size
# measured, so a pushed call then pushes only its contributions back (exchange.h: A2A_PUSHED_TOKENS).
# PYHIPA2A_PUBLISH=system keeps the system-scope release and pushed tokens everywhere; =gpu-fence
# takes the fence's protocol anywhere (AMD's kernels keep their system-scope release: tests, the
# host backend).
GPU_FENCE_PUBLISH_ARCHS = ("sm_90",)
PUBLISH_CHOICES = ("auto", "system", "gpu-fence")
STREAM_CHOICES = ("own", "current")  # AllToAll(stream=...): where calls given no stream= run
# AllToAll(row_layout=...): where expert l's rows lie in expert_x[l]. "packed": rows 0 .. n - 1, source 0's
# first (the contract). "by_source": source s's rows from row s * M on, as expert_layout[l, s] =
# (first row, rows) says (grouped GEMMs with ragged groups take this): a row's place is known to its
# sender alone, so no receiver waits for the counts of the sources before (docs/PERFORMANCE.md).
LAYOUT_CHOICES = ("packed", "by_source")


def _env_choice(name: str, choices: tuple[str, ...]) -> str:
    """Environment variable `name`, one of `choices` (the first when unset), or ValueError."""
    choice = os.environ.get(name, choices[0])
    if choice not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {choice!r}")
    return choice


def check_block_threads(threads: int, warp: int) -> None:
    most = min(MAX_BLOCK_THREADS, MAX_WARPS_PER_BLOCK * warp)
    if threads % warp or not warp <= threads <= most:
        raise ValueError(f"block_threads={threads} must be a multiple of the warp size ({warp}) "
                         f"between {warp} and {most}")


def launch_geometry(threads: int, multiprocessors: int, per_mp: int, grid_blocks: int | None,
                    ranks_on_device: int = 1) -> int:
    """Blocks per launch. Blocks wait on flags that other blocks of the same launch set, so every
    block must be resident at once, and so must every block of the ranks that drive the same device
    (several ranks share one GPU under MPS): the device holds per_mp blocks of `threads` threads of
    our kernels on each multiprocessor (the runtime's occupancy figure), and the ranks on it share
    them. Default: DEFAULT_BLOCKS_PER_MP a multiprocessor, divided among those ranks."""
    if per_mp < 1:
        raise ValueError(f"block_threads={threads}: the kernels' registers do not fit that many threads "
                         "in one block on this device")
    most = min(MAX_GRID_BLOCKS, multiprocessors * per_mp // ranks_on_device)
    if most < 1:
        raise ValueError(f"{ranks_on_device} ranks drive this device, which holds {multiprocessors * per_mp} blocks "
                         f"of {threads} threads of our kernels at once: fewer than one a rank")
    blocks = grid_blocks or min(most, max(1, multiprocessors * min(DEFAULT_BLOCKS_PER_MP, per_mp) // ranks_on_device))
    if not 1 <= blocks <= most:
        shared = f", shared by the {ranks_on_device} ranks that drive this device" if ranks_on_device > 1 else ""
        raise ValueError(f"grid_blocks={blocks} must be between 1 and {most} (all blocks of a launch resident "
                         f"at once: {multiprocessors} multiprocessors x {per_mp} blocks of {threads} threads"
                         f"{shared}; at most {MAX_GRID_BLOCKS} in all)")
    return blocks


class AllToAll:
    def __new__(cls, comm=None, *, ranks_per_node: int | None = None, **config):
        """A communicator whose ranks span several nodes (real ones, or groups of `ranks_per_node`
        ranks, also set by PYHIPA2A_RANKS_PER_NODE) gets a HierarchicalAllToAll: the same calls and
        outputs, this class within each node and NCCL/RCCL (MPI on the host backend) between them."""
        from .hierarchy import HierarchicalAllToAll, node_layout
        layout = node_layout(comm, ranks_per_node)
        if layout.nodes > 1:
            return HierarchicalAllToAll(comm, layout, **config)
        return super().__new__(cls)

    def __init__(self, comm=None, *, num_experts: int, experts_per_token: int, hidden_dim: int,
                 max_num_tokens: int, in_dtype="float16", out_dtype=None, dispatch_dtype=None,
                 timeout: float = 10.0,
                 backend=None, device: int | None = None, profile: bool = False,
                 block_threads: int | None = None, grid_blocks: int | None = None,
                 push_max_tokens: int | None = None, narrow_partials: bool = False,
                 producer_order: str = "protocol", on_timeout: str = "report", stream: str = "own",
                 row_layout: str = "packed",
                 ranks_per_node: int | None = None, _region_tokens: int = 0, _ranks_on_device: int = 0):
        # ranks_per_node was resolved by __new__. _region_tokens > 0: this object is one node's part
        # of a multi-node call (pyhipa2a.hierarchy): its tokens come in regions of that many, one per
        # node, and an index of -1 is a slot whose expert is on another node.
        # _ranks_on_device: every rank of the machine that drives our GPU, where some are in other
        # (simulated) nodes than this object's communicator; 0: those of the communicator.
        self._ranks_on_device = int(_ranks_on_device)
        self._region_tokens = int(_region_tokens)
        self._void_slots = self._region_tokens > 0
        # in_dtype: dispatch's x; dispatch_dtype: expert_x; out_dtype: combine's expert_y and y. In fp8
        # dispatch (pyhipa2a.dtypes.plan_dtypes) the device settles e4m3fn or e4m3fnuz in _setup.
        self.in_dtype, self.dispatch_dtype, self.out_dtype, self._fp8_request = plan_dtypes(
            in_dtype, dispatch_dtype, out_dtype)
        self.num_experts, self.top_k = int(num_experts), int(experts_per_token)
        self.hidden, self.max_tokens = int(hidden_dim), int(max_num_tokens)
        self.scale_cols = 0  # float32 scales of an expert_x row (fp8 dispatch: one per FP8_BLOCK elements)
        if self._fp8_request:
            if self.hidden % FP8_BLOCK:
                raise ValueError(f"fp8 dispatch needs hidden_dim to be a multiple of {FP8_BLOCK} (one scale per "
                                 f"{FP8_BLOCK}-element block); got {self.hidden}")
            self.scale_cols = self.hidden // FP8_BLOCK
        self.timeout = float(timeout)
        self.profiling = bool(profile)
        # Narrow partials: an expert rank's sum over its experts of a token crosses the link
        # in the output's 16-bit format instead of fp32 (half of combine's bytes where ranks
        # host several of a token's experts) at the price of one more rounding per such rank.
        # Off by default: the dispatch/combine contract accumulates in fp32.
        if not isinstance(narrow_partials, (bool, np.bool_)):
            raise TypeError(f"narrow_partials must be a bool, not {type(narrow_partials).__name__}")
        self.narrow_partials = bool(narrow_partials)
        # on_timeout="trap": a kernel that times out aborts, so the process cannot use the device any
        # more and every later device operation fails loudly (for callers that never synchronize).
        if on_timeout not in ("report", "trap"):
            raise ValueError(f"on_timeout must be 'report' or 'trap', not {on_timeout!r}")
        self.on_timeout = on_timeout
        self.producer_order = producer_order  # checked by Boundary (pyhipa2a.inputs)
        # Where a call given no stream= runs: "own", the object's own stream; "current", the current
        # stream of its inputs' library (PyTorch's, CuPy's), as that library's own operations do: then
        # neither their inputs nor our outputs handed to them wait across streams (_stream).
        if stream not in STREAM_CHOICES:
            raise ValueError(f"stream must be one of {STREAM_CHOICES} (a call's own stream= takes a stream "
                             f"object or handle), not {stream!r}")
        self._on_current_stream = stream == "current"
        if row_layout not in LAYOUT_CHOICES:
            raise ValueError(f"row_layout must be one of {LAYOUT_CHOICES}, not {row_layout!r}")
        if row_layout == "by_source" and self._void_slots:
            raise ValueError("row_layout='by_source' is for calls within one node: between nodes each rank's "
                             "rows come through its node's ranks, so expert_x is packed there")
        self.row_layout = row_layout
        self._by_source = row_layout == "by_source"  # (read by the kernels' arguments and the output views)
        # Launch geometry (tuning knobs; the environment variables let scripts sweep them).
        self._block_threads = block_threads or int(os.environ.get("PYHIPA2A_BLOCK_THREADS", DEFAULT_BLOCK_THREADS))
        self._grid_blocks = grid_blocks or int(os.environ.get("PYHIPA2A_GRID_BLOCKS", 0)) or None
        if min(self.num_experts, self.top_k, self.hidden, self.max_tokens) < 1:
            raise ValueError("num_experts, experts_per_token, hidden_dim and max_num_tokens must be >= 1")
        # A routing slot travels as e + E * place in 32 bits, and the kernels divide it by E, and a slot's
        # index t * k + j by k, exactly only below 2^31 (quot in kernels_hip/portability.h). Within a node
        # k <= E bounds the second by the first; a node's part of a multi-node call may have k > E.
        for name, n in (("num_experts", self.num_experts), ("experts_per_token", self.top_k)):
            if n * self.max_tokens >= 2**31:
                raise ValueError(f"{name} * max_num_tokens must be below 2**31; got {n} * {self.max_tokens}")
        # A call's token count travels with two flag bits above it (kernels_hip/exchange.h: A2A_PUSHED_TOKENS,
        # A2A_PUSHED_BACK), so it must stay below 2^30.
        if self.max_tokens >= 2**30:
            raise ValueError(f"max_num_tokens must be below 2**30; got {self.max_tokens}")
        # (A node's part of a multi-node call may hold fewer experts than a token has: the rest are void.)
        if self.top_k > MAX_TOP_K or (self.top_k > self.num_experts and not self._void_slots):
            raise ValueError(f"experts_per_token={self.top_k} must be <= num_experts and <= {MAX_TOP_K}")
        if self.timeout <= 0:
            raise ValueError("timeout must be positive (seconds)")
        # Pushed words' room, for the larger default; the limit itself is set once the device is known
        # (_setup: where tokens are pulled, contributions alone come back pushed, below a smaller one).
        self._push_request = push_max_tokens
        self._push_room = self.push_max_tokens = self._push_limit(push_max_tokens, world_size(comm), DEFAULT_PUSH_BYTES)
        self.push_row_words = self._push_row_words()

        # A row moves in segments of SEGMENT_LANE_ELEMS per lane of a warp, one warp
        # each; the warp size is not known before the device is, so size the
        # segment flags for the smallest warp (more segments, never fewer).
        self.nseg = math.ceil(self.hidden / (SEGMENT_LANE_ELEMS * MIN_WARP))  # set exactly in _setup
        heap_bytes = self._heap_bytes(comm)
        self.heap = SymmetricHeap(comm, heap_bytes, backend=backend, device=device, timeout=self.timeout)
        try:
            self._setup()
        except BaseException:
            self.heap.close()
            raise

    # -- construction -----------------------------------------------------------
    def _push_limit(self, requested: int | None, world: int, default_bytes: int) -> int:
        """Calls of at most this many tokens push (0: every call stages and pulls): their contributions
        come back pushed, and their tokens go pushed too where push_tokens. By default, while their
        16-bit rows stay within `default_bytes`, a row counted once per peer it can reach. Pushed
        contributions are read 8 elements a lane, so rows must be a multiple of 8 elements."""
        env = os.environ.get("PYHIPA2A_PUSH_MAX_TOKENS")
        if requested is None and env is not None:
            requested = int(env)
        if requested is None:
            peers_per_token = max(1, min(self.top_k, world - 1))
            requested = default_bytes // (self.hidden * self.out_dtype.itemsize * peers_per_token)
        if requested < 0:
            raise ValueError(f"push_max_tokens={requested} must be >= 0")
        return min(int(requested), self.max_tokens) if self.hidden % 8 == 0 else 0

    def _push_row_words(self) -> int:
        """Tagged words of a pushed contribution's row (one fp32, or two 16-bit elements, each),
        padded to whole segments of the widest warp."""
        seg = SEGMENT_LANE_ELEMS * MAX_WARP
        return math.ceil(self.hidden / seg) * seg

    def _token_bytes(self) -> int:
        """A staged token: its expert_x row, then in fp8 its scales, padded to 16 bytes (kernels_hip/fp8.h)."""
        row = self.hidden * self.dispatch_dtype.itemsize
        return row if not self.scale_cols else math.ceil((row + 4 * self.scale_cols) / 16) * 16

    def _push_token_words(self) -> int:
        """A pushed token's tagged words: one per 4 bytes of its row, or in fp8 fp8.h's segments (codes,
        then scales) for the widest warp's segments, which hold any narrower warp's."""
        if not self.scale_cols:
            return self.hidden * self.dispatch_dtype.itemsize // 4
        seg = 2 * SEGMENT_LANE_ELEMS * MAX_WARP
        elems = math.ceil(self.hidden / seg) * seg
        return elems // 4 + elems // FP8_BLOCK

    def _layout(self, world: int) -> list[tuple[str, tuple, object]]:
        """Every symmetric buffer, in allocation order (identical on all ranks). See kernels_hip/exchange.h."""
        L, M, k, H, S = self.num_experts // world, self.max_tokens, self.top_k, self.hidden, self.nseg
        P, C = self._push_room, self.scale_cols
        return [
            # written by peers, as tagged words (value in the low half, epoch in the high
            # half); headers alternate by epoch parity
            ("tok_hdr", (2, world, M, k), np.uint64),
            ("tok_count", (2, world), np.uint64),
            ("expert_counts", (2, world, route_chunks(k, M), L), np.uint64),  # by source and route chunk
            ("w_in", (world, M, k), np.uint64),
            ("stage_flag", (2, world, M, S), np.uint32),   # flags of the data below, in the reader's memory
            ("contrib_flag", (world, M, S), np.uint32),
            # read by peers (they pull): staged tokens by parity, contributions by owner
            ("stage", (2, M, self._token_bytes()), np.uint8),
            ("contrib", (world, M, 4 * H), np.uint8),   # a partial sum (fp32, or 16-bit if narrow), or one raw row
            # written by peers when a call pushes: tagged words of tokens, and of contributions
            ("push_tok", (2, world, P, self._push_token_words()), np.uint64),
            ("push_contrib", (world, P, self.push_row_words), np.uint64),
            # local
            ("recv_x", (L, world * M, H), self.dispatch_dtype),
            ("recv_meta", (L, world * M, 3), np.int32),
            ("recv_scales", (L, world * M, C), np.float32),
            ("num_tokens", (L,), np.int32),
            ("rows", (world, M, k), np.int32),
            ("slot_of", (world, M, k), np.int32),
            ("layout", (L, world, 2), np.int32),  # expert_layout (row_layout="by_source")
            ("epoch", (2,), np.uint32),
            ("status", (4,), np.uint32),
            # clock sync (kernels_hip/clock.hip): box r written by rank r; this rank's stamps with each
            # rank; rank 0's stamps with this rank and its host offset, and their flag, written by rank 0
            ("clock_box", (world,), np.uint64),
            ("clock_stamps", (world, CLOCK_ROUNDS, 2), np.uint64),
            ("clock_from0", (2 * CLOCK_ROUNDS + 1,), np.uint64),
            ("clock_done", (1,), np.uint32),
            ("clock_verdict", (1,), np.uint32),  # local: the sync's epoch once this rank's part succeeded
            # epoch: block b of the last dispatch / combine is done; last word: the block that poisons
            ("done", (2, MAX_GRID_BLOCKS + 1), np.uint32),
            # staging: NumPy inputs are copied here; y lands here unless out= is given
            ("x_stage", (M, H), self.in_dtype),
            ("x_scales_stage", (M, C), np.float32),
            ("indices_stage", (M, k), np.int32),
            ("weights_stage", (M, k), np.float32),
            ("y", (M, H), self.out_dtype),
        ]

    def _heap_bytes(self, comm) -> int:
        world = world_size(comm)
        if self.num_experts % world:
            raise ValueError(f"num_experts={self.num_experts} must be divisible by the number of ranks ({world})")
        if world > MAX_WORLD:
            raise ValueError(f"at most {MAX_WORLD} ranks; got {world}")
        if self.num_experts // world > MAX_LOCAL_EXPERTS:
            raise ValueError(f"at most {MAX_LOCAL_EXPERTS} experts per rank; got {self.num_experts // world}")
        return sum(math.prod(shape) * np.dtype(dt).itemsize + 256 for _, shape, dt in self._layout(world))

    def _setup(self) -> None:
        heap = self.heap
        self.backend, self.rank, self.world = heap.backend, heap.rank, heap.world
        self.local_experts = self.num_experts // self.world
        self.capacity = self.world * self.max_tokens
        warp = heap.device.warp_size
        self.seg_elems = SEGMENT_LANE_ELEMS * warp if warp > 1 else self.hidden  # host: whole rows
        self.nseg = math.ceil(self.hidden / self.seg_elems)
        # Dispatch's segments carry as many bytes in fp8 as in 16 bits: twice the elements.
        self.x_seg_elems = self.seg_elems * (2 if self.scale_cols and warp > 1 else 1)
        self.x_nseg = math.ceil(self.hidden / self.x_seg_elems)
        if self._fp8_request:  # the device's own e4m3 (or a clear error where it has none)
            self.dispatch_dtype = fp8_for_arch(self._fp8_request, heap.device.arch)
            if self.in_dtype.itemsize == 1:
                self.in_dtype = self.dispatch_dtype
        self.x_format = (X_COPY if not self.scale_cols else X_FP8 if self.in_dtype.itemsize == 1
                         else X_QUANTIZE_BF16 if self.in_dtype.name == "bfloat16" else X_QUANTIZE_F16)
        self._check_config_agrees()
        self.buf = {name: heap.alloc(shape, dtype) for name, shape, dtype in self._layout(self.world)}
        self._stage_ptrs = {name: b.ptr for name, b in self.buf.items() if name.endswith("_stage")}
        heap.verify()

        # Kernels mirror their first error into pinned host memory: the host
        # sees it without a copy, and every call checks it before launching.
        host, device = self.backend.malloc_host_mapped(16)
        self._free_host_status = weakref.finalize(self, self.backend.free_host_mapped, host)
        self.host_status = np.frombuffer((ctypes.c_uint32 * 4).from_address(host), np.uint32)
        self.health = Health(self.host_status, self.rank)  # outputs ask it before handing data out
        self._host_status_device = device
        self.stream = self.backend.stream_create()
        # The profiling build records per-warp timelines; the normal one compiles that away.
        self.lib = KernelLibrary(self.backend, heap.device.arch, variant=".profile" if self.profiling else "")
        self._dispatch_kernel = self.lib.kernel(DISPATCH_KERNELS[self.x_format])
        # Loaded now, not on first use: nothing may be loaded while a capture() records.
        out16 = "bf16" if self.out_dtype.name == "bfloat16" else "f16"
        self._scale_kernel = self.lib.kernel(f"expert_dequantize_{out16}" if self.scale_cols else f"expert_scale_{out16}")
        self._combine_kernel = self.lib.kernel(f"a2a_combine_{out16}")
        self.block_threads, self.blocks, bulk_per_mp = self._launch_geometry(heap.device)
        self.warps_per_block = max(1, self.block_threads // heap.device.warp_size)
        self.profile_buffer = (ProfileBuffer(self.backend, self.blocks * self.warps_per_block) if self.profiling
                               else None)
        # Both exchange kernels, and the small combine kernel, launch self.blocks, the whole resident
        # grid, however few items a call has: their roles (dispatch's routing, staging, counting and
        # copying out; combine's contributions and reduce) then run in warps of their own. A grid the
        # items fill put a small call's roles one after another in the same few warps: one rank at
        # M = 1 launched one block, whose eight warps routed, then counted 256 experts, then copied
        # (twenty-third session, docs/PERFORMANCE.md).
        self._small_combine, self.small_combine_tokens = self._small_combine_kernel(heap.device, out16, bulk_per_mp)
        self.gpu_fence_publish = self._publish_with_gpu_fence(heap.device.arch)
        if not self.push_tokens:  # (at most the room: DEFAULT_PUSH_BACK_BYTES < DEFAULT_PUSH_BYTES)
            self.push_max_tokens = self._push_limit(self._push_request, self.world, DEFAULT_PUSH_BACK_BYTES)
        self._dispatch_pack = self._dispatch_kernel.pack()
        self._combine_pack = self._combine_kernel.pack()
        self._scale_pack = self._scale_kernel.pack()
        # Each leg's repeated call launches from a pack of its own, which holds its record's arguments
        # (Kernel.repeater, pyhipa2a.quick; one record a leg at a time)
        self._repeat_packs = (self._dispatch_kernel.pack(), self._combine_kernel.pack())
        # and a call like the record on new arrays from another: the record's arguments, with those arrays'
        # pointers and the call's token count written over them at each such call
        self._moved_packs = (self._dispatch_kernel.pack(), self._combine_kernel.pack())
        for pack in (self._dispatch_pack, self._combine_pack):
            self._fill_args(pack[0])
        # The fake expert reads our expert_x (and its scales) and counts and scales by 1 + rank: only
        # `out` (argument _scale_out) changes per call.
        self._set_fake_expert_scale(float(1 + self.rank))
        self._prepare_launches()
        self._capturing = None  # the stream while capture() records a step, or one call joins a caller's capture
        self._joined = None  # that stream while one call is recorded into another library's capture (_join_capture)
        self._pending_joined = None  # the pending dispatch's: the stream of the capture it was recorded into
        self._clock_epoch = 0  # tags clock_offset_ns()'s words (kernels_hip/clock.hip)
        self._clock_failed: str | None = None  # why the clock syncs are out of step
        self._clock_kernel = None  # (kernel, pack) of clock_sync, made on first use
        self.clock_sync: ClockSync | None = None  # the last clock_offset_ns()'s, this rank against rank 0
        self._graphs = weakref.WeakSet()  # destroyed by close() at the latest
        self._pending: DispatchResult | None = None
        self._pending_weights = None  # the weights given to that dispatch, which sent them
        self._repeat_dispatch: Repeat | None = None  # the last call of each leg, when the next may repeat it
        self._repeat_combine: Repeat | None = None
        self._broken: str | None = None
        self._expert_y_buffer: DeviceArray | None = None
        self._output_views: dict = {}  # by id(stream): the views hold their stream, so no id is reused
        self._last_scale = (1.0, 1.0)  # combine's expert_scale as given, and as checked (float32)
        self._order = StreamOrder(self.backend, self.stream)  # calls across streams, inputs after producers
        self._boundary = Boundary(self.backend, heap.device.index, self._order, self.producer_order)
        # stream="current": the device whose library streams a call follows; None on the host backend,
        # whose arrays live in host memory, where no library's stream means anything
        self._library_device = None if self.backend.kind == "host" else heap.device.index
        self._expert_y_views: dict = {}  # expert_y_buffer() naming other streams (see _expert_y_on)
        bounded_barrier(heap.comm, self.timeout, "AllToAll setup")

    def _set_fake_expert_scale(self, scale: float) -> None:
        """gpu-mode's factor, 1 + rank (a multi-node call's node part is given its rank in the world)."""
        by_source = self._by_source
        fixed = (self.buf["num_tokens"].ptr, self.buf["layout"].ptr if by_source else 0, self.world if by_source else 0,
                 self.local_experts, self.capacity, self.hidden, scale)
        if self.scale_cols:
            self._scale_out = 2
            self._scale_pack.set_scalars(self.buf["recv_x"].ptr, self.buf["recv_scales"].ptr, 0, *fixed,
                                         int(self.dispatch_dtype.name == "float8_e4m3fnuz"))
        else:
            self._scale_out = 1
            self._scale_pack.set_scalars(self.buf["recv_x"].ptr, 0, *fixed)

    def _launch_geometry(self, device) -> tuple[int, int, int]:
        """(threads per block, blocks per launch, blocks of the exchange kernels a multiprocessor
        holds) for this device (see launch_geometry)."""
        threads, warp = self._block_threads, device.warp_size
        if warp == 1:  # host twins: one "thread"
            return 1, 1, 1
        check_block_threads(threads, warp)
        per_mp = min(self.backend.resident_blocks(k.function, threads)
                     for k in (self._dispatch_kernel, self._combine_kernel))
        return threads, launch_geometry(threads, device.multiprocessors, per_mp, self._grid_blocks,
                                        self._ranks_on_device or self.heap.ranks_on_device), per_mp

    def _prepare_launches(self) -> None:
        """Every launch site of this object's calls made now (Kernel.prepare; on CUDA a one-node graph each,
        with device memory of its own): the exchange kernels from their packs, the repeats' and the new
        arrays' (pyhipa2a.quick), combine's small and bulk kernels from each of combine's, the fake
        expert from its own. Made at their first launches instead, they appeared in the middle of a run,
        when a call first took a kernel or a path, and device memory grew there by 2 MiB (scripts/stress.py
        at 1 rank, thirty-sixth session, docs/PERFORMANCE.md)."""
        combines = [(self._combine_kernel, self.block_threads)]
        if self._small_combine is not None:
            combines.append(self._small_combine)
        for pack in (self._dispatch_pack, self._repeat_packs[0], self._moved_packs[0]):
            self._dispatch_kernel.prepare(pack, self.blocks, self.block_threads)
        for pack in (self._combine_pack, self._repeat_packs[1], self._moved_packs[1]):
            for kernel, threads in combines:
                kernel.prepare(pack, self.blocks, threads)
        self._scale_kernel.prepare(self._scale_pack, self.blocks, self.block_threads)

    def _small_combine_kernel(self, device, out16: str, bulk_per_mp: int):
        """(the small-call combine kernel, its threads a block) or None, and the most tokens a call
        may have to take it (-1: none). It runs half the bulk kernels' threads a block with up to twice
        their registers a thread; the blocks that launch_geometry counts as resident must stay so
        whichever of the two a rank runs (ranks sharing a GPU run them side by side), so it is used
        only where the device holds as many of its blocks a multiprocessor as of the bulk kernels'
        (bulk_per_mp). Like the bulk kernels it takes the whole grid (self.blocks): a call of one
        token then contributes and reduces in warps of their own.
        The host twin is one kernel for both."""
        choice = _env_choice("PYHIPA2A_COMBINE_KERNEL", COMBINE_KERNEL_CHOICES)
        warp, threads = device.warp_size, self.block_threads // 2
        if warp == 1 or choice == "bulk":
            return None, -1
        kernel = self.lib.kernel(f"a2a_combine_small_{out16}")
        if threads < warp or threads % warp or self.backend.resident_blocks(kernel.function, threads) < bulk_per_mp:
            if choice == "small":
                raise ValueError(f"PYHIPA2A_COMBINE_KERNEL=small: the small combine kernel cannot run beside "
                                 f"blocks of {self.block_threads} threads on this device")
            return None, -1
        chunks, warps = self.nseg * (self.seg_elems // (8 * warp)), threads // warp  # a token's chunk items
        most = self.max_tokens if choice == "small" else SMALL_COMBINE_ITEMS_PER_WARP * self.blocks * warps // chunks
        return (kernel, threads), most

    def _check_config_agrees(self) -> None:
        mine = (self.num_experts, self.top_k, self.hidden, self.max_tokens, self.in_dtype.name,
                self.dispatch_dtype.name, self.out_dtype.name, self.backend.kind, self.push_max_tokens,
                self.narrow_partials, self._region_tokens)
        everyone = self.heap.comm.allgather(hashlib.sha256(repr(mine).encode()).hexdigest())
        if len(set(everyone)) > 1:
            configs = self.heap.comm.allgather(mine)
            differ = tuple(r for r, c in enumerate(configs) if c != configs[0])
            raise ConfigMismatchError(
                f"AllToAll configuration differs across ranks: rank 0 has {configs[0]}, ranks {list(differ)} "
                f"have {[configs[r] for r in differ]} (num_experts, experts_per_token, hidden_dim, "
                f"max_num_tokens, in_dtype, dispatch_dtype, out_dtype, backend, push_max_tokens, narrow_partials, "
                f"region_tokens)",
                ranks=differ)

    @property
    def push_tokens(self) -> bool:
        """Whether a pushed call pushes its tokens too (without a GPU-scope fence before its flags)."""
        return not self.gpu_fence_publish

    @staticmethod
    def _publish_with_gpu_fence(arch: str) -> bool:
        """Whether flags over data left in the sender's own memory follow a GPU-scope fence
        (GPU_FENCE_PUBLISH_ARCHS) rather than a system-scope release."""
        choice = _env_choice("PYHIPA2A_PUBLISH", PUBLISH_CHOICES)
        return choice == "gpu-fence" or (choice == "auto" and arch in GPU_FENCE_PUBLISH_ARCHS)

    def _fill_args(self, a: A2AArgs) -> None:
        heap, off = self.heap, lambda name: heap.offset_of(self.buf[name].ptr)
        a.heap = HeapView.of(heap)
        a.local_base = heap.base
        for name, _, _ in self._layout(self.world):
            if hasattr(a, "off_" + name):
                setattr(a, "off_" + name, off(name))
        a.num_experts, a.local_experts, a.top_k = self.num_experts, self.local_experts, self.top_k
        a.max_tokens, a.hidden = self.max_tokens, self.hidden
        a.x_row_bytes = self.hidden * self.dispatch_dtype.itemsize
        a.token_bytes, a.push_token_words = self._token_bytes(), self._push_token_words()
        a.scale_cols, a.x_format = self.scale_cols, self.x_format
        a.fp8_fnuz = int(self.dispatch_dtype.name == "float8_e4m3fnuz")
        a.y_row_bytes = self.hidden * self.out_dtype.itemsize
        a.host_status = self._host_status_device
        a.prof = self.profile_buffer.ptr if self.profile_buffer is not None else 0
        a.seg_elems, a.nseg = self.seg_elems, self.nseg
        a.x_seg_elems, a.x_nseg = self.x_seg_elems, self.x_nseg
        a.route_chunk = route_chunk(self.top_k, self.max_tokens)
        a.div_k, a.div_L, a.div_E = divisor(self.top_k), divisor(self.local_experts), divisor(self.num_experts)
        a.div_x_nseg, a.div_nseg = divisor(self.x_nseg), divisor(self.nseg)
        a.div_W, a.div_peers = divisor(self.world), divisor(max(1, self.world - 1))
        a.div_chunk, a.div_chunks = divisor(a.route_chunk), divisor(route_chunks(self.top_k, self.max_tokens))
        a.push_max_tokens, a.push_row_words = self.push_max_tokens, self.push_row_words
        a.narrow_partials = int(self.narrow_partials)
        a.gpu_fence_publish = int(self.gpu_fence_publish)
        a.by_source = int(self._by_source)
        a.void_slots, a.region_tokens = int(self._void_slots), self._region_tokens
        a.trap_on_timeout = int(self.on_timeout == "trap")
        a.timeout_ns = timeout_ns(self.timeout)

    # -- calls ------------------------------------------------------------------
    def _usable(self) -> None:
        if self.heap.closed:
            raise A2AError("AllToAll is closed")
        if self._broken:
            raise A2AError(f"AllToAll is unusable after an earlier failure: {self._broken}")
        if self.host_status[0]:
            self._raise_reported()
        self.backend.activate()

    def _raise_reported(self, cause: BaseException | None = None) -> None:
        """A kernel reported an error: this object refuses further calls (peers may be mid-protocol)."""
        error = self.health.error()
        if error is not None:
            self._broken = str(error)
            raise error from cause

    def _stream(self, stream, inputs=()):
        """The stream a call runs on: the capturing one, the one given, or for none the object's own
        (stream="own") or the current stream of the library of the first of `inputs` that has one
        (stream="current"; the last call's stream where none has)."""
        return self._call_stream(stream, inputs)[0]

    def _call_stream(self, stream, inputs, join: bool = False):
        """(_stream's stream, asked): `asked` is {probe: its answer} where the stream is a producer's
        current one, which a repeat's rechecks of that producer's arrays take instead of asking it
        again (Repeat.holds); else None. `join`: a call that another library's capture of that stream
        records (_join_capture); the caller leaves it when the call returns (_leave_capture)."""
        if self._capturing is not None:
            if stream is not None and self._stream_outside_capture(stream) is not self._capturing:
                raise A2AError("inside capture(), every call must use the capturing stream (pass no stream=)")
            return self._capturing, None
        asked = None
        if stream is None and self._on_current_stream:
            stream, asked = self._current_stream_of(inputs)
        s = self._stream_outside_capture(stream)
        if join and self._captured_elsewhere(s):
            self._join_capture(s)
            return s, None
        return s, asked

    def _captured_elsewhere(self, s) -> bool:
        """Whether another library is capturing `s`, a call's stream outside capture()."""
        return self._capturable_elsewhere(s) and self.backend.stream_capturing(s)

    def _capturable_elsewhere(self, s) -> bool:
        """Whether another library may capture `s` (only capture() records our own stream, and CUDA never
        captures its legacy one: neither is asked)."""
        return s is not self.stream and self.backend.capturable(s)

    def _join_capture(self, s) -> None:
        """Another library (torch.cuda.graph, CuPy's stream capture) is capturing `s`: this call is
        recorded into that capture as capture() records ours: nothing waited for outside it, inputs
        taken without waits for their producers, kernels launched plainly, no repeat of it. The graph
        is the caller's: it must keep the inputs alive while it may replay (PyTorch's rule too)."""
        self.backend.capture_join(s)
        self._capturing, self._captured_refs, self._joined = s, [], s

    def _leave_capture(self) -> None:
        self.backend.capture_leave(self._joined)
        self._capturing = self._captured_refs = self._joined = None

    def _joining(self, call, *args):
        """call(*args), a public call's body that may join another library's capture (its stream
        argument's join=True), which it leaves however the call ends."""
        try:
            return call(*args)
        finally:
            if self._joined is not None:
                self._leave_capture()

    def _check_capture_pairing(self, leg: str) -> None:
        """A dispatch recorded into another library's capture must be combined in that same capture, and
        one made outside it outside it: each replay of the caller's graph is then a whole call on the
        device, and no call takes an epoch a replay will take too."""
        if self._pending is None:
            return
        if self._pending_joined is not None:
            # The caller's graph may hold this dispatch alone (or its capture failed): replaying it would
            # take an epoch no combine hands on, so no later call of this object could be trusted.
            self._broken = (f"a dispatch() recorded into another library's capture was followed by {leg}() "
                            "outside that capture: each recorded dispatch must be combined in the same capture")
            raise A2AError(self._broken)
        raise A2AError(f"{leg}() is being recorded into another library's capture while a dispatch() made "
                       "outside it awaits its combine(): combine that dispatch before the capture")

    def _current_stream_of(self, inputs):
        """stream="current": (the current stream on our device, as a handle, of the library of the first
        input on our device that names one (pyhipa2a.producers: PyTorch's, CuPy's), {its probe: the
        answer}); else (the last call's stream (our own before the first), None), so that calls on
        our own arrays stay in the order of the calls around them."""
        device = self._library_device
        if device is None:
            return self._order.latest(), None
        for obj in inputs:
            probe = producers.stream_source(obj)
            try:
                handle = probe.current_stream(obj, device) if probe is not None else None
            except Exception:  # (the call's own checks then say what is wrong with obj)
                handle = None
            if handle is not None:
                return self._order.runtime_handle(handle), {probe: handle}
        return self._order.latest(), None

    def stream_for(self, *inputs):
        """The stream a call given these inputs and no stream= runs on now (for the caller's own events:
        with stream="current" it follows the inputs' library)."""
        return self._stream(None, inputs)

    def _stream_outside_capture(self, stream):
        if stream is None:
            return self.stream
        handle = producers.foreign_stream_handle(stream)
        if handle is None:
            if not isinstance(stream, self.backend.stream_type):
                raise TypeError(f"stream= must be a stream handle (an int), a CuPy or PyTorch stream, or one of "
                                f"this backend's streams; got {type(stream).__name__}")
            return stream
        # One object per handle (our own stream's is our own stream): _outputs caches its views by the
        # stream object, and a repeated call compares it.
        return self._order.stream_of(handle)

    # Ordering (pyhipa2a.ordering), outside a capture only: a capture may not wait for work
    # outside it, so ordering a graph's launch after the producers of its inputs is the caller's part.
    def _follow(self, stream) -> None:
        if self._capturing is None:
            self._order.follow(stream)

    def _queued(self, stream) -> None:
        if self._capturing is None:
            self._order.queued(stream)

    def _input(self, obj, name, want_shape, want_dtype, stage: str | None, stream, align: int = 1):
        return take_input(self._boundary, self, obj, name, want_shape, want_dtype, stage, stream, align)

    def dispatch(self, x, indices, *, weights=None, x_scales=None, stream=None) -> DispatchResult:
        """Send each token to the ranks of its experts. `x` [T, H] in_dtype, `indices` [T, k] int32, T <= M;
        with fp8 x (in_dtype fp8), `x_scales` [T, H / 128] float32: element i of row t stands for
        x[t, i] * x_scales[t, i // 128].

        `weights` [T, k] float32, the gate's weights, may come here instead of to combine: they then
        travel with the routing, so combine waits for no weights of its peers (its fastest form). This
        call reads them; combine takes none (or the same array)."""
        repeat = self._repeat_dispatch
        if repeat is not None and repeat.quick is not None:  # the loop's usual call: the last one again
            plan = repeat.quick.again  # (on the record's own arrays, in C: pyhipa2a.again)
            if plan:
                result = run_again(plan, x, indices, weights, x_scales, stream)
                if result is not MISSED:
                    return result
            result = quick_dispatch(self, repeat, x, indices, weights, x_scales, stream)
            if result is not None:
                return result
        self._usable()
        return self._joining(self._dispatch, x, indices, weights, x_scales, stream, True)

    def _dispatch(self, x, indices, weights, x_scales, stream, join: bool = False) -> DispatchResult:
        """dispatch() once the object is known usable. A multi-node call's node part comes here
        directly: an exchange between nodes that failed in this very call is the kernel's to handle
        (it sends nothing and poisons the outputs; pyhipa2a.hierarchy)."""
        s, asked = self._call_stream(stream, (x, indices), join)  # (one object per stream, handles too: what a repeat compares)
        if self._pending_joined is not self._joined:
            self._check_capture_pairing("dispatch")
        args = (x, indices, weights, x_scales, s)
        repeat, self._repeat_dispatch = self._repeat_dispatch, None  # a call that fails records nothing
        if repeat is not None and self._pending is None and self._capturing is None and repeat.holds(args, asked):
            self._with_quick(repeat, (x, indices, weights, x_scales, stream), s, (x, indices), asked)
            repeat.resume(self._order, s)
            result = self._launch_dispatch(s, repeat.tokens, weights, repeat.prepared)
            self._repeat_dispatch = repeat
            return result
        T = checked_dispatch(self, x, indices, weights, x_scales)
        self._follow(s)
        x_ptr, x_keep = self._input(x, "x", (T, self.hidden), self.in_dtype, "x_stage", s)
        i_ptr, i_keep = self._input(indices, "indices", (T, self.top_k), np.int32, "indices_stage", s)
        s_ptr, s_keep = 0, None
        if x_scales is not None:
            s_ptr, s_keep = self._input(x_scales, "x_scales", (T, self.scale_cols), np.float32, "x_scales_stage", s,
                                        align=4)
        w_ptr, w_keep = 0, None
        if weights is not None:
            w_ptr, w_keep = weights_input(self, weights, T, s)

        call = self._dispatch_pack[1]  # the epoch is the device's own (see make_ctx in kernels_hip/exchange.h)
        call.x, call.indices, call.x_scales, call.weights, call.num_tokens = x_ptr, i_ptr, s_ptr, w_ptr, T
        self._keep(x_keep, i_keep, s_keep, w_keep)
        result = self._launch_dispatch(s, T, weights)
        names = ("x", "indices") + ("x_scales",) * (x_scales is not None) + ("weights",) * (weights is not None)
        self._repeat_dispatch = self._with_quick(Repeat.of(args, names, self._boundary, T, result),
                                                 (x, indices, weights, x_scales, stream), s, (x, indices), asked)
        return result

    def _with_quick(self, record, given: tuple, s, inputs: tuple, asked, leg_args=DISPATCH_ARGS):
        """`record` (a Repeat of a call with arguments `given`, stream= last, on stream `s`; or None) with
        its quick form (pyhipa2a.quick: the loop's next call like it takes that path, even with new
        arrays); `inputs` and `asked` as the call's _call_stream took and gave them. Its launch is made
        at its first repeat of the same arrays, from the pack as the record left it, and with it the
        record's plan (pyhipa2a.again, where its C helper is built)."""
        if record is not None and record.quick is None:
            plan = plan_dispatch if leg_args is DISPATCH_ARGS else plan_combine
            if leg_args is DISPATCH_ARGS:
                pack, moved = self._dispatch_pack, self._moved_packs[0]
                make_launch = functools.partial(self._dispatch_kernel.repeater, pack, self._repeat_packs[0],
                                                self.blocks, self.block_threads)
            else:
                pack, moved = self._combine_pack, self._moved_packs[1]
                make_launch = functools.partial(self._combine_repeater, record.tokens)
            record.quick = quick_for(self, record, given, s, make_launch, inputs, asked, leg_args,
                                     functools.partial(moved.copy_from, pack),
                                     functools.partial(plan, self) if run_again is not None else None)
        return record

    def _launch_dispatch(self, s, T: int, weights, result: DispatchResult | None = None) -> DispatchResult:
        """Launch the dispatch whose arguments are in the pack, on stream `s` (already ordered); its
        result (a repeat's is the recorded call's: the same views of the same stream and tokens)."""
        self._dispatch_kernel.launch(self._dispatch_pack, self.blocks, self.block_threads, s)
        self._queued(s)
        if result is None:
            result = self._outputs(s).dispatch_result(T)
        self._pending, self._pending_weights, self._pending_joined = result, weights, self._joined
        return result

    def combine(self, expert_y, weights=None, *, out=None, stream=None, expert_scale: float = 1.0) -> DeviceArray:
        """Bring expert outputs back: y[t] = sum_j weights[t, j] * expert_y_row(t, j), fp32 accumulation.
        `weights` [T, k] float32, unless they were given to dispatch (then none, or the same array).

        `expert_scale` (this rank's; each rank passes its own) is a fused elementwise epilogue: this
        rank's expert rows count as expert_y * expert_scale. A row that crosses to its token's owner
        alone is scaled and rounded to out_dtype on the way, as an expert kernel's output would be;
        every other row's scale joins its weight in fp32. gpu-mode's fake expert is
        `combine(d.expert_x, w, expert_scale=1 + rank)`: no expert kernel at all."""
        repeat = self._repeat_combine
        if repeat is not None and repeat.quick is not None:
            plan = repeat.quick.again
            if plan:
                y = run_again(plan, expert_y, weights, out, stream, expert_scale)
                if y is not MISSED:
                    return y
            y = quick_combine(self, repeat, expert_y, weights, out, stream, expert_scale)
            if y is not None:
                return y
        self._usable()
        return self._joining(self._combine, expert_y, weights, out, stream, expert_scale, True)

    def _combine(self, expert_y, weights, out, stream, expert_scale, join: bool = False) -> DeviceArray:
        """combine() once the object is known usable (see _dispatch)."""
        return self._launch_combine(self._prepare_combine(expert_y, weights, out, stream, expert_scale, join))

    def _prepare_combine(self, expert_y, weights, out, stream, expert_scale, join: bool = False):
        """Every check of a combine and its arguments, with nothing copied or launched yet (a multi-node
        call has its weights cross between nodes in between): (stream, out array, keepalives, the
        NumPy expert_y still to copy, or None)."""
        sent = checked_combine_weights(self, weights)
        T = self._pending.num_tokens
        s, asked = self._call_stream(stream, (expert_y, weights, out), join)
        if self._pending_joined is not self._joined:
            self._check_capture_pairing("combine")
        repeat, self._repeat_combine = self._repeat_combine, None  # a call that fails records nothing
        scale = self._checked_scale(expert_scale)
        args = (expert_y, weights, out, s, scale, sent)
        if repeat is not None and repeat.tokens == T and self._capturing is None and repeat.holds(args, asked):
            self._with_quick(repeat, (expert_y, weights, out, stream), s, (expert_y, weights, out), asked, COMBINE_ARGS)
            repeat.resume(self._order, s)
            self._repeat_combine = repeat
            return repeat.prepared
        self._follow(s)
        y_shape = (self.local_experts, self.capacity, self.hidden)
        host_y, y_ptr, y_keep = None, 0, None
        if isinstance(expert_y, np.ndarray):  # checked now, copied last: a refused call overwrites nothing
            check_numpy_input("expert_y", expert_y, y_shape, self.out_dtype, self._capturing is not None)
            host_y = expert_y
        else:
            y_ptr, y_keep = self._input(expert_y, "expert_y", y_shape, self.out_dtype, None, s)
        w_ptr, w_keep = (0, None) if sent is not None else weights_input(self, weights, T, s)
        if out is None:
            out_arr = self._outputs(s).y_rows[T]
            out_ptr, o_keep = out_arr.ptr, out_arr
        else:
            if isinstance(out, np.ndarray):
                raise TypeError("out must be a device array; a NumPy result comes from combine(...).numpy()")
            out_ptr, o_keep = self._input(out, "out", (T, self.hidden), self.out_dtype, None, s)
            out_arr = out
        call = self._combine_pack[1]
        call.expert_y, call.weights, call.out, call.num_tokens = y_ptr, w_ptr, out_ptr, T
        call.expert_scale = scale[1]
        prepared = s, out_arr, (y_keep, w_keep, o_keep), host_y
        names = ("expert_y",) + ("weights",) * (sent is None) + ("out",) * (out is not None)
        record = Repeat.of(args, names, self._boundary, T, prepared) if host_y is None else None
        self._repeat_combine = self._with_quick(record, (expert_y, weights, out, stream), s, (expert_y, weights, out),
                                                asked, COMBINE_ARGS)
        return prepared

    def _checked_scale(self, expert_scale) -> tuple:
        """(expert_scale, as the float32 the kernels take): the last call's own tuple when the scale is
        the same value of the same type, so that a scale computed afresh at every call (gpu-mode's
        1 + rank) still repeats the call; a new one, checked, otherwise."""
        last = self._last_scale
        if same_scale(expert_scale, last[0]):
            return last
        self._last_scale = (expert_scale, check_scale(expert_scale))
        return self._last_scale

    def _copy_host_expert_y(self, prepared):
        """A NumPy expert_y copied into expert_y_buffer() (the host waits for the stream): the prepared
        call, now with nothing left to copy."""
        s, out_arr, keep, host_y = prepared
        if host_y is None:
            return prepared
        staging = self.expert_y_buffer()
        self.backend.copy_to_device(staging.ptr, host_y, s)
        self._combine_pack[1].expert_y = staging.ptr
        return s, out_arr, (host_y, *keep[1:]), None

    def _combine_kernel_for(self, tokens: int):
        """(kernel, block threads) of a combine of `tokens` tokens."""
        if tokens <= self.small_combine_tokens:
            return self._small_combine
        return self._combine_kernel, self.block_threads

    def _combine_repeater(self, tokens: int):
        kernel, threads = self._combine_kernel_for(tokens)
        return kernel.repeater(self._combine_pack, self._repeat_packs[1], self.blocks, threads)

    def _launch_combine(self, prepared) -> DeviceArray:
        s, out_arr, keep, _ = self._copy_host_expert_y(prepared)
        kernel, threads = self._combine_kernel_for(self._combine_pack[1].num_tokens)
        kernel.launch(self._combine_pack, self.blocks, threads, s)
        self._queued(s)
        self._keep(*keep)
        self._pending = self._pending_weights = self._pending_joined = None
        return out_arr

    def _outputs(self, stream) -> OutputViews:
        """The output views naming `stream` (made once per stream)."""
        views = self._output_views.get(id(stream))
        if views is None:
            def out(name):
                return self._naming(self.buf[name], stream)
            views = self._output_views[id(stream)] = OutputViews(
                out("num_tokens"), out("recv_x"), out("recv_meta"), out("recv_scales") if self.scale_cols else None,
                out("y"), out("layout") if self._by_source else None)
        return views

    # -- helpers for callers ----------------------------------------------------
    def expert_y_buffer(self) -> DeviceArray:
        """A device buffer shaped like expert_y [L, W*M, H] (out_dtype), made once, freed by close()."""
        if self._expert_y_buffer is None:
            self.backend.activate()  # cuMemAlloc allocates on the current device
            shape = (self.local_experts, self.capacity, self.hidden)
            nbytes = math.prod(shape) * self.out_dtype.itemsize
            ptr = self.backend.malloc_ipc(nbytes)
            self._expert_y_free = weakref.finalize(self, self.backend.free, ptr)  # also at exit
            self._expert_y_buffer = DeviceArray(self.backend, ptr, shape, self.out_dtype, owner=self.heap,
                                                stream=self.stream)
        return self._expert_y_buffer

    def fake_expert(self, result: DispatchResult, out: DeviceArray | None = None, *, stream=None) -> DeviceArray:
        """gpu-mode's stand-in for the grouped GEMM: expert_y = expert_x * (1 + rank), received rows only
        (in fp8 dispatch, each fp8 row times its block scales, then times 1 + rank, in out_dtype)."""
        if not self.scale_cols and self.dispatch_dtype != self.out_dtype:
            raise TypeError("fake_expert needs in_dtype == out_dtype (or fp8 dispatch)")
        self.backend.activate()
        return self._joining(self._fake_expert, out, stream)

    def _fake_expert(self, out, stream) -> DeviceArray:
        s, _ = self._call_stream(stream, (out,), join=True)
        if out is None and self._expert_y_buffer is None and self._capturing is not None:
            raise A2AError("fake_expert() without out= inside a capture needs expert_y_buffer() called before "
                           "the capture (memory cannot be allocated while capturing)")
        self._follow(s)
        if out is None:
            out = self._expert_y_on(s)
        else:
            self._input(out, "fake_expert out", out.shape, self.out_dtype, None, s)
        self._scale_pack[self._scale_out].value = out.ptr  # the rest was filled at construction (result views our buffers)
        self._scale_kernel.launch(self._scale_pack, self.blocks, self.block_threads, s)
        self._queued(s)
        if self._capturing is not None:
            self._keep(out)
        return out

    def _expert_y_on(self, stream) -> DeviceArray:
        """expert_y_buffer() as a view that names `stream`, where the fake expert writes it, for
        consumers that order themselves by the array's stream (__cuda_array_interface__)."""
        base = self.expert_y_buffer()
        handle = self.backend.stream_handle(stream)
        if handle == self.backend.stream_handle(base.stream):
            return base
        view = self._expert_y_views.get(handle)
        if view is None:
            view = self._expert_y_views[handle] = self._naming(base, stream)
        return view

    def _naming(self, a: DeviceArray, stream) -> DeviceArray:
        """A view of our buffer `a` that names `stream`, where it is written."""
        return DeviceArray(self.backend, a.ptr, a.shape, a.dtype, owner=self.heap, stream=stream, health=self.health)

    def _keep(self, *objects) -> None:
        """Inputs stay referenced until the next call's replace them (the device may still read
        them; a repeated call's are held by its Repeat record); a capture keeps every one for the
        graph's lifetime."""
        if self._capturing is not None:
            self._captured_refs.extend(objects)
        else:
            self._keepalive = objects

    # -- graphs -------------------------------------------------------------------
    def capture(self, step, *, stream=None, _usable=None) -> Graph:  # _usable: a multi-node call's own check
        """Record `step()` as one graph that `Graph.launch()` replays with one call.

        `step` makes this object's calls (dispatch, your expert work on the
        same stream, combine) with device arrays; every dispatch in it must be
        combined in it. Each launch is a new call on the device (fresh epoch),
        reading the same input buffers and writing the same outputs, so fill
        the inputs in place between launches. Every rank captures and launches
        the same sequence."""
        self._usable()
        if self._capturing is not None:
            raise A2AError("capture() is already recording")
        if self._pending is not None:
            raise A2AError("capture() needs the last dispatch to be combined first")
        s = self._stream_outside_capture(stream)
        self._follow(s)  # the graph's first launch is queued behind the calls before the capture
        self.backend.capture_begin(s)
        self._capturing, refs = s, []
        self._captured_refs = refs
        try:
            step()
            if self._pending is not None:
                raise A2AError("the captured step left a dispatch without its combine")
        except BaseException:
            # Nothing captured ran, so the object is as it was before the capture.
            self._pending = self._pending_weights = None
            self.backend.capture_end(s, keep=False)
            raise
        finally:
            self._capturing, self._captured_refs = None, None  # the graph keeps `refs`
        def before_launch():
            (_usable or self._usable)()
            if self._pending is not None:
                # The graph's dispatch would take the epoch the pending call's combine has not yet
                # handed on: peers would read that call's words, and its kernels' done flags.
                raise A2AError("a graph cannot launch while a dispatch() awaits its combine()")
            self._follow(s)

        graph = Graph(self.backend, self.backend.capture_end(s), s, refs, before_launch=before_launch,
                      after_launch=lambda: self._queued(s))
        self._graphs.add(graph)
        self._queued(s)  # s waits for the calls before the capture
        return graph

    def synchronize(self, stream=None) -> None:
        """Wait for this rank's queued calls (on `stream`, else on the last call's stream, behind
        which every earlier call is queued); raise what the kernels reported."""
        if self._capturing is not None:
            raise A2AError("synchronize() inside capture(): nothing captured has run yet")
        self.backend.activate()
        waited = self._synchronized_stream(stream)
        try:
            self.backend.stream_synchronize(waited)
        except RuntimeFailure as e:  # a kernel that trapped (on_timeout="trap") said why first
            self._raise_reported(cause=e)
            raise
        self._order.synchronized(waited)
        if self.host_status[0]:
            self._raise_reported()

    def _synchronized_stream(self, stream):
        """The stream given, else the last call's (every earlier call is queued before it)."""
        return self._stream_outside_capture(stream) if stream is not None else self._order.latest()

    # -- profiling ----------------------------------------------------------------
    def profile_events(self):
        """(events, dropped) recorded since the last read (profile=True only); waits for the stream."""
        if self.profile_buffer is None:
            raise A2AError("profile_events() needs AllToAll(..., profile=True)")
        self.backend.activate()
        self.backend.stream_synchronize(self._synchronized_stream(None))
        events, dropped = self.profile_buffer.read(self.stream)
        self.profile_buffer.reset(self.stream)
        return events, dropped

    def clock_offset_ns(self) -> int:
        """Host monotonic clock minus this device's clock, in ns, to line up timelines across ranks.
        Collective: every rank calls it, as often as the others. Each device's clock is compared with
        rank 0's on the device (kernels_hip/clock.hip: within a fraction of a microsecond over NVLink;
        self.clock_sync says how close), and only rank 0's meets the host's clock, through one reading
        (profile.clock_offset): that reading's error, up to half a launch's round trip, shifts every
        rank alike. A rank that never calls it makes the others raise A2ATimeoutError naming it (rank
        0) or rank 0 (the others), after `timeout`; after any failure the syncs of this object are out
        of step (each rank counts its own), so later calls raise A2AError. Calls (dispatch, combine)
        are unaffected."""
        self._usable()
        if self._capturing is not None:
            raise A2AError("clock_offset_ns() cannot run while capture() records")
        if self._clock_failed is not None:
            raise A2AError(f"clock_offset_ns() is unusable after an earlier failure: {self._clock_failed}")
        self.backend.stream_synchronize(self._synchronized_stream(None))  # no call of ours still running
        try:
            return self._clock_sync_once()
        except Exception as error:
            self._clock_failed = str(error)
            raise

    def _clock_sync_pack(self):
        """clock_sync and its arguments, made on first use: all but the epoch and host offset are fixed."""
        if self._clock_kernel is None:
            kernel = self.lib.kernel("clock_sync")
            pack = kernel.pack()
            a = pack[0]
            a.heap = HeapView.of(self.heap)
            for name in ("box", "stamps", "from0", "done", "verdict"):
                setattr(a, "off_" + name, self.heap.offset_of(self.buf["clock_" + name].ptr))
            a.rounds, a.timeout_ns = CLOCK_ROUNDS, timeout_ns(self.timeout)
            self._clock_kernel = (kernel, pack)
        return self._clock_kernel

    def _clock_sync_once(self) -> int:
        buf = self.buf
        host = clock_offset(self.backend, self.lib, self.stream) if self.rank == 0 else 0
        self._clock_epoch += 1
        kernel, pack = self._clock_sync_pack()
        pack[0].host_offset, pack[0].epoch = host & (2**64 - 1), self._clock_epoch
        stamps = np.zeros((self.world, CLOCK_ROUNDS, 2), np.uint64)  # a round that never completes stays 0
        verdict = np.zeros(1, np.uint32)                             # the epoch once this rank's part is done
        self.backend.copy_to_device(buf["clock_stamps"].ptr, stamps, self.stream)
        self.backend.copy_to_device(buf["clock_verdict"].ptr, verdict, self.stream)
        kernel.launch(pack, 1, 1, self.stream)
        from0 = np.zeros(2 * CLOCK_ROUNDS + 1, np.uint64)
        for array, name in ((stamps, "stamps"), (from0, "from0"), (verdict, "verdict")):
            self.backend.copy_to_host(array, buf["clock_" + name].ptr, self.stream)
        self.backend.stream_synchronize(self.stream)
        if verdict[0] != self._clock_epoch:
            if self.rank == 0:  # the peer it waited for: its first word went out, its rounds never ended
                late = tuple(r for r in range(1, self.world) if stamps[r, 0, 0] and not stamps[r].all())
                raise A2ATimeoutError(f"clock sync: rank {late[0] if late else '?'} never arrived (no answer "
                                      f"within {self.timeout:.1f} s)", late)
            raise A2ATimeoutError(f"clock sync: rank 0 never arrived (no word within {self.timeout:.1f} s)", (0,))
        if self.rank == 0:
            self.clock_sync = ClockSync(0, 0, 0.0)
            return host
        self.clock_sync = clock_sync_from_stamps(from0[:-1].reshape(CLOCK_ROUNDS, 2), stamps[0])
        return int(from0[-1].astype(np.int64)) - self.clock_sync.offset_ns

    # -- teardown -----------------------------------------------------------------
    def close(self) -> None:
        """Idempotent; waits (bounded) for peers before unmapping the heap."""
        if self.heap.closed:
            return
        self._repeat_dispatch = self._repeat_combine = None  # (their quick launches hold launch sites)
        try:
            self.backend.activate()
            self.backend.stream_synchronize(self._synchronized_stream(None))
        except Exception:
            pass
        for graph in list(self._graphs):
            graph.close()
        if self._expert_y_buffer is not None:
            self._expert_y_free()
            self._expert_y_buffer = None
        try:
            self.heap.close()  # frees our memory even when the barrier before it times out
        except A2ATimeoutError:
            if self._broken is None:
                raise
            # A peer already timed out on us: it is late or gone, and its absence here is no news.
        finally:
            if self.profile_buffer is not None:
                self.profile_buffer.free()
            self.lib.close()
            self.backend.stream_destroy(self.stream)
            self._free_host_status()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
