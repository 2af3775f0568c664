"""A node exchange's two call kinds as launches: which kernel, on how many blocks, from which arguments.

Blocks of a launch wait on each other's flags, so the whole grid (of every rank that drives the device)
must be resident at once; every launch takes that grid however few items a call has, but a combine's sending
parts before its last (config.combine_part_blocks), whose blocks wait for none of each other's flags.

Each kernel comes twice: the one of calls in groups (dispatch(groups=), and combine's parts after it) and
the one of calls without, which compiles none of that (a dispatch's rows laid out contiguously take the
former always: they wait for every expert's total as a grouped call does). Each leg packs its arguments
twice: the full path's pack, and a plan's copy of it (Kernel.repeater); every launch site is made with the
object (Kernel.prepare), so no call takes device memory later.
"""
from __future__ import annotations

import ctypes
import itertools
from typing import NamedTuple

from .arguments import env_choice
from .config import (COMBINE_KERNEL_CHOICES, DEFAULT_BLOCKS_PER_MP, MAX_BLOCK_THREADS, MAX_GRID_BLOCKS,
                     MAX_WARPS_PER_BLOCK, SMALL_COMBINE_ITEMS_PER_WARP, Config, combine_part_blocks)
from .kernels import DISPATCH_KERNELS, WHOLE_COMBINE, field_addresses, name_own_outputs


def check_block_threads(threads: int, warp: int) -> None:
    most = min(MAX_BLOCK_THREADS, MAX_WARPS_PER_BLOCK * warp)
    if threads % warp or not warp <= threads <= most:
        raise ValueError(f"block_threads={threads} must be a multiple of the warp size ({warp}) "
                         f"between {warp} and {most}")


def launch_geometry(threads: int, multiprocessors: int, per_mp: int, grid_blocks: int | None,
                    ranks_on_device: int = 1) -> int:
    """Blocks per launch: the device holds per_mp blocks of `threads` threads of our kernels on each
    multiprocessor (the runtime's occupancy figure), and the ranks on it share them. Default:
    DEFAULT_BLOCKS_PER_MP a multiprocessor for a rank alone on its device; ranks that share one take, all
    together, a block on half its multiprocessors. A rank's kernel that waits for a peer's holds its
    multiprocessors; were they all held, the peer's GEMM or XLA kernel that comes before its exchange would
    find none to start on, and both would wait out the timeout (docs/PREFILL.md)."""
    if per_mp < 1:
        raise ValueError(f"block_threads={threads}: the kernels' registers do not fit that many threads "
                         "in one block on this device")
    most = min(MAX_GRID_BLOCKS, multiprocessors * per_mp // ranks_on_device)
    if most < 1:
        raise ValueError(f"{ranks_on_device} ranks drive this device, which holds {multiprocessors * per_mp} blocks "
                         f"of {threads} threads of our kernels at once: fewer than one a rank")
    alone = multiprocessors * min(DEFAULT_BLOCKS_PER_MP, per_mp)
    blocks = grid_blocks or min(most, alone if ranks_on_device == 1 else
                                max(1, multiprocessors // (2 * ranks_on_device)))
    if not 1 <= blocks <= most:
        shared = f", shared by the {ranks_on_device} ranks that drive this device" if ranks_on_device > 1 else ""
        raise ValueError(f"grid_blocks={blocks} must be between 1 and {most} (all blocks of a launch resident "
                         f"at once: {multiprocessors} multiprocessors x {per_mp} blocks of {threads} threads"
                         f"{shared}; at most {MAX_GRID_BLOCKS} in all)")
    return blocks


class Pair(NamedTuple):
    """A kernel of calls without groups, and its twin for calls in groups."""
    plain: object
    grouped: object


class Kernels(NamedTuple):
    """The kernels of a node exchange's calls, loaded when it is made (nothing may load while a capture records)."""
    dispatch: Pair
    combine: Pair
    small_combine: Pair | None  # combine's small-call kernels (a warp a chunk, half the threads), or None
    fake_expert: object


def load_kernels(library, config: Config) -> Kernels:
    out16 = "bf16" if config.out_dtype.name == "bfloat16" else "f16"
    small = None
    choice = env_choice("PYHIPA2A_COMBINE_KERNEL", COMBINE_KERNEL_CHOICES)  # (checked on the host backend too)
    if config.warp > 1 and choice != "bulk":
        small = Pair(library.kernel(f"a2a_combine_small_{out16}"), library.kernel(f"a2a_combine_small_{out16}_phased"))
    expert = f"expert_dequantize_{out16}" if config.scale_cols else f"expert_scale_{out16}"
    dispatch = DISPATCH_KERNELS[config.x_format]
    placed = library.kernel(dispatch + "_placed")
    return Kernels(Pair(placed if config.contiguous else library.kernel(dispatch), placed),
                   Pair(library.kernel(f"a2a_combine_{out16}"), library.kernel(f"a2a_combine_{out16}_phased")),
                   small, library.kernel(expert))


def settle_geometry(config: Config, backend, device, kernels: Kernels, ranks_on_device: int) -> Config:
    """`config` with its launch geometry on `device`: threads a block, blocks a launch, and the most tokens
    a combine may have to take the small kernel (-1: none). The small kernel (half the threads) is used
    only where the device holds as many of its blocks a multiprocessor, so the grid stays resident."""
    warp = config.warp
    if warp == 1:
        return config.with_geometry(1, 1, -1)
    threads = config.block_threads
    check_block_threads(threads, warp)
    per_mp = min(backend.resident_blocks(k.function, threads) for k in (*kernels.dispatch, *kernels.combine))
    blocks = launch_geometry(threads, device.multiprocessors, per_mp, config.grid_blocks, ranks_on_device)
    choice, half = env_choice("PYHIPA2A_COMBINE_KERNEL", COMBINE_KERNEL_CHOICES), threads // 2
    small = kernels.small_combine  # (None where the choice is "bulk")
    if (small is None or half < warp or half % warp
            or min(backend.resident_blocks(k.function, half) for k in small) < per_mp):
        if choice == "small":
            raise ValueError(f"PYHIPA2A_COMBINE_KERNEL=small: the small combine kernel cannot run beside "
                             f"blocks of {threads} threads on this device")
        return config.with_geometry(threads, blocks, -1)
    chunks = config.nseg * (config.seg_elems // (8 * warp))  # a token's chunk items
    most = config.max_tokens if choice == "small" else SMALL_COMBINE_ITEMS_PER_WARP * blocks * (half // warp) // chunks
    return config.with_geometry(threads, blocks, most)


class Leg:
    """One call kind's launches: `choices` ((Pair, threads a block, most tokens), ...), the first whose
    most tokens a call's fit, and of its pair the kernel of the call's `groups` (every call struct has
    that field); `call` is the per-call argument struct of the pack the full path writes."""

    def __init__(self, choices: tuple, blocks: int, fixed, part_blocks: int | None = None):
        self.choices, self.blocks = choices, blocks
        self.part_blocks = part_blocks or blocks  # a combine's sending parts but the last (_grid)
        kernel = choices[0][0].plain
        self.pack, self.frozen = kernel.pack(), kernel.pack()
        # every call argument's host address in the pack the repeater launches from (fixed for the pack's life)
        self.repeater_places = field_addresses(self.frozen[1], (name for name, *_ in self.frozen[1]._fields_))
        fixed(self.pack[0])
        self.call = self.pack[1]
        for pair, threads, _ in choices:
            for kernel in dict.fromkeys(pair):  # (a contiguous dispatch's pair is one kernel twice)
                grids = {blocks, self.part_blocks} if kernel is pair.grouped else {blocks}
                for pack, grid in itertools.product((self.pack, self.frozen), sorted(grids)):
                    kernel.prepare(pack, grid, threads)

    def kernel_for(self, tokens: int, grouped: bool) -> tuple:
        """(kernel, threads a block) of a call of `tokens` tokens, in groups or not."""
        for pair, threads, most in self.choices:
            if tokens <= most:
                return pair.grouped if grouped else pair.plain, threads
        raise AssertionError(f"no kernel takes {tokens} tokens")  # (the last choice takes any)

    def launch(self, stream, tokens: int) -> None:
        """The call whose arguments the pack holds, on `stream`."""
        kernel, threads = self.kernel_for(tokens, self.call.groups != 0)
        kernel.launch(self.pack, self._grid(), threads, stream)

    def site(self, tokens: int) -> tuple:
        """(kernel, blocks, threads a block, the address of the fixed arguments) of a call of `tokens` tokens
        without groups, for a launch from outside Python (pyhipa2a.jax) with call arguments of its own."""
        kernel, threads = self.kernel_for(tokens, False)
        return kernel, self.blocks, threads, ctypes.addressof(self.pack.arguments[0])

    def repeater(self, tokens: int):
        """A runtime Launcher of the call the pack holds now, whatever is written to it later (a plan's launch: the
        one before it must be dropped, since both launch from `frozen`)."""
        kernel, threads = self.kernel_for(tokens, self.call.groups != 0)
        return kernel.repeater(self.pack, self.frozen, self._grid(), threads)

    def _grid(self) -> int:
        """Blocks of the call the pack holds: part_blocks for a combine's part g + 1 that sends group g < G - 1;
        the whole grid otherwise (a leg whose parts take the whole grid, a dispatch's, asks no call)."""
        if self.part_blocks == self.blocks:
            return self.blocks
        phase = self.call.phase
        return self.part_blocks if WHOLE_COMBINE < phase < self.call.groups else self.blocks


def exchange_legs(kernels: Kernels, config: Config, fixed) -> tuple[Leg, Leg]:
    """(dispatch, combine) of a node exchange whose kernels' fixed arguments `fixed(args)` fills."""
    everything = config.max_tokens
    dispatch = Leg(((kernels.dispatch, config.block_threads, everything),), config.blocks, fixed)
    name_own_outputs(dispatch.call, dispatch.pack[0])
    bulk = (kernels.combine, config.block_threads, everything)
    small = (kernels.small_combine, config.block_threads // 2, config.small_combine_tokens)
    combine = Leg((small, bulk) if config.small_combine_tokens >= 0 else (bulk,), config.blocks, fixed,
                  combine_part_blocks(config))
    return dispatch, combine
