"""Multi-rank cases of the exchange itself: shapes, edge cases, transfer modes, narrow partials, the fused expert,
combine's kernels, geometry and launch sites (run under mpiexec by the tests).

Every case draws the whole world's inputs from a seed, poisons the outputs,
runs the library and checks this rank's outputs against pyhipa2a.reference.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

import pyhipa2a
from pyhipa2a import AllToAll
from pyhipa2a.config import DEFAULT_PUSH_BACK_BYTES, DEFAULT_PUSH_BYTES
from pyhipa2a.dtypes import resolve
from pyhipa2a.kernels import route_chunks
from pyhipa2a.testing import (WEIGHTS_AT, draw_world, layout_arguments, run_round,
                              weights_where)


def token_counts(mode: str, world: int, M: int, rng) -> list[int] | None:
    if mode == "random":
        return None                      # gpu-mode: drawn in [1, M)
    if mode == "full":
        return [M] * world
    if mode == "some_empty":             # rank 0 (and every other rank) sends nothing
        return [0 if r % 2 == 0 else int(rng.integers(1, M + 1)) for r in range(world)]
    if mode == "all_empty":
        return [0] * world
    if mode == "staggered":              # even ranks full, odd ranks one token: both sides of a threshold
        return [M if r % 2 == 0 else 1 for r in range(world)]
    raise ValueError(mode)


def case_shape(comm, E, k, H, M, dtype="float16", counts="random", routing="random", rounds="2", seed="0",
               row_layout="packed"):
    E, k, H, M, rounds, seed = int(E), int(k), int(H), int(M), int(rounds), int(seed)
    world = comm.Get_size()
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M,
                  in_dtype=dtype, **layout_arguments(row_layout)) as a2a:
        for i in range(rounds):
            rng = np.random.default_rng(1000 * seed + i)
            inputs = draw_world(1000 * seed + i, world, E, k, H, M, dtype,
                                token_counts(counts, world, M, rng), routing)
            weights_at = WEIGHTS_AT[i % 2]  # both ways in every case, and each after the other
            err = run_round(a2a, inputs, weights_at=weights_at)
            print(f"rank {a2a.rank} round {i}: T={len(inputs.xs[a2a.rank])} weights to {weights_at} "
                  f"max err {err:.3g}")


def checked_call(a2a, inputs, exact: bool, scales=None, weights_at="combine") -> tuple[np.ndarray, int, str]:
    """One call on poisoned outputs, checked against the oracle of a2a's mode: value for value on exact
    inputs (draw_world(exact=True)), within the tolerance otherwise. The fake expert is a kernel of
    its own, or with `scales` (one per rank) none: combine(expert_x, w, expert_scale=scales[rank]).
    The weights go to combine or to dispatch (`weights_at`).
    (This rank's y, for exact inputs how many of its elements the fp32 and narrow oracles give
    differently (check_combine_exact), the largest error as text.)"""
    from pyhipa2a import reference
    from pyhipa2a.testing import (check_combine_exact, check_dispatch_against_oracle,
                                  combine_error_against_oracle, poison)
    me = a2a.rank
    expert = reference.fake_expert if scales is None else reference.fused_expert(scales)
    poison(a2a)
    to_dispatch, w = weights_where(inputs.weights[me], weights_at)
    d = a2a.dispatch(inputs.xs[me], inputs.indices[me], **to_dispatch)
    y = (a2a.combine(a2a.fake_expert(d), w) if scales is None
         else a2a.combine(d.expert_x, w, expert_scale=scales[me]))
    a2a.synchronize()
    check_dispatch_against_oracle(a2a, inputs, d)
    if exact:
        return y.numpy().copy(), check_combine_exact(a2a, inputs, y, expert), "0 (exact)"
    return y.numpy().copy(), 0, f"{combine_error_against_oracle(a2a, inputs, y, expert=expert):.3g}"


def own_header(a2a) -> int:
    """The token-count header our last dispatch left in our own memory (its latest epoch's)."""
    words = a2a.buffers["tok_count"].numpy()[:, a2a.rank]  # one per epoch parity, epoch in the high half
    return int(words[np.argmax(words >> np.uint64(32))]) & 0xFFFFFFFF


def own_header_bits(a2a) -> tuple[bool, bool]:
    """(tokens pushed, contributions pushed back) in our last dispatch's header (kernels_hip/exchange.h:
    A2A_PUSHED_TOKENS, A2A_PUSHED_BACK)."""
    from pyhipa2a.host_kernels.exchange import count_header
    _, tokens, back = count_header(own_header(a2a), a2a.config.max_tokens)
    return tokens, back


def case_combine_kernel_choice(comm, choice):
    """PYHIPA2A_COMBINE_KERNEL is obeyed: the most tokens a call may have to take the small kernel."""
    os.environ["PYHIPA2A_COMBINE_KERNEL"] = choice
    try:
        with AllToAll(comm, num_experts=4 * comm.Get_size(), experts_per_token=4, hidden_dim=7168,
                      max_num_tokens=256) as a2a:
            most = a2a.config.small_combine_tokens
            print(f"rank {a2a.rank}: small combine up to {most} tokens ({choice})")
            if a2a.backend.kind == "host" or choice == "bulk":
                assert most == -1, most
            elif choice == "small":
                assert most == 256, most
            else:  # a token is 28 chunk items at H=7168: some calls small, the largest bulk
                assert 1 <= most < 256, most
    finally:
        del os.environ["PYHIPA2A_COMBINE_KERNEL"]


def case_combine_kernels_mixed(comm, E_per_rank, k, H, M, counts):
    """Even ranks combine with the small kernel, odd ranks with the bulk one (each rank chooses for
    its own call; pushed words and segment flags must mean the same to either), against the oracle."""
    os.environ["PYHIPA2A_COMBINE_KERNEL"] = "small" if comm.Get_rank() % 2 == 0 else "bulk"
    try:
        case_shape(comm, int(E_per_rank) * comm.Get_size(), k, H, M, "float16", counts, "random", 2, 9)
    finally:
        del os.environ["PYHIPA2A_COMBINE_KERNEL"]


def case_combine_kernels_agree(comm, H, M, dtype="float16"):
    """The small and the bulk combine kernel sum the same rows in the same order: bit-identical outputs
    on the same inputs (fp32 partials, fused expert and not)."""
    from pyhipa2a import reference
    from pyhipa2a.testing import combine_error_against_oracle, poison
    world, H, M = comm.Get_size(), int(H), int(M)
    E, k = 8 * world, 8
    objects = {}
    try:
        for choice in ("small", "bulk"):
            os.environ["PYHIPA2A_COMBINE_KERNEL"] = choice
            objects[choice] = AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M,
                                       in_dtype=dtype)
    finally:
        os.environ.pop("PYHIPA2A_COMBINE_KERNEL", None)
    try:
        for i, counts in enumerate(("full", "staggered", "random")):
            rng = np.random.default_rng(77 + i)
            inputs = draw_world(77 + i, world, E, k, H, M, dtype, token_counts(counts, world, M, rng), "random")
            me = comm.Get_rank()
            results, outs = {}, {}
            for choice, a2a in objects.items():
                poison(a2a)
                d = a2a.dispatch(inputs.xs[me], inputs.indices[me])
                y = (a2a.combine(a2a.fake_expert(d), inputs.weights[me]) if i % 2 == 0
                     else a2a.combine(d.expert_x, inputs.weights[me], expert_scale=1.5))
                results[choice], outs[choice] = y, y.numpy().copy()
            assert outs["small"].shape == outs["bulk"].shape
            assert np.array_equal(outs["small"].view(np.uint16), outs["bulk"].view(np.uint16)), \
                f"round {i}: the two combine kernels differ"
            expert = reference.fake_expert if i % 2 == 0 else reference.fused_expert([1.5] * world)
            combine_error_against_oracle(objects["small"], inputs, results["small"], expert=expert)
            print(f"rank {me} round {i}: T={len(inputs.xs[me])} kernels agree bit for bit")
    finally:
        for a2a in objects.values():
            a2a.close()


def case_narrow_partials(comm, H, dtype="float16", values="normal", rounds="2"):
    """narrow_partials=True and False on the same inputs, each against the oracle of its own mode:
    - values="exact" (pyhipa2a.testing.draw_world(exact=True): every fp32 sum is exact): value for
      value, and the two modes' oracles must differ somewhere in the world, so that the check tells
      a narrow call from an fp32 one (or from any other rounding);
    - values="normal" (gpu-mode's inputs): within the tolerance widened by narrow partials' slack
      (reference.narrow_partials_slack), and the two results must differ somewhere.
    The transfer mode (pull, push, mixed) comes from PYHIPA2A_PUSH_MAX_TOKENS."""
    H, rounds, exact = int(H), int(rounds), values == "exact"
    world = comm.Get_size()
    if world == 1:
        pytest.skip("partial sums cross only between ranks: nothing to compare on 1 rank")
    E, k, M = 4 * world, 4, 32  # top-4 of 4 experts a rank: most tokens have 2+ experts on some peer
    shape = dict(num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, in_dtype=dtype)
    with AllToAll(comm, narrow_partials=True, **shape) as narrow, AllToAll(comm, **shape) as wide:
        me, differing = narrow.rank, 0
        for i in range(rounds):
            rng = np.random.default_rng(500 + i)
            inputs = draw_world(500 + i, world, E, k, H, M, dtype, token_counts("staggered", world, M, rng),
                                exact=exact)
            ys = []
            for a2a in (narrow, wide):
                y, told_apart, err = checked_call(a2a, inputs, exact, weights_at=WEIGHTS_AT[i % 2])
                ys.append(y)
                print(f"rank {me} round {i}: narrow={a2a.config.narrow_partials} T={len(inputs.xs[me])} "
                      f"pushed={len(inputs.xs[me]) <= a2a.config.push_max_tokens} max err {err}")
            differing += told_apart if exact else int(np.count_nonzero(ys[0] != ys[1]))
        total = comm.allreduce(differing)
        assert total > 0, ("the two modes' oracles agree everywhere: these inputs test nothing" if exact
                           else "narrow and fp32 partials gave identical results everywhere")


def fused_scales(world: int) -> list[float]:
    """One expert_scale a rank for the fused-epilogue tests: none a power of two, so x * scale is
    inexact in the 16-bit formats and the contract's rounding rule shows; signs alternate."""
    return [1.5 * (1 + r) * (-1) ** r for r in range(world)]


def case_fused_expert(comm, H, dtype="float16", values="normal", narrow="0", rounds="2", row_layout="packed"):
    """combine(expert_x, w, expert_scale=fused_scales(world)[rank]): dispatch's expert_x stands in for
    expert_y, an expert with no kernel of its own. Against the oracle of that contract
    (reference.fused_expert: the scale joins the weight unrounded, except on a row that crosses to
    its token's owner alone, which is scaled and rounded on its way):
    - values="exact" (every product and fp32 sum exact): value for value, so a scale missing or
      doubled, or a rounding the contract does not make (or a missing one), on any path (own rows,
      partial sums, a single raw row; pulled or pushed) shows, at any number of ranks;
    - values="normal" (gpu-mode's inputs): within the usual tolerance.
    The transfer mode comes from PYHIPA2A_PUSH_MAX_TOKENS; `narrow` is AllToAll(narrow_partials=)."""
    H, rounds, exact, world = int(H), int(rounds), values == "exact", comm.Get_size()
    E, k, M = 4 * world, 4, 32  # several of a token's experts on one rank, and single ones
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, in_dtype=dtype,
                  narrow_partials=narrow == "1", **layout_arguments(row_layout)) as a2a:
        me = a2a.rank
        for i in range(rounds):
            rng = np.random.default_rng(700 + i)
            inputs = draw_world(700 + i, world, E, k, H, M, dtype, token_counts("staggered", world, M, rng),
                                exact=exact)
            _, _, err = checked_call(a2a, inputs, exact, fused_scales(world), WEIGHTS_AT[i % 2])
            pushed = len(inputs.xs[me]) <= a2a.config.push_max_tokens
            # A pushed call gets its contributions pushed back, and pushes its tokens unless its flags
            # follow a GPU-scope fence; the header says what the kernel (or its host twin) did.
            assert a2a.config.push_tokens == (not a2a.config.gpu_fence_publish)
            assert own_header_bits(a2a) == (pushed and a2a.config.push_tokens, pushed), (own_header_bits(a2a), pushed)
            print(f"rank {me} round {i}: T={len(inputs.xs[me])} pushed={pushed} "
                  f"tokens pushed={pushed and a2a.config.push_tokens} "
                  f"max err {err}")


def case_alternating(comm, calls="200"):
    """Two AllToAll objects of different shapes used alternately, token counts changing every call."""
    world = comm.Get_size()
    shapes = [dict(num_experts=2 * world, experts_per_token=2, hidden_dim=128, max_num_tokens=16),
              dict(num_experts=4 * world, experts_per_token=3, hidden_dim=264, max_num_tokens=8)]
    a2as = [AllToAll(comm, **s) for s in shapes]
    try:
        for call in range(int(calls)):
            a2a, s = a2as[call % 2], shapes[call % 2]
            rng = np.random.default_rng(call)
            counts = rng.integers(0, s["max_num_tokens"] + 1, size=world)
            inputs = draw_world(call, world, s["num_experts"], s["experts_per_token"], s["hidden_dim"],
                                s["max_num_tokens"], token_counts=counts,
                                routing="hot" if call % 7 == 3 else "random")
            run_round(a2a, inputs)
    finally:
        for a2a in a2as:
            a2a.close()


def case_misaligned_device_arrays(comm, narrow="0"):
    """expert_y and out 2 bytes off 16-byte alignment (contributions and the reduction take their
    element-wise paths, pushed or pulled; with narrow="1" their narrow-partials branches), and x too
    in round 0 (a call that would push words stages instead). In round 1 expert_y is expert_x as it
    is, and combine scales it (expert_scale, through the same element-wise paths). Inputs on the
    exact grid, so the results must equal the oracle of the call's partials mode value for value."""
    from pyhipa2a import reference
    from pyhipa2a.testing import check_combine_exact, check_dispatch_against_oracle, poison
    world = comm.Get_size()
    if narrow == "1" and world == 1:
        pytest.skip("partial sums cross only between ranks: nothing narrow to test on 1 rank")
    E, k, H, M = 4 * world, 3, 512, 8
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M,
                  narrow_partials=narrow == "1") as a2a:
        me, L, cap, told_apart = a2a.rank, a2a.config.local_experts, a2a.config.capacity, 0
        sizes = [M * H * 2, L * cap * H * 2, M * H * 2]  # x, expert_y, out: each 2 bytes into its own 64-byte slot
        starts = np.cumsum([0] + [n + 64 for n in sizes])
        scratch = a2a.backend.malloc_ipc(int(starts[-1]))
        try:
            for i in range(2):
                inputs = draw_world(40 + i, world, E, k, H, M, exact=True)
                T = len(inputs.xs[me])
                x, expert_y, out = (pyhipa2a.DeviceArray(a2a.backend, scratch + int(at) + skew, shape, np.float16)
                                    for at, shape, skew in zip(starts, [(T, H), (L, cap, H), (T, H)],
                                                               [2 - 2 * i, 2, 2]))
                poison(a2a)
                out.fill_bytes(0xFF)
                x.copy_from(inputs.xs[me])
                d = a2a.dispatch(x, inputs.indices[me])
                a2a.synchronize()
                check_dispatch_against_oracle(a2a, inputs, d)
                if i == 0:  # the fake expert's rows, made here
                    expert = reference.fake_expert
                    expert_y.copy_from((d.expert_x.numpy().astype(np.float32) * (1 + me)).astype(np.float16))
                    a2a.combine(expert_y, inputs.weights[me], out=out)
                else:  # the rows as dispatch left them, scaled by combine
                    scales = fused_scales(world)
                    expert = reference.fused_expert(scales)
                    expert_y.copy_from(d.expert_x.numpy())
                    a2a.combine(expert_y, inputs.weights[me], out=out, expert_scale=scales[me])
                a2a.synchronize()
                told_apart += check_combine_exact(a2a, inputs, out, expert)
                print(f"rank {me} round {i}: T={T} pushed={T <= a2a.config.push_max_tokens} exact")
        finally:
            a2a.backend.free(scratch)
        if narrow == "1":
            assert comm.allreduce(told_apart) > 0, "the inputs cannot tell narrow partials from fp32 ones"


def case_default_push_threshold(comm):
    """By default a call pushes while its 16-bit rows stay within DEFAULT_PUSH_BYTES, or where
    tokens are pulled (contributions alone come back pushed) DEFAULT_PUSH_BACK_BYTES, a row
    counted once per peer it can reach (min(top_k, ranks - 1)); capped at max_num_tokens; rows
    that are not whole 8-element groups never push. A limit asked for is taken as it is."""
    os.environ.pop("PYHIPA2A_PUSH_MAX_TOKENS", None)
    world = comm.Get_size()
    E = world * -(-4 // world)  # room for top-4, few experts a rank (small heaps)
    peers = max(1, min(4, world - 1))
    for k, H, M, whole in ((1, 512, 1024, 768), (4, 512, 1024, 768 // peers), (2, 8, 4, 4), (2, 1001, 4, 0)):
        with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
            expected = whole if a2a.config.push_tokens or not whole else min(M, 256 // max(1, min(k, world - 1)))
            assert a2a.config.push_max_tokens == expected, \
                (k, H, M, a2a.config.push_tokens, a2a.config.push_max_tokens, expected)
        with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M,
                      push_max_tokens=3) as a2a:
            assert a2a.config.push_max_tokens == (3 if H % 8 == 0 else 0), (k, H, M, a2a.config.push_max_tokens)
    # fp8 rows count at 16 bits, as the contributions that come back do: the same limit as fp16's
    fp8 = (dict(in_dtype="float8_e4m3", out_dtype="bfloat16"), dict(in_dtype="bfloat16", dispatch_dtype="float8_e4m3"))
    for dtypes in fp8:  # given, and quantized on the way
        with AllToAll(comm, num_experts=E, experts_per_token=4, hidden_dim=512, max_num_tokens=1024, **dtypes) as a2a:
            expected = (768 if a2a.config.push_tokens else 256) // peers
            assert a2a.config.push_max_tokens == expected, (dtypes, a2a.config.push_max_tokens, expected)
    assert (DEFAULT_PUSH_BYTES, DEFAULT_PUSH_BACK_BYTES) == (768 * 1024, 256 * 1024)  # the figures above assume them


def case_bf16_roundtrip_dtype(comm):
    """bf16 outputs come back as ml_dtypes.bfloat16 arrays."""
    world = comm.Get_size()
    with AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=32, max_num_tokens=4,
                  in_dtype="bfloat16") as a2a:
        inputs = draw_world(1, world, world, 1, 32, 4, "bfloat16")
        run_round(a2a, inputs)
        assert a2a.buffers["y"].numpy().dtype == resolve("bfloat16")


def case_launch_geometry(comm):
    """Launch geometry the device cannot hold (all blocks of a launch resident at once) is refused."""
    world = comm.Get_size()
    shape = dict(num_experts=world, experts_per_token=1, hidden_dim=64, max_num_tokens=4)
    # (what no device holds is refused on the host backend too, so a script tried there fails alike)
    with pytest.raises(ValueError, match="block_threads=100 must be a multiple of 32"):
        AllToAll(comm, **shape, block_threads=100)
    with pytest.raises(ValueError, match="grid_blocks=1000000 must be between 1 and"):
        AllToAll(comm, **shape, grid_blocks=1000000)
    if pyhipa2a.get_backend().kind == "host":
        pytest.skip("the host backend runs one block of one thread")
    with pytest.raises(ValueError, match="grid_blocks=4000 must be between 1 and"):  # (below 4096: this device's)
        AllToAll(comm, **shape, grid_blocks=4000)
    with AllToAll(comm, **shape, block_threads=128, grid_blocks=3) as a2a:
        assert (a2a.config.block_threads, a2a.config.blocks) == (128, 3)
        run_round(a2a, draw_world(9, world, world, 1, 64, 4))
    # Grids of no more blocks than dispatch's route chunks: its senders' first warp (first_sender in
    # kernels_hip/dispatch.hip, route chunks times a block's warps) wraps around the grid, to block 0 of
    # one block and to a routing block (block 2 with 8 chunks) of three.
    E, k = 8 * world, 8
    for blocks, M in ((1, 256), (3, 512)):
        assert route_chunks(k, M) >= blocks
        with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=64, max_num_tokens=M,
                      block_threads=128, grid_blocks=blocks) as a2a:
            assert a2a.config.blocks == blocks
            for seed, tokens in ((10, [M] * world), (11, [1] * world), (12, None)):
                run_round(a2a, draw_world(seed, world, E, k, 64, M, token_counts=tokens))


def case_posted_and_pulled_calls(comm):
    """One object (PYHIPA2A_POST_MIN_TOKENS=32, nothing pushed) whose calls alternate between posting (the
    largest source has 40 tokens) and pulling (16): every result against the oracle, and where the
    contributions landed, seen in rank 0's heap (8 tokens of its own). Posted, its peers' contributions to its
    tokens are in its contrib rows [r, :8] and rows [r, 8:] stay poisoned; pulled, its own contributions to
    rank r's tokens are there, rows [r, 8:16] too."""
    world = comm.Get_size()
    E, k, H, M, small = 4 * world, 4, 1024, 48, 8
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        assert a2a.config.post_min_tokens == 32 and a2a.config.push_max_tokens == 0
        for i, largest in enumerate((40, 16, 40, 16)):
            counts = [small] + [largest] * (world - 1)
            run_round(a2a, draw_world(90 + i, world, E, k, H, M, token_counts=counts))
            if a2a.rank != 0:
                continue
            written = (a2a.buffers["contrib"].numpy() != 0xFF).any(axis=2)  # [W, M]: rows of this call
            for r in range(1, world):
                assert written[r, :small].any() or largest < 32, (i, r)  # posted: the peers' parts for our tokens
                assert written[r, small:].any() == (largest < 32), (i, r, largest)  # pulled: ours for r's 16


def case_whole_token_items(comm, row_layout="packed", dispatch_dtype="", counts="random"):
    """On a grid of one block (8 warps), every call of more than a few tokens takes whole tokens first, then
    the last ones' segments (kernels_hip/dispatch.hip: fan_out; combine.hip: send_contributions and
    reduce_tokens in the bulk kernel):
    rows of 7 and of 3 segments (the last a part one), token counts that leave a remainder of segments, every
    result against the oracle, weights to dispatch and to combine."""
    world = comm.Get_size()
    for H, M in ((7168, 41), (2560, 67)):
        E, k = 4 * world, 4
        dtypes = dict(in_dtype="bfloat16", **({"dispatch_dtype": dispatch_dtype} if dispatch_dtype else {}))
        with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, grid_blocks=1,
                      **dtypes, **layout_arguments(row_layout)) as a2a:
            for i, weights_at in enumerate(WEIGHTS_AT):
                rng = np.random.default_rng(70 + i)
                inputs = draw_world(70 + i, world, E, k, H, M, "bfloat16", token_counts(counts, world, M, rng))
                err = run_round(a2a, inputs, weights_at=weights_at)
                print(f"rank {a2a.rank} H={H} T={len(inputs.xs[a2a.rank])} weights to {weights_at}: max err {err:.3g}")


def case_launch_sites_made_ahead(comm):
    """Every launch an object's calls make comes from a launch site (kernel, geometry, pack) made with the
    object (Backend.prepare_launch: on CUDA a one-node graph each, with device memory of its own), so
    that its device memory does not grow in the middle of a run: NumPy inputs, new device arrays (a call
    on arrays like the last call's but new), the same arrays again (repeats), one token and M (on a GPU
    the small and the bulk combine kernels: H = 7168 puts M = 128 above the small kernel's limit, 37
    tokens on 264 blocks of an H100, 76 on MI300X's 608), the fake expert as a kernel and fused into
    combine, a dispatch in groups (each exchange kernel's twin: one function on the host; the combine's twins
    also on its sending parts' share of the grid, where that is not the whole grid). Every kernel prepared
    is launched, and every launch is from a site prepared."""
    from pyhipa2a.config import combine_part_blocks
    from pyhipa2a.testing import dispatch_uploaded, free_inputs, fused_combine, upload_inputs

    from . import launch_sites_watched
    backend = pyhipa2a.get_backend()
    world = comm.Get_size()
    E, k, H, M = 4 * world, 4, 7168, 128
    with launch_sites_watched(backend) as (prepared, launched, _):
        with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, backend=backend) as a2a:
            made = set(prepared)
            kinds = {s[:3] for s in made}  # (a GPU's small combine kernel among them where it runs)
            small = a2a.config.small_combine_tokens >= 0
            twins = 0 if backend.kind == "host" else 2 + small
            parts = 0 if combine_part_blocks(a2a.config) == a2a.config.blocks else 1 + small
            assert len(kinds) == 3 + small + twins + parts, kinds
            assert not small or a2a.config.small_combine_tokens < M, a2a.config.small_combine_tokens
            for seed, tokens in ((1, 1), (2, M)):
                inputs = draw_world(seed, world, E, k, H, M, token_counts=[tokens] * world)
                run_round(a2a, inputs)
                run_round(a2a, inputs, fused=True)
                for _ in range(2):  # new arrays twice, each called five times (the last four repeats)
                    arrays = upload_inputs(a2a, inputs)
                    for fused in (False, True, True, False, False):
                        d = dispatch_uploaded(a2a, arrays)
                        y = fused_combine(a2a, d, arrays[2]) if fused else a2a.combine(a2a.fake_expert(d), arrays[2])
                    a2a.synchronize()
                    assert y.shape == (tokens, H)
                    free_inputs(a2a, arrays)
                me = a2a.rank
                d = a2a.dispatch(inputs.xs[me], inputs.indices[me], weights=inputs.weights[me], groups=2)
                expert_y = a2a.fake_expert(d)
                a2a.group_done(0)
                a2a.group_done(1)
                a2a.combine(expert_y)
                a2a.synchronize()
            assert prepared == made, prepared - made  # nothing prepared after the object was made
            assert launched <= made, launched - made
            assert {s[:3] for s in launched} == kinds, kinds - {s[:3] for s in launched}  # every kernel ran




def case_x_in_heap(comm, H="2048", M="64", one_block="0"):
    """A 16-bit x in x_buffer() (or NumPy x, copied there) is pulled by the peers where it lies, with nothing
    copied into the stage (kernels_hip/exchange.h: x in the heap); any other x is staged. Each round every
    rank gives its x as one of the three kinds, in turn (so a call mixes sources of every kind), after the
    stage and x_stage were poisoned: a peer that read the wrong one would find 0xFF. Every result against
    the oracle, and the header's A2A_X_IN_HEAP bit as the call's x says (nothing is pushed:
    PYHIPA2A_PUSH_MAX_TOKENS=0). With `one_block` the grid is one block, so that most calls have a token for
    every warp and stage whole tokens (their copies, or only their flags where x lies in the heap)."""
    from pyhipa2a.host_kernels.exchange import X_IN_HEAP
    from pyhipa2a.testing import (check_dispatch_against_oracle, combine_error_against_oracle, free_inputs,
                                  in_x_buffer, poison, upload_inputs)
    world, me, H, M = comm.Get_size(), comm.Get_rank(), int(H), int(M)
    E, k, kinds = 4 * world, 4, ("own", "heap", "numpy")
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, in_dtype="bfloat16",
                  **({"grid_blocks": 1} if one_block == "1" else {})) as a2a:
        assert a2a.config.push_max_tokens == 0
        buffer = a2a.x_buffer()
        assert buffer.shape == (M, H) and buffer.ptr == a2a.buffers["x_stage"].ptr and buffer is a2a.x_buffer()
        for i in range(2 * len(kinds)):
            inputs = draw_world(120 + i, world, E, k, H, M, "bfloat16", [M] * world if i % 2 else None)
            kind, x = kinds[(i + me) % len(kinds)], inputs.xs[me]
            poison(a2a)
            a2a.buffers["x_stage"].fill_bytes(0xFF)  # (peers read it only after our next header)
            uploaded = upload_inputs(a2a, inputs) if kind == "own" else []
            if kind == "heap":
                x = in_x_buffer(a2a, x)
            d = a2a.dispatch(uploaded[0] if uploaded else x, inputs.indices[me])
            y = a2a.combine(a2a.fake_expert(d), inputs.weights[me])
            a2a.synchronize()
            check_dispatch_against_oracle(a2a, inputs, d)
            err = combine_error_against_oracle(a2a, inputs, y)
            assert bool(own_header(a2a) & X_IN_HEAP) == (kind != "own"), (kind, hex(own_header(a2a)))
            free_inputs(a2a, uploaded)
            print(f"rank {me} round {i}: x {kind}, T={len(inputs.xs[me])}, max err {err:.3g}")


def case_x_in_heap_source_failed(comm, M="32"):
    """A source whose x lies in its x_stage and whose status word says it failed (poked into its heap's word,
    as a failed call leaves it, before its host has seen it) makes every peer that read its rows fail the call
    naming it (kernels_hip/dispatch.hip: check_heap_sources), or a reader that failed so before it (at 3 ranks
    and more a rank may read a failed reader's rows after it failed), its expert_x poisoned: the source's next
    call's x may have been written over those rows. (The source's own host never sees the poked word: no
    outcome of its call is checked.)"""
    from pyhipa2a.errors import A2AError
    from pyhipa2a.host_kernels import STATUS_TIMEOUT
    from pyhipa2a.testing import in_x_buffer, poison
    world, me, M, failing = comm.Get_size(), comm.Get_rank(), int(M), 1
    E, k, H = 4 * world, 4, 512
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, in_dtype="bfloat16",
                  timeout=10.0) as a2a:
        inputs = draw_world(140, world, E, k, H, M, "bfloat16", [M] * world)
        poison(a2a)
        if me == failing:
            a2a.buffers["status"].copy_from(np.array([STATUS_TIMEOUT, me, 1, 0], np.uint32))
        x = in_x_buffer(a2a, inputs.xs[me])
        comm.Barrier()
        a2a.dispatch(x, inputs.indices[me])
        if me == failing:
            try:
                a2a.synchronize()
            except A2AError:
                pass
            return
        assert (inputs.indices[failing] // (E // world) == me).any(), "the draw sends this rank none of its rows"
        with pytest.raises(A2AError, match=r"rank \d+ failed .* \(x in the heap\)") as raised:
            a2a.synchronize()
        assert (a2a.buffers["recv_x"].numpy().view(np.uint8) == 0xFF).all()
        print(f"rank {me}: {type(raised.value).__name__}: {str(raised.value)[:120]}")
