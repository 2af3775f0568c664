"""An AllToAll's parameters: checked once, with their environment overrides, and frozen. `Config.of`
checks what can be checked before a device is open; `on_device` and `with_geometry` add what the device
decides; `node_part` derives a node's part of a call across nodes.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
from dataclasses import dataclass

import numpy as np

from .arguments import checked_bool, checked_int, checked_timeout, env_choice, env_int
from .dtypes import FP8_BLOCK, fp8_for_arch, plan_dtypes
from .errors import ConfigMismatchError
from .kernels import X_COPY, X_FP8, X_QUANTIZE_BF16, X_QUANTIZE_F16

# Limits the kernels are built for (kernels_hip/exchange.h).
MAX_LOCAL_EXPERTS = 1024   # A2A_MAX_LOCAL_EXPERTS
MAX_TOP_K = 32             # a token's slots are one bit each of a 32-bit mask
MAX_WORLD = 32             # A2A_MAX_WORLD
MAX_WARPS_PER_BLOCK = 32   # A2A_MAX_WARPS_PER_BLOCK
MAX_BLOCK_THREADS = 512    # A2A_MAX_BLOCK_THREADS: the kernels' register budget assumes it
MAX_GRID_BLOCKS = 4096     # A2A_MAX_GRID: blocks of an exchange kernel's launch (a done flag each)
DEFAULT_BLOCK_THREADS = 256
DEFAULT_BLOCKS_PER_MP = 2  # more warps to hide the link's latency (docs/PERFORMANCE.md)
SEGMENT_LANE_ELEMS = 32    # a row moves in segments of 32 elements a lane (A2A_CHUNKS in exchange.h)
MIN_WARP, MAX_WARP = 32, 64
# Pushed calls (kernels_hip/exchange.h): rows as tagged words while their bytes stay within these; after a
# GPU-scope fence (GPU_FENCE_PUBLISH_ARCHS) tokens are pulled and only contributions pushed (the smaller).
DEFAULT_PUSH_BYTES = 768 * 1024
DEFAULT_PUSH_BACK_BYTES = 256 * 1024
# Posted contributions (kernels_hip/exchange.h): a combine whose largest source has at least this many bytes of
# 16-bit rows stores its contributions into their owners' memory instead of leaving them for the owners to pull,
# with this share (percent) of every block's warps sending while the rest reduce.
DEFAULT_POST_BYTES = 8 * 1024 * 1024
DEFAULT_COMBINE_SEND_SHARE = 25
# A combine in parts (dispatch(groups=)): the share (percent) of the grid each sending part but the last runs on,
# beside the caller's GEMMs of the groups still to come (pyhipa2a.groups).
DEFAULT_COMBINE_PART_SHARE = 25
GPU_FENCE_PUBLISH_ARCHS = ("sm_90",)
# Combine's small kernel takes calls whose warps get at most this many chunk items each.
SMALL_COMBINE_ITEMS_PER_WARP = 1

STREAM_CHOICES = ("own", "current")
LAYOUT_CHOICES = ("packed", "by_source", "contiguous")
DEFAULT_ROW_ALIGN = 128  # row_layout="contiguous": each expert's rows start at a multiple of this (a GEMM tile's rows)
MAX_ROW_ALIGN = 2**16  # keeps the kernels' sums of rounded rows below 2^32
PRODUCER_ORDERS = ("protocol", "stream")
OUTPUTS_CHOICES = ("inputs", "ours")  # in the library of the call's inputs (pyhipa2a.outputs), or DeviceArray
COMBINE_KERNEL_CHOICES = ("auto", "small", "bulk")
PUBLISH_CHOICES = ("auto", "system", "gpu-fence")


def publish_with_gpu_fence(arch: str) -> bool:
    """Whether flags over data left in the sender's own memory follow a GPU-scope fence rather than a
    system-scope release (PYHIPA2A_PUBLISH: auto, system, gpu-fence)."""
    choice = env_choice("PYHIPA2A_PUBLISH", PUBLISH_CHOICES)
    return choice == "gpu-fence" or (choice == "auto" and arch in GPU_FENCE_PUBLISH_ARCHS)


@dataclass(frozen=True)
class Config:
    num_experts: int
    top_k: int
    hidden: int
    max_tokens: int
    in_dtype: np.dtype      # dispatch's x
    dispatch_dtype: np.dtype  # expert_x
    out_dtype: np.dtype     # combine's expert_y and y
    fp8: str | None         # the fp8 asked for ("float8_e4m3" settles on the device), or None
    timeout: float
    profile: bool
    narrow_partials: bool
    on_timeout: str
    producer_order: str
    stream: str
    row_layout: str
    world: int
    block_threads: int      # asked for (PYHIPA2A_BLOCK_THREADS), then settled
    grid_blocks: int | None  # asked for (PYHIPA2A_GRID_BLOCKS)
    push_request: int | None  # push_max_tokens asked for (PYHIPA2A_PUSH_MAX_TOKENS)
    region_tokens: int = 0  # > 0: one node's part of a call across nodes (pyhipa2a.hierarchy)
    ranks_on_device: int = 0  # ranks of the machine on our GPU where some are in other nodes; 0: ours
    outputs: str = "inputs"  # the library outputs are handed out in (pyhipa2a.outputs)
    row_align: int = DEFAULT_ROW_ALIGN  # row_layout="contiguous" only, as max_recv_rows
    max_recv_rows: int | None = None  # None: as many as a call may need (recv_rows)
    post_min_tokens: int = 0  # > 0: a combine whose largest source has at least this many tokens posts (0: never)
    # Set on the device (on_device, with_geometry):
    warp: int = MIN_WARP
    x_format: int = X_COPY
    gpu_fence_publish: bool = False
    push_max_tokens: int = 0
    blocks: int = 0
    small_combine_tokens: int = -1  # calls of at most this many tokens take the small combine kernel

    # -- derived sizes ---------------------------------------------------------
    @property
    def local_experts(self) -> int:
        return self.num_experts // self.world

    @property
    def weight_row_cols(self) -> int:
        """Columns of a row that carries a token's weights as two 16-bit halves each, in whole 16-byte
        pieces (the gradients' narrow exchange: pyhipa2a.jax_grad, pyhipa2a.torch)."""
        return max(8, -(-2 * self.top_k // 8) * 8)

    @property
    def capacity(self) -> int:
        """Rows an expert may receive: one a token of every rank."""
        return self.world * self.max_tokens

    @property
    def contiguous(self) -> bool:
        return self.row_layout == "contiguous"

    @functools.cached_property  # (asked at calls: rows_shape is expert_y's; a frozen object's, computed once)
    def recv_rows(self) -> int:
        """Rows of expert_x (and its meta, scales): L * W * M, or R = max_recv_rows contiguous. By default R is what
        a contiguous expert_x needs at most: every rank's every token sends a row to each of at most min(k, L) of
        our experts, and each expert's rows may end up to row_align - 1 rows short of the next multiple of
        row_align, where the next expert's start."""
        if not self.contiguous:
            return self.local_experts * self.capacity
        if self.max_recv_rows is not None:
            return self.max_recv_rows
        rows = self.capacity * min(self.top_k, self.local_experts) + self.local_experts * (self.row_align - 1)
        return -(-rows // self.row_align) * self.row_align

    @functools.cached_property
    def rows_shape(self) -> tuple[int, ...]:
        """The leading shape of expert_x, expert_meta, expert_x_scales and expert_y: [L, W*M], or [R] contiguous."""
        return (self.recv_rows,) if self.contiguous else (self.local_experts, self.capacity)

    @property
    def scale_cols(self) -> int:
        """float32 scales of an expert_x row: one per FP8_BLOCK elements in fp8 dispatch, else 0."""
        return self.hidden // FP8_BLOCK if self.fp8 else 0

    @property
    def void_slots(self) -> bool:
        """An index of -1 is a slot whose expert is on another node (a node part)."""
        return self.region_tokens > 0

    @property
    def by_source(self) -> bool:
        return self.row_layout == "by_source"

    @property
    def push_tokens(self) -> bool:
        """Whether a pushed call pushes its tokens too (flags without a GPU-scope fence)."""
        return not self.gpu_fence_publish

    @property
    def seg_elems(self) -> int:
        """Elements of a row a warp moves as one segment (the host twins move whole rows)."""
        return SEGMENT_LANE_ELEMS * self.warp if self.warp > 1 else self.hidden

    @property
    def nseg(self) -> int:
        return math.ceil(self.hidden / self.seg_elems)

    @property
    def x_seg_elems(self) -> int:
        """Dispatch's segments carry as many bytes in fp8 as in 16 bits: twice the elements."""
        return self.seg_elems * (2 if self.scale_cols and self.warp > 1 else 1)

    @property
    def x_nseg(self) -> int:
        return math.ceil(self.hidden / self.x_seg_elems)

    @property
    def push_room(self) -> int:
        """Tokens a pushed call may have at most, whatever the device: the pushed words' room."""
        return push_limit(self, DEFAULT_PUSH_BYTES)

    @property
    def token_bytes(self) -> int:
        """A staged token: its expert_x row, then in fp8 its scales, padded to 16 bytes (kernels_hip/fp8.h)."""
        row = self.hidden * self.dispatch_dtype.itemsize
        return row if not self.scale_cols else math.ceil((row + 4 * self.scale_cols) / 16) * 16

    @property
    def push_token_words(self) -> int:
        """A pushed token's tagged words: one per 4 bytes of its row, or in fp8 fp8.h's segments (codes,
        then scales) for the widest warp's segments, which hold any narrower warp's."""
        if not self.scale_cols:
            return self.hidden * self.dispatch_dtype.itemsize // 4
        seg = 2 * SEGMENT_LANE_ELEMS * MAX_WARP
        elems = math.ceil(self.hidden / seg) * seg
        return elems // 4 + elems // FP8_BLOCK

    @property
    def push_row_words(self) -> int:
        """Tagged words of a pushed contribution's row, padded to whole segments of the widest warp."""
        seg = SEGMENT_LANE_ELEMS * MAX_WARP
        return math.ceil(self.hidden / seg) * seg

    # -- making ----------------------------------------------------------------
    @classmethod
    def of(cls, world: int, *, num_experts: int, experts_per_token: int, hidden_dim: int, max_num_tokens: int,
           in_dtype="float16", out_dtype=None, dispatch_dtype=None, timeout: float = 10.0, profile: bool = False,
           block_threads: int | None = None, grid_blocks: int | None = None, push_max_tokens: int | None = None,
           narrow_partials: bool = False, producer_order: str = "protocol", on_timeout: str = "report",
           stream: str = "own", row_layout: str = "packed", outputs: str = "inputs", row_align: int | None = None,
           max_recv_rows: int | None = None) -> "Config":
        """The checked configuration over `world` ranks (else ValueError or TypeError naming the parameter)."""
        ins, moved, out, fp8 = plan_dtypes(in_dtype, dispatch_dtype, out_dtype)
        E, k, H, M = (checked_int(name, value, least=1) for name, value in (
            ("num_experts", num_experts), ("experts_per_token", experts_per_token), ("hidden_dim", hidden_dim),
            ("max_num_tokens", max_num_tokens)))
        if fp8 and H % FP8_BLOCK:
            raise ValueError(f"fp8 dispatch needs hidden_dim to be a multiple of {FP8_BLOCK} (one scale per "
                             f"{FP8_BLOCK}-element block); got {H}")
        narrow_partials, profile = checked_bool("narrow_partials", narrow_partials), checked_bool("profile", profile)
        timeout = checked_timeout(timeout)
        for name, value, choices, hint in (
                ("on_timeout", on_timeout, ("report", "trap"), ""),
                ("stream", stream, STREAM_CHOICES, " (a call's own stream= takes a stream object or handle)"),
                ("row_layout", row_layout, LAYOUT_CHOICES, ""), ("producer_order", producer_order, PRODUCER_ORDERS, ""),
                ("outputs", outputs, OUTPUTS_CHOICES, "")):
            if value not in choices:
                raise ValueError(f"{name} must be one of {choices}{hint}, not {value!r}")
        if (row_align is not None or max_recv_rows is not None) and row_layout != "contiguous":
            raise ValueError("row_align and max_recv_rows are for row_layout='contiguous'")
        row_align = DEFAULT_ROW_ALIGN if row_align is None else checked_int("row_align", row_align)
        if not 1 <= row_align <= MAX_ROW_ALIGN:
            raise ValueError(f"row_align must be in [1, {MAX_ROW_ALIGN}]; got {row_align}")
        if max_recv_rows is not None:
            max_recv_rows = checked_int("max_recv_rows", max_recv_rows, least=1)
            if max_recv_rows % row_align:
                raise ValueError(f"max_recv_rows={max_recv_rows} must be a multiple of row_align={row_align} (each "
                                 f"expert's rows are rounded up to it, the last one's too)")
        # (a parameter not given is its variable's, checked alike)
        push_max_tokens = (env_int("PYHIPA2A_PUSH_MAX_TOKENS") if push_max_tokens is None
                           else checked_int("push_max_tokens", push_max_tokens))
        if push_max_tokens is not None and push_max_tokens < 0:
            raise ValueError(f"push_max_tokens={push_max_tokens} must be >= 0")
        if block_threads is None:
            block_threads = env_int("PYHIPA2A_BLOCK_THREADS", DEFAULT_BLOCK_THREADS)
        if grid_blocks is None:
            grid_blocks = env_int("PYHIPA2A_GRID_BLOCKS")
        block_threads = checked_int("block_threads", block_threads, least=1)
        grid_blocks = None if grid_blocks is None else checked_int("grid_blocks", grid_blocks, least=1)
        # (what holds on every device, so the host backend refuses it too; a device may ask more: legs.py)
        if block_threads % 32 or block_threads > MAX_BLOCK_THREADS:
            raise ValueError(f"block_threads={block_threads} must be a multiple of 32 (of the warp size on AMD: 64) "
                             f"up to {MAX_BLOCK_THREADS}")
        if grid_blocks is not None and grid_blocks > MAX_GRID_BLOCKS:
            raise ValueError(f"grid_blocks={grid_blocks} must be between 1 and {MAX_GRID_BLOCKS} (and what the device "
                             "holds at once)")
        config = cls(E, k, H, M, ins, moved, out, fp8, timeout, profile, narrow_partials,
                     on_timeout, producer_order, stream, row_layout, int(world), block_threads, grid_blocks,
                     push_max_tokens,
                     outputs=outputs, row_align=row_align, max_recv_rows=max_recv_rows,
                     post_min_tokens=post_min_tokens(H, M))
        config.check_sizes()
        return config

    def check_sizes(self) -> None:
        """The sizes the kernels can index and the protocol can carry."""
        # A routing slot travels as e + E * place in 32 bits, and the kernels divide it by E, and a slot's
        # index t * k + j by k, exactly only below 2^31 (quot in kernels_hip/portability.h).
        for name, n in (("num_experts", self.num_experts), ("experts_per_token", self.top_k)):
            if n * self.max_tokens >= 2**31:
                raise ValueError(f"{name} * max_num_tokens must be below 2**31; got {n} * {self.max_tokens}")
        # A call's token count travels with three flag bits above it (A2A_PUSHED_TOKENS, A2A_PUSHED_BACK,
        # A2A_X_IN_HEAP).
        if self.max_tokens >= 2**29:
            raise ValueError(f"max_num_tokens must be below 2**29; got {self.max_tokens}")
        if self.top_k > MAX_TOP_K or (self.top_k > self.num_experts and not self.void_slots):
            raise ValueError(f"experts_per_token={self.top_k} must be <= num_experts and <= {MAX_TOP_K}")
        if self.num_experts % self.world:
            raise ValueError(f"num_experts={self.num_experts} must be divisible by the number of ranks ({self.world})")
        if self.world > MAX_WORLD:
            raise ValueError(f"at most {MAX_WORLD} ranks; got {self.world}")
        if self.local_experts > MAX_LOCAL_EXPERTS:
            raise ValueError(f"at most {MAX_LOCAL_EXPERTS} experts per rank; got {self.local_experts}")
        # A row's index travels as an int32 (slot_of, the kernels' rows); the kernels add up every expert's
        # rounded rows in 32 bits.
        if self.recv_rows >= 2**31:
            raise ValueError(f"expert_x would have {self.recv_rows} rows; at most 2**31 - 1")
        if self.contiguous and self.local_experts * (self.capacity + self.row_align) >= 2**32:
            raise ValueError(f"{self.local_experts} experts of up to {self.capacity} rows each, rounded up to "
                             f"{self.row_align}, cannot be counted in 32 bits")

    def node_part(self, nodes: int, ranks_per_node: int, ranks_on_device: int) -> "Config":
        """One node's part of a call across `nodes` nodes: its experts, every node's region of tokens."""
        if self.row_layout == "by_source":
            raise ValueError("row_layout='by_source' is for calls within one node: between nodes each rank's "
                             "rows come through its node's ranks, so expert_x is packed there")
        # (a node's sources carry every node's region: a combine there may reach the posting threshold where
        # no single rank's call can)
        part = dataclasses.replace(self, num_experts=self.num_experts // nodes, max_tokens=nodes * self.max_tokens,
                                   world=ranks_per_node, region_tokens=self.max_tokens,
                                   ranks_on_device=ranks_on_device,
                                   post_min_tokens=post_min_tokens(self.hidden, nodes * self.max_tokens))
        part.check_sizes()  # (its regions hold nodes times the tokens)
        return part

    def on_device(self, arch: str, warp: int) -> "Config":
        """This configuration on a device of `arch` whose warps have `warp` lanes (1: the host twins)."""
        fp8 = fp8_for_arch(self.fp8, arch) if self.fp8 else None
        moved = fp8 if fp8 is not None else self.dispatch_dtype
        ins = fp8 if fp8 is not None and self.in_dtype.itemsize == 1 else self.in_dtype
        x_format = (X_COPY if not self.scale_cols else X_FP8 if ins.itemsize == 1
                    else X_QUANTIZE_BF16 if ins.name == "bfloat16" else X_QUANTIZE_F16)
        on_device = dataclasses.replace(self, in_dtype=ins, dispatch_dtype=moved, warp=warp, x_format=x_format,
                                        gpu_fence_publish=publish_with_gpu_fence(arch))
        push = push_limit(on_device, DEFAULT_PUSH_BYTES if on_device.push_tokens else DEFAULT_PUSH_BACK_BYTES)
        return dataclasses.replace(on_device, push_max_tokens=push)

    def with_geometry(self, block_threads: int, blocks: int, small_combine_tokens: int) -> "Config":
        """This configuration launching `blocks` blocks of `block_threads` threads (pyhipa2a.legs)."""
        return dataclasses.replace(self, block_threads=block_threads, blocks=blocks,
                                   small_combine_tokens=small_combine_tokens)

    def settled_like(self, part: "Config") -> "Config":
        """This (world) configuration with what the device settled for its node part `part`."""
        names = ("in_dtype", "dispatch_dtype", "warp", "x_format", "gpu_fence_publish", "push_max_tokens",
                 "block_threads", "blocks", "small_combine_tokens")
        return dataclasses.replace(self, **{name: getattr(part, name) for name in names})

    def check_agrees(self, comm, backend_kind: str) -> None:
        """Collective: ConfigMismatchError naming the ranks whose configuration differs from rank 0's, and how."""
        mine = {"num_experts": self.num_experts, "experts_per_token": self.top_k, "hidden_dim": self.hidden,
                "max_num_tokens": self.max_tokens, "in_dtype": self.in_dtype.name,
                "dispatch_dtype": self.dispatch_dtype.name, "out_dtype": self.out_dtype.name, "backend": backend_kind,
                "push_max_tokens": self.push_max_tokens, "post_min_tokens": self.post_min_tokens,
                "narrow_partials": self.narrow_partials, "region_tokens": self.region_tokens,
                "row_layout": self.row_layout, "row_align": self.row_align, "rows of expert_x": self.recv_rows}
        everyone = comm.allgather(hashlib.sha256(repr(mine).encode()).hexdigest())
        if len(set(everyone)) > 1:
            configs = comm.allgather(mine)
            first = configs[0]
            differ = tuple(r for r, c in enumerate(configs) if c != first)
            how = "; ".join(f"rank {r}: " + ", ".join(f"{name} {value!r} (rank 0: {first[name]!r})"
                                                     for name, value in configs[r].items() if value != first[name])
                            for r in differ)
            raise ConfigMismatchError(f"AllToAll configuration differs across ranks: ranks {list(differ)} differ "
                                      f"from rank 0 ({how})", ranks=differ)


def post_min_tokens(hidden: int, max_tokens: int) -> int:
    """Tokens of a call's largest source from which its combine posts (0: never, or no call of max_tokens tokens
    reaches it): PYHIPA2A_POST_MIN_TOKENS, or as many as make DEFAULT_POST_BYTES of 16-bit rows. An owner that
    takes its contributions pushed back still takes them so (kernels_hip/combine.hip)."""
    tokens = env_int("PYHIPA2A_POST_MIN_TOKENS")
    if tokens is None:
        tokens = -(-DEFAULT_POST_BYTES // (hidden * 2))
    elif tokens < 0:
        raise ValueError(f"PYHIPA2A_POST_MIN_TOKENS={tokens} must be >= 0")
    return tokens if tokens <= max_tokens else 0


def combine_send_percent() -> int:
    """The share of every block's warps that send in a posting combine while the others reduce:
    PYHIPA2A_COMBINE_SEND_SHARE percent (default DEFAULT_COMBINE_SEND_SHARE); the kernel takes at least one warp
    and one fewer than the block's (kernels_hip/exchange.h: split_grid). 0 for 100: every warp sends, then
    reduces (as a block of one warp always does)."""
    share = _grid_share("PYHIPA2A_COMBINE_SEND_SHARE", DEFAULT_COMBINE_SEND_SHARE)
    return 0 if share == 100 else share


def combine_part_blocks(config: Config) -> int:
    """Blocks of a combine's sending parts after dispatch(groups=), all but the last: PYHIPA2A_COMBINE_PART_SHARE
    percent of the grid (default DEFAULT_COMBINE_PART_SHARE), at least one. They send while the caller's GEMMs of
    the later groups run, which the rest of the device is left to (on the whole grid they slowed those GEMMs
    more than they gained); the last part and the reduce run beside no GEMM of ours and take the whole grid."""
    return max(1, config.blocks * _grid_share("PYHIPA2A_COMBINE_PART_SHARE", DEFAULT_COMBINE_PART_SHARE) // 100)


def _grid_share(variable: str, default: int) -> int:
    share = env_int(variable, default)
    if not 0 < share <= 100:
        raise ValueError(f"{variable}={share} must be a percentage in (0, 100]")
    return share


def push_limit(config: Config, default_bytes: int) -> int:
    """Calls of at most this many tokens push (0: none): as asked, or while their 16-bit rows, once per peer
    they reach, stay within `default_bytes`; rows must be a multiple of 8 elements (read 8 a lane)."""
    requested = config.push_request
    if requested is None:
        peers_per_token = max(1, min(config.top_k, config.world - 1))
        requested = default_bytes // (config.hidden * config.out_dtype.itemsize * peers_per_token)
    return min(int(requested), config.max_tokens) if config.hidden % 8 == 0 else 0
