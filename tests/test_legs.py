"""A node exchange's launches (pyhipa2a.legs): every block of every rank on a device resident at once, and
each call's kernel chosen by its tokens (no GPU needed)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from pyhipa2a import config
from pyhipa2a.config import DEFAULT_BLOCKS_PER_MP, MAX_GRID_BLOCKS
from pyhipa2a.legs import Leg, Pair, check_block_threads, launch_geometry, load_kernels


def test_default_is_two_blocks_per_multiprocessor():
    assert DEFAULT_BLOCKS_PER_MP == 2
    assert launch_geometry(256, 132, 2, None) == 264
    assert launch_geometry(256, 132, 1, None) == 132        # registers allow one block per multiprocessor
    assert launch_geometry(256, 304, 4, None) == 608        # more would fit; two is the default


@pytest.mark.parametrize("ranks,blocks", [(2, 33), (4, 16), (8, 8), (66, 1), (132, 1), (264, 1)])
def test_ranks_sharing_a_device_leave_half_of_it_free(ranks, blocks):
    """Under MPS several ranks run kernels on one GPU at once: their blocks must all fit together, and leave
    multiprocessors free for the kernels a rank runs before its exchange (a GEMM, XLA's), which its peers'
    exchange kernels wait for."""
    assert launch_geometry(256, 132, 2, None, ranks) == blocks
    assert launch_geometry(256, 132, 4, None, ranks) == blocks  # (however many more would fit)
    assert ranks * blocks <= 66 or blocks == 1


def test_more_ranks_on_a_device_than_it_holds_blocks():
    with pytest.raises(ValueError, match="300 ranks drive this device, which holds 264 blocks of 256 threads of "
                                         "our kernels at once: fewer than one a rank"):
        launch_geometry(256, 132, 2, None, 300)


def test_explicit_grid_within_the_device():
    assert launch_geometry(128, 132, 4, 3) == 3
    assert launch_geometry(256, 132, 2, 264) == 264
    with pytest.raises(ValueError, match=r"grid_blocks=265 must be between 1 and 264 \(all blocks of a launch "
                                         r"resident at once: 132 multiprocessors x 2 blocks of 256 threads; "
                                         r"at most 4096 in all\)"):
        launch_geometry(256, 132, 2, 265)
    with pytest.raises(ValueError, match="grid_blocks=67 must be between 1 and 66 .* shared by the 4 ranks"):
        launch_geometry(256, 132, 2, 67, 4)


def test_threads_that_do_not_fit():
    with pytest.raises(ValueError, match="block_threads=512: the kernels' registers do not fit"):
        launch_geometry(512, 132, 0, None)
    with pytest.raises(ValueError, match="block_threads=100 must be a multiple of the warp size \\(32\\)"):
        check_block_threads(100, 32)
    with pytest.raises(ValueError, match="between 64 and 512"):
        check_block_threads(32, 64)
    check_block_threads(512, 64)


def test_grid_at_most_the_kernels_done_flags():
    """Each block of an exchange kernel releases its own done flag (finish in exchange.h): no launch
    may have more blocks than there are flags, however many the device would hold."""
    assert launch_geometry(32, 304, 32, None) == 608                   # the default stays two a multiprocessor
    assert launch_geometry(32, 304, 32, MAX_GRID_BLOCKS) == MAX_GRID_BLOCKS
    with pytest.raises(ValueError, match=f"grid_blocks={MAX_GRID_BLOCKS + 1} must be between 1 and {MAX_GRID_BLOCKS}"):
        launch_geometry(32, 304, 32, MAX_GRID_BLOCKS + 1)


@pytest.mark.parametrize("host,device", [("MAX_GRID_BLOCKS", "A2A_MAX_GRID"), ("MAX_WORLD", "A2A_MAX_WORLD"),
                                         ("MAX_BLOCK_THREADS", "A2A_MAX_BLOCK_THREADS"),
                                         ("MAX_WARPS_PER_BLOCK", "A2A_MAX_WARPS_PER_BLOCK"),
                                         ("MAX_LOCAL_EXPERTS", "A2A_MAX_LOCAL_EXPERTS")])
def test_limits_agree_with_the_kernels(host, device):
    header = (Path(config.__file__).resolve().parent.parent / "kernels_hip" / "exchange.h").read_text()
    found = re.search(rf"^#define {device} (\d+)u?\b", header, re.M)
    assert found, f"{device} not defined in exchange.h"
    assert int(found.group(1)) == getattr(config, host)


def test_route_chunks_fit_one_batch_of_count_loads():
    """A call's route chunks (kernels.MAX_ROUTE_CHUNKS) are at most the count words sum_counts loads at
    once (A2A_ROUTE_LOADS in dispatch.hip): a source's counts by source are then one round trip."""
    from pyhipa2a import kernels
    source = (Path(config.__file__).resolve().parent.parent / "kernels_hip" / "dispatch.hip").read_text()
    found = re.search(r"^#define A2A_ROUTE_LOADS (\d+)u?\b", source, re.M)
    assert found, "A2A_ROUTE_LOADS not defined in dispatch.hip"
    assert kernels.MAX_ROUTE_CHUNKS <= int(found.group(1))


class FakeKernel:
    """A kernel as a Leg uses it: packs, prepared sites and launches, recorded."""

    def __init__(self, name):
        self.name, self.launches, self.prepared = name, [], []

    def pack(self):
        from pyhipa2a.kernels import A2AArgs, ArgPack, CombineCall, DispatchCall
        return ArgPack((A2AArgs, DispatchCall if "dispatch" in self.name else CombineCall))

    def prepare(self, pack, grid, block):
        self.prepared.append((id(pack), grid, block))

    def launch(self, pack, grid, block, stream=None):
        self.launches.append((grid, block, stream))

    def repeater(self, pack, into, grid, block):
        into.copy_from(pack)
        return lambda stream: self.launch(into, grid, block, stream)


def test_a_combine_takes_the_small_kernel_up_to_its_tokens_the_bulk_one_above_and_each_twin_in_groups():
    kernels = {name: FakeKernel(name) for name in ("small", "small_phased", "bulk", "bulk_phased")}
    small, bulk = Pair(kernels["small"], kernels["small_phased"]), Pair(kernels["bulk"], kernels["bulk_phased"])
    leg = Leg(((small, 128, 3), (bulk, 256, 8)), 6, lambda args: None)
    for groups in (0, 4):
        leg.call.groups = groups
        for tokens, name, threads in ((0, "small", 128), (3, "small", 128), (4, "bulk", 256), (8, "bulk", 256)):
            want = kernels[name + ("_phased" if groups else "")]
            before = len(want.launches)
            leg.launch("stream", tokens)
            assert want.launches[before:] == [(6, threads, "stream")], (tokens, groups)
    assert sum(len(k.launches) for k in kernels.values()) == 8
    # Every site of both packs made with the leg: none later, in the middle of a run.
    for name, threads in (("small", 128), ("small_phased", 128), ("bulk", 256), ("bulk_phased", 256)):
        assert sorted(kernels[name].prepared) == sorted([(id(leg.pack), 6, threads), (id(leg.frozen), 6, threads)])
    assert leg.site(8)[0] is kernels["bulk"]  # (pyhipa2a.jax makes no calls in groups)


def test_a_combine_in_parts_sends_on_its_part_blocks_but_the_last_part_and_the_reduce_take_the_grid():
    """After dispatch(groups=G), parts 1 .. G - 1 send beside the caller's later GEMMs on part_blocks; part G
    (the last group's tokens) and the reduce run beside none of them, as does a whole combine."""
    from pyhipa2a.kernels import REDUCE_ONLY, WHOLE_COMBINE
    plain, phased = FakeKernel("bulk"), FakeKernel("bulk_phased")
    leg = Leg(((Pair(plain, phased), 256, 8),), 12, lambda args: None, part_blocks=3)
    G = 4
    leg.call.groups = G
    for phase in (*range(1, G + 1), REDUCE_ONLY):
        leg.call.phase = phase
        leg.launch("stream", 8)
    assert [grid for grid, _, _ in phased.launches] == [3, 3, 3, 12, 12]
    leg.call.groups, leg.call.phase = 0, WHOLE_COMBINE
    leg.launch("stream", 8)
    assert plain.launches == [(12, 256, "stream")]
    # Both geometries of the phased kernel made with the leg, for each pack; the plain kernel's one only.
    packs = (id(leg.pack), id(leg.frozen))
    assert sorted(phased.prepared) == sorted((pack, grid, 256) for pack in packs for grid in (3, 12))
    assert sorted(plain.prepared) == sorted((pack, 12, 256) for pack in packs)


def test_a_contiguous_dispatch_takes_the_placed_kernel_with_and_without_groups():
    """Contiguous rows wait for every expert's total as a call in groups does: the kernel that compiles both."""
    from pyhipa2a.config import Config

    class Library:
        def kernel(self, name):
            return FakeKernel(name)

    for layout, plain in (("packed", "a2a_dispatch"), ("contiguous", "a2a_dispatch_placed")):
        config = Config.of(2, num_experts=4, experts_per_token=2, hidden_dim=64, max_num_tokens=8, row_layout=layout)
        pair = load_kernels(Library(), config).dispatch
        assert (pair.plain.name, pair.grouped.name) == (plain, "a2a_dispatch_placed")


def test_a_dispatch_names_our_own_buffers_for_its_outputs_and_asks_no_pairing_check():
    """The kernel writes its outputs where the call names them: the host names ours once, in the pack that every
    launch (and every plan's frozen copy) starts from; only a JAX program's calls (pyhipa2a.jax) name XLA's, and
    only they ask the device whether the dispatch before was combined (the host pairs its own calls)."""
    from pyhipa2a.config import Config
    from pyhipa2a.kernels import OWN_OUTPUTS
    from pyhipa2a.legs import exchange_legs

    class Library:
        def kernel(self, name):
            return FakeKernel(name)

    config = Config.of(2, num_experts=4, experts_per_token=2, hidden_dim=64, max_num_tokens=8)
    offsets = {offset: 4096 * (i + 1) for i, offset in enumerate(OWN_OUTPUTS.values())}

    def fixed(args):
        args.local_base = 1 << 40
        for offset, value in offsets.items():
            setattr(args, offset, value)

    dispatch, _ = exchange_legs(load_kernels(Library(), config), config, fixed)
    for field, offset in OWN_OUTPUTS.items():
        assert getattr(dispatch.call, field) == (1 << 40) + offsets[offset], field
    assert dispatch.call.check_pairing == 0
    dispatch.repeater(8)  # a plan launches from the frozen copy: the same outputs
    assert bytes(dispatch.frozen[1]) == bytes(dispatch.call)
