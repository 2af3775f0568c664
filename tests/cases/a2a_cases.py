"""Multi-rank cases for dispatch/combine (run by tests/test_a2a.py under mpiexec).

Every case draws the whole world's inputs from a seed, poisons the outputs,
runs the library and checks this rank's outputs against pyhipa2a.reference.
"""
from __future__ import annotations

import contextlib
import math
import os
import types

import numpy as np
import pytest

import pyhipa2a
from pyhipa2a import A2AError, AllToAll
from pyhipa2a.a2a import DEFAULT_PUSH_BACK_BYTES, DEFAULT_PUSH_BYTES
from pyhipa2a.dtypes import resolve
from pyhipa2a.kernels import route_chunks
from pyhipa2a.testing import (WEIGHTS_AT, dispatch, draw_world, dtype_arguments, inputs_as_given, run_round,
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
                  in_dtype=dtype, row_layout=row_layout) as a2a:
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


def own_header_bits(a2a) -> tuple[bool, bool]:
    """(tokens pushed, contributions pushed back) in the token-count header our last dispatch left in
    our own memory (kernels_hip/exchange.h: A2A_PUSHED_TOKENS, A2A_PUSHED_BACK): its latest epoch."""
    from pyhipa2a.host_kernels.exchange import count_header
    words = a2a.buf["tok_count"].numpy()[:, a2a.rank]  # one per epoch parity, epoch in the high half
    _, tokens, back = count_header(int(words[np.argmax(words >> np.uint64(32))]) & 0xFFFFFFFF, a2a.max_tokens)
    return tokens, back


def case_combine_kernel_choice(comm, choice):
    """PYHIPA2A_COMBINE_KERNEL is obeyed: the most tokens a call may have to take the small kernel."""
    os.environ["PYHIPA2A_COMBINE_KERNEL"] = choice
    try:
        with AllToAll(comm, num_experts=4 * comm.Get_size(), experts_per_token=4, hidden_dim=7168,
                      max_num_tokens=256) as a2a:
            most = a2a.small_combine_tokens
            print(f"rank {a2a.rank}: small combine up to {most} tokens ({choice})")
            if a2a.backend.kind == "host" or choice == "bulk":
                assert most == -1 and a2a._small_combine is None, most
            elif choice == "small":
                assert most == 256 and a2a._small_combine is not None, most
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


class _RecordingKernel:
    """A kernel that records its launches and runs the real one (the host twin)."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, 0

    def launch(self, pack, grid, block, stream=None):
        self.launches += 1
        self.kernel.launch(pack, grid, block, stream)


def case_combine_kernel_per_call(comm):
    """_launch_combine takes the small kernel for calls of up to small_combine_tokens tokens and the bulk
    one above (recording kernels around the host twin, so the choice is seen on any backend)."""
    world = comm.Get_size()
    E, k, H, M = 4 * world, 2, 64, 8
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        small, bulk = _RecordingKernel(a2a._combine_kernel), _RecordingKernel(a2a._combine_kernel)
        a2a._small_combine, a2a.small_combine_tokens = (small, a2a.block_threads), 3
        a2a._combine_kernel = bulk
        for T, want in ((0, "small"), (3, "small"), (4, "bulk"), (M, "bulk")):
            before = (small.launches, bulk.launches)
            inputs = draw_world(5 + T, world, E, k, H, M, "float16", [T] * world, "random")
            err = run_round(a2a, inputs)
            took = "small" if small.launches > before[0] else "bulk" if bulk.launches > before[1] else None
            assert took == want and small.launches + bulk.launches == sum(before) + 1, (T, took, want)
            print(f"rank {a2a.rank}: T={T} took the {took} kernel, max err {err:.3g}")


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
                print(f"rank {me} round {i}: narrow={a2a.narrow_partials} T={len(inputs.xs[me])} "
                      f"pushed={len(inputs.xs[me]) <= a2a.push_max_tokens} max err {err}")
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
                  narrow_partials=narrow == "1", row_layout=row_layout) as a2a:
        me = a2a.rank
        for i in range(rounds):
            rng = np.random.default_rng(700 + i)
            inputs = draw_world(700 + i, world, E, k, H, M, dtype, token_counts("staggered", world, M, rng),
                                exact=exact)
            _, _, err = checked_call(a2a, inputs, exact, fused_scales(world), WEIGHTS_AT[i % 2])
            pushed = len(inputs.xs[me]) <= a2a.push_max_tokens
            # A pushed call gets its contributions pushed back, and pushes its tokens unless its flags
            # follow a GPU-scope fence; the header says what the kernel (or its host twin) did.
            assert a2a.push_tokens == (not a2a.gpu_fence_publish)
            assert own_header_bits(a2a) == (pushed and a2a.push_tokens, pushed), (own_header_bits(a2a), pushed)
            print(f"rank {me} round {i}: T={len(inputs.xs[me])} pushed={pushed} tokens pushed={pushed and a2a.push_tokens} "
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


def case_out_and_device_inputs(comm):
    """combine(out=...) writes the caller's array; device arrays (DLPack / our own) are used in place."""
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 96, 8
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        inputs = draw_world(7, world, E, k, H, M)
        me = a2a.rank
        T = len(inputs.xs[me])
        x_dev = a2a.expert_y_buffer().view((T, H))   # any device array of ours will do as input
        x_dev.copy_from(inputs.xs[me])
        d = a2a.dispatch(DLPackOnly(x_dev), inputs.indices[me])
        expert_y = a2a.fake_expert(d)
        out = pyhipa2a.DeviceArray(a2a.backend, a2a.buf["x_stage"].ptr, (T, H), np.float16, owner=a2a.heap)
        y = a2a.combine(expert_y, inputs.weights[me], out=out)
        a2a.synchronize()
        assert y is out
        from pyhipa2a import reference
        from pyhipa2a.testing import combine_error
        expected = reference.combine(inputs.xs, inputs.indices, inputs.weights, E, ranks=[me])[me]
        combine_error(out.numpy(), expected, np.float16)


def case_new_arrays_at_every_call(comm, weights_at="combine", out_given="0"):
    """A loop that hands over new arrays of ours at every call, with a new token count at most calls (a
    layer's activations, a router's output): after each leg's first call, every call takes the quick path
    (pyhipa2a.quick: the record's call on the new arrays' pointers and token count), and every one is
    right, checked against the oracle on poisoned outputs; the record's own arrays again repeat it as
    they are. A new array that differs from the record's in anything but its memory and token count (its
    element type, its stream, a NumPy array) takes the full path, which refuses a wrong one as ever."""
    from pyhipa2a.array import DeviceArray
    from pyhipa2a.testing import check_call, free_inputs, poison, upload_inputs
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 128, 8
    at_dispatch, out_given = weights_at == "dispatch", out_given == "1"
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        full, kept = [], []
        a2a._usable = lambda: (full.append(1), AllToAll._usable(a2a))[1]
        first = None
        outs = {}
        for i, T in enumerate((5, 3, 5, 8, 1, 5, 8)):
            counts = [(T + r) % M + 1 if i % 2 else T for r in range(world)]  # (ranks differ on odd rounds)
            inputs = draw_world(40 + i, world, E, k, H, M, token_counts=counts)
            arrays = upload_inputs(a2a, inputs)  # new buffers, new objects
            kept.append(arrays)
            if first is None:
                first = (arrays, inputs)
            elif i == 5:  # the record's own arrays again, refilled
                arrays, inputs = first[0], draw_world(40 + i, world, E, k, H, M, token_counts=[len(first[1].xs[0])] * world)
                for arr, fresh in zip(arrays, (inputs.xs[a2a.rank], inputs.indices[a2a.rank], inputs.weights[a2a.rank])):
                    arr.copy_from(fresh)
            x, idx, w = arrays[:3]
            mine = len(inputs.xs[a2a.rank])
            out = None
            if out_given:
                if mine not in outs:
                    outs[mine] = DeviceArray(a2a.backend, a2a.backend.malloc_ipc(mine * H * 2), (mine, H), np.float16,
                                             stream=a2a.stream)
                out = outs[mine]
            poison(a2a)
            full.clear()
            d = a2a.dispatch(x, idx, weights=w) if at_dispatch else a2a.dispatch(x, idx)
            y = a2a.combine(d.expert_x, None if at_dispatch else w, out=out, expert_scale=float(1 + a2a.rank))
            a2a.synchronize()
            assert d.num_tokens == mine and y.shape == (mine, H) and (out is None or y is out), (i, y.shape)
            check_call(a2a, inputs, d, y, fused=True)
            assert len(full) == (2 if i == 0 else 0), (i, full)  # the first call of each leg alone: the full path
        # What the full path must see: another element type (refused as ever), another stream, NumPy.
        inputs = draw_world(60, world, E, k, H, M, token_counts=[4] * world)
        x, idx, w = upload_inputs(a2a, inputs)[:3]
        kept.append((x, idx, w))
        wide = DeviceArray(a2a.backend, a2a.backend.malloc_ipc(4 * H * 4), (4, H), np.float32, stream=a2a.stream)
        kept.append((wide,))
        full.clear()
        with pytest.raises(TypeError, match="must have dtype float16"):
            a2a.dispatch(wide, idx)
        assert len(full) == 1
        poison(a2a)  # a refused call records nothing: a good one records again
        d = a2a.dispatch(x, idx)
        check_call(a2a, inputs, d, a2a.combine(d.expert_x, w, expert_scale=float(1 + a2a.rank)), fused=True)
        assert a2a._repeat_dispatch is not None and a2a._repeat_dispatch.quick is not None
        other = a2a.backend.stream_create()
        try:
            x_elsewhere = DeviceArray(a2a.backend, x.ptr, x.shape, x.dtype, stream=other)
            poison(a2a)
            full.clear()
            d = a2a.dispatch(x_elsewhere, idx)  # (ordered after `other` by the full path)
            y = a2a.combine(d.expert_x, inputs.weights[a2a.rank], expert_scale=float(1 + a2a.rank))
            a2a.synchronize()
            check_call(a2a, inputs, d, y, fused=True)
            assert len(full) == 2, full  # another stream, then NumPy weights: the full path each
        finally:
            a2a.synchronize()
            a2a.backend.stream_destroy(other)
        for arrays in kept:
            free_inputs(a2a, arrays)
        for out in outs.values():
            a2a.backend.free(out.ptr)
    print(f"rank {comm.Get_rank()} new arrays at every call ({weights_at}, out given: {out_given}): right")


def case_repeated_calls(comm):
    """A loop that hands over the same device arrays again repeats the last call without taking its
    arguments again (a2a.Repeat), and every such call is still right: new data in the same arrays, each
    call checked against the oracle on poisoned outputs. A change of the stream, the scale, an argument
    for a NumPy one, or a capture in between takes the full path (a new array of ours like the last
    one does not: case_new_arrays_at_every_call)."""
    from pyhipa2a.testing import check_call, free_inputs, poison, upload_inputs
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 128, 8
    counts = [5] * world
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        taken = []
        take = a2a._boundary.take
        def recording_take(name, *args, **kw):  # the fake expert (a test helper) is not a leg: not recorded
            if name != "fake_expert out":
                taken.append(name)
            return take(name, *args, **kw)
        a2a._boundary.take = recording_take
        full = []  # calls that took the full path (a repeat that pyhipa2a.quick makes never asks _usable)
        a2a._usable = lambda: (full.append(1), AllToAll._usable(a2a))[1]
        arrays = upload_inputs(a2a, draw_world(1, world, E, k, H, M, token_counts=counts))
        x, idx, w = arrays[:3]
        expert_y = a2a.expert_y_buffer()
        scale = float(1 + a2a.rank)  # gpu-mode's fake expert fused into combine: one object, repeated

        def refill(seed, arrays=(x, idx, w)):
            """New inputs for this rank written into the same (device or NumPy) arrays, outputs poisoned,
            the record of taken arguments cleared: the next call's inputs."""
            inputs = draw_world(seed, world, E, k, H, M, token_counts=counts)
            for arr, fresh in zip(arrays, (inputs.xs[a2a.rank], inputs.indices[a2a.rank], inputs.weights[a2a.rank])):
                if isinstance(arr, np.ndarray):
                    arr[...] = fresh
                else:
                    arr.copy_from(fresh)
            poison(a2a)
            taken.clear()
            full.clear()
            return inputs

        # The quick path's Python (pyhipa2a.quick) as the object calls it, watched: where the C helper is
        # built, a record's first repeat there makes its plan (pyhipa2a.again), which takes the later ones.
        from pyhipa2a import a2a as module, again
        in_python = []
        watched = {name: getattr(module, name) for name in ("quick_dispatch", "quick_combine")}
        for name, function in watched.items():
            setattr(module, name, lambda *args, f=function: (in_python.append(f), f(*args))[1])
        try:
            for i in range(4):
                inputs = refill(10 + i)
                in_python.clear()
                d = a2a.dispatch(x, idx)
                a2a.fake_expert(d, out=expert_y)
                y = a2a.combine(expert_y, w)
                a2a.synchronize()
                check_call(a2a, inputs, d, y)
                assert taken == ([] if i else ["x", "indices", "expert_y", "weights"]), (i, taken)
                # Each leg's record comes with its quick form (pyhipa2a.quick), which the later calls take
                assert len(full) == (0 if i else 2), (i, full)
                assert len(in_python) == (0 if i == 0 or (i > 1 and again.run is not None) else 2), (i, in_python)
            plans = [a2a._repeat_dispatch.quick.again, a2a._repeat_combine.quick.again]
            assert all(plans) == (again.run is not None), plans
            if a2a.backend.kind == "cuda" and again.run is not None:  # (its graphs launched from C)
                assert [len(plan[5]) for plan in plans] == [4, 4] and all(len(plan[4]) == 3 for plan in plans)
            # Each change takes the full path for the call it touches.
            y_before = y.numpy().astype(np.float32)
            # (A new array of ours standing in for x, a view of it here, takes the quick path on its pointer:
            # case_new_arrays_at_every_call.)
            for change, want in (("scale", ["expert_y", "weights"]), ("array", []),
                                 ("numpy", ["expert_y", "weights"])):
                a2a.combine(a2a.fake_expert(a2a.dispatch(x, idx), out=expert_y), w)  # the loop's call again
                taken.clear()
                d = a2a.dispatch(x.view(x.shape) if change == "array" else x, idx)
                a2a.fake_expert(d, out=expert_y)
                w_arg = inputs.weights[a2a.rank] if change == "numpy" else w
                y = (a2a.combine(expert_y, w_arg, expert_scale=3.0) if change == "scale"
                     else a2a.combine(expert_y, w_arg))
                a2a.synchronize()
                assert taken == want, (change, taken)
                if change == "scale":  # every rank scales its expert rows by 3: so does y, within rounding
                    np.testing.assert_allclose(y.numpy().astype(np.float32), 3 * y_before, rtol=1e-2, atol=1e-2)
            # A stream given as a handle (an int, as CuPy's .ptr is: a new object each time) repeats too.
            handle = a2a.backend.stream_handle(a2a.stream)
            for i in range(2):
                taken.clear()
                d = a2a.dispatch(x, idx, stream=int(str(handle)))
                a2a.combine(a2a.fake_expert(d, out=expert_y, stream=int(str(handle))), w, stream=int(str(handle)))
                a2a.synchronize()
                assert i == 0 or taken == [], ("handle", taken)  # (the first call may repeat the last one's)
            # Weights given to dispatch, and a caller's out=: repeated too, and right with new data.
            out = a2a.expert_y_buffer().view((counts[a2a.rank], H))  # any device array of ours will do
            # The scale is worked out afresh at every call here (a new float object of the same value, as
            # gpu-mode's harness passes 1 + rank): an equal scale repeats the call too.
            for i in range(3):
                inputs = refill(20 + i)
                d = a2a.dispatch(x, idx, weights=w)
                y = a2a.combine(d.expert_x, out=out, expert_scale=float(str(scale)))
                a2a.synchronize()
                assert y is out
                check_call(a2a, inputs, d, y, fused=True)
                assert taken == ([] if i else ["x", "indices", "weights", "expert_y", "out"]), ("to dispatch", i, taken)
                assert len(full) == (0 if i else 2), ("to dispatch", i, full)
            # ... but not -0.0 after 0.0 (equal, yet a product's sign follows the scale's), nor an int
            # after an equal float.
            for z, want in ((0.0, ["expert_y", "out"]), (float("-0.0"), ["expert_y", "out"]), (float("-0.0"), []),
                            (0, ["expert_y", "out"]), (0, [])):
                taken.clear()
                a2a.combine(a2a.dispatch(x, idx, weights=w).expert_x, out=out, expert_scale=z)
                a2a.synchronize()
                assert taken == want, ("scale", z, taken)
                assert a2a._last_scale[1] == 0.0 and math.copysign(1, a2a._last_scale[1]) == math.copysign(1, z)
            # NumPy inputs are copied at every call, even the same object refilled in place after a
            # device array held its argument's place: each call must follow the new data.
            host_x, host_idx, host_w = (np.empty_like(a) for a in (inputs.xs[a2a.rank], inputs.indices[a2a.rank],
                                                                   inputs.weights[a2a.rank]))
            for i in range(3):
                inputs = refill(30 + i, (host_x, host_idx, host_w))
                d = a2a.dispatch(host_x, host_idx)
                a2a.fake_expert(d, out=expert_y)
                y = a2a.combine(expert_y, host_w)
                a2a.synchronize()
                check_call(a2a, inputs, d, y)
                assert taken == ["x", "indices", "expert_y", "weights"], ("numpy", i, taken)
            graph = a2a.capture(lambda: a2a.combine(a2a.fake_expert(a2a.dispatch(x, idx), out=expert_y), w))
            graph.close()
            taken.clear()
            d = a2a.dispatch(x, idx)
            a2a.combine(a2a.fake_expert(d, out=expert_y), w)
            a2a.synchronize()
            assert taken == ["x", "indices", "expert_y", "weights"], ("after a capture", taken)
        finally:
            for name, function in watched.items():
                setattr(module, name, function)
            a2a._boundary.take = take
            free_inputs(a2a, arrays)


def case_stream_handle_views_cached(comm):
    """stream= given as an int handle (as CuPy's .ptr is) makes no new output views per call."""
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 64, 4
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        if a2a.backend.kind == "host":  # the GPU backends wrap a handle in a new object every time
            known = a2a.backend.stream_from_handle
            a2a.backend.stream_from_handle = lambda handle: type("Wrapped", (), {"stream": known(handle)})()
        handle = a2a.backend.stream_handle(a2a.stream)
        for i in range(5):
            inputs = draw_world(i, world, E, k, H, M)
            me = a2a.rank
            d = a2a.dispatch(inputs.xs[me], inputs.indices[me], stream=handle)
            a2a.combine(a2a.fake_expert(d, stream=handle), inputs.weights[me], stream=handle)
            a2a.synchronize(stream=handle)
        assert len(a2a._output_views) == 1, len(a2a._output_views)


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
        me, L, cap, told_apart = a2a.rank, a2a.local_experts, a2a.capacity, 0
        sizes = [M * H * 2, L * cap * H * 2, M * H * 2]  # x, expert_y, out: each 2 bytes into its own 64-byte slot
        starts = np.cumsum([0] + [n + 64 for n in sizes])
        scratch = a2a.backend.malloc_ipc(int(starts[-1]))
        try:
            for i in range(2):
                inputs = draw_world(40 + i, world, E, k, H, M, exact=True)
                T = len(inputs.xs[me])
                x, expert_y, out = (pyhipa2a.DeviceArray(a2a.backend, scratch + int(at) + skew, shape, np.float16)
                                    for at, shape, skew in zip(starts, [(T, H), (L, cap, H), (T, H)], [2 - 2 * i, 2, 2]))
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
                print(f"rank {me} round {i}: T={T} pushed={T <= a2a.push_max_tokens} exact")
        finally:
            a2a.backend.free(scratch)
        if narrow == "1":
            assert comm.allreduce(told_apart) > 0, "the inputs cannot tell narrow partials from fp32 ones"


class DLPackOnly:
    """Hides everything but DLPack, as a foreign framework's array would."""

    def __init__(self, arr):
        self._arr, self.shape, self.dtype = arr, arr.shape, arr.dtype

    def __dlpack__(self, **kw):
        return self._arr.__dlpack__(**kw)

    def __dlpack_device__(self):
        return self._arr.__dlpack_device__()


class ForeignDevice:
    """An array that claims to live on another device."""

    def __init__(self, shape, dtype, device_type, device_id):
        self.shape, self.dtype, self._dev = shape, np.dtype(dtype), (device_type, device_id)

    def __dlpack_device__(self):
        return self._dev

    def __dlpack__(self, **kw):  # pragma: no cover - must be refused before this
        raise AssertionError("the library must refuse the array before asking for its data")


def case_bad_inputs(comm):
    """Every rank makes the same bad call: each raises before any kernel runs, and the object stays usable."""
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 64, 8
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        inputs = draw_world(3, world, E, k, H, M, token_counts=[4] * world)
        x, idx, w = inputs.xs[a2a.rank], inputs.indices[a2a.rank], inputs.weights[a2a.rank]
        L, cap = a2a.local_experts, a2a.capacity

        with pytest.raises(A2AError, match="combine\\(\\) needs a preceding dispatch"):
            a2a.combine(np.zeros((L, cap, H), np.float16), w)
        with pytest.raises(TypeError, match="x must have dtype float16, got float32"):
            a2a.dispatch(x.astype(np.float32), idx)
        with pytest.raises(ValueError, match="x must have 2 dimensions"):
            a2a.dispatch(x.reshape(-1), idx)
        with pytest.raises(ValueError, match=r"x must have shape \(4, 64\), got \(4, 32\)"):
            a2a.dispatch(x[:, :32].copy(), idx)
        with pytest.raises(ValueError, match="x must be C-contiguous"):
            a2a.dispatch(np.asfortranarray(x), idx)
        with pytest.raises(ValueError, match="x has 9 tokens; .* max_num_tokens=8"):
            a2a.dispatch(np.zeros((9, H), np.float16), np.zeros((9, k), np.int32))
        with pytest.raises(TypeError, match="indices must have dtype int32, got int64"):
            a2a.dispatch(x, idx.astype(np.int64))
        with pytest.raises(ValueError, match=r"indices must have shape \(4, 2\)"):
            a2a.dispatch(x, idx[:3].copy())
        bad = idx.copy(); bad[2, 1] = E
        with pytest.raises(ValueError, match=rf"indices\[2, 1\] = {E} is outside \[0, {E}\)"):
            a2a.dispatch(x, bad)
        bad = idx.copy(); bad[1, 0] = -1
        with pytest.raises(ValueError, match="is outside"):
            a2a.dispatch(x, bad)
        bad = idx.copy(); bad[3, 1] = bad[3, 0]
        with pytest.raises(ValueError, match="indices row 3 repeats expert"):
            a2a.dispatch(x, bad)
        other = a2a.heap.device.index + 1   # a device this rank does not drive
        with pytest.raises(ValueError, match=f"lives on cuda device {other}"):
            a2a.dispatch(ForeignDevice(x.shape, x.dtype, 2, other), idx)
        with pytest.raises(ValueError, match=f"lives on rocm device {other}"):
            a2a.dispatch(x, ForeignDevice(idx.shape, idx.dtype, 10, other))
        with pytest.raises(TypeError, match="x must be a NumPy array or a device array"):
            a2a.dispatch([[0.0] * H] * 4, idx)
        with pytest.raises(TypeError, match="weights must have dtype float32, got float64"):
            a2a.dispatch(x, idx, weights=w.astype(np.float64))
        with pytest.raises(ValueError, match="weights has 3 rows but the call has 4 tokens"):
            a2a.dispatch(x, idx, weights=w[:3].copy())
        with pytest.raises(TypeError, match="weights must be a NumPy array or a device array"):
            a2a.dispatch(x, idx, weights=w.tolist())
        for stream in ("stream 7", 7.0, True, types.SimpleNamespace(cuda_stream="7")):
            with pytest.raises(TypeError, match="stream= must be a stream handle .* got "):
                a2a.dispatch(x, idx, stream=stream)

        d = a2a.dispatch(x, idx)                       # a good call after all the refusals
        expert_y = a2a.fake_expert(d)
        with pytest.raises(TypeError, match="combine\\(\\) needs the weights"):
            a2a.combine(expert_y)
        with pytest.raises(ValueError, match=r"expert_y must have shape"):
            a2a.combine(expert_y.view((L, cap, H // 2)), w)
        with pytest.raises(TypeError, match="expert_y must have dtype float16, got float32"):
            a2a.combine(np.zeros((L, cap, H), np.float32), w)
        with pytest.raises(ValueError, match="weights has 3 rows but the call has 4 tokens"):
            a2a.combine(expert_y, w[:3].copy())
        with pytest.raises(TypeError, match="weights must have dtype float32"):
            a2a.combine(expert_y, w.astype(np.float64))
        with pytest.raises(TypeError, match="out must be a device array"):
            a2a.combine(expert_y, w, out=np.zeros((4, H), np.float16))
        with pytest.raises(TypeError, match="expert_scale must be a real number, not builtins.str"):
            a2a.combine(expert_y, w, expert_scale="2")
        with pytest.raises(ValueError, match="expert_scale=inf is not a finite float32"):
            a2a.combine(expert_y, w, expert_scale=float("inf"))
        with pytest.raises(TypeError, match="stream= must be a stream handle .* got str"):
            a2a.combine(expert_y, w, stream="current")
        from pyhipa2a import reference
        from pyhipa2a.testing import combine_error, poison
        expected = reference.combine(inputs.xs, inputs.indices, inputs.weights, E, ranks=[a2a.rank])[a2a.rank]
        y = a2a.combine(expert_y, w)
        a2a.synchronize()
        combine_error(y.numpy(), expected, np.float16)

        # Weights given to dispatch: combine takes none, or the same array; another one is refused.
        for again in (None, w):
            poison(a2a)
            d = a2a.dispatch(x, idx, weights=w)
            expert_y = a2a.fake_expert(d)
            with pytest.raises(ValueError, match="weights were given to dispatch"):
                a2a.combine(expert_y, w.copy())
            y = a2a.combine(expert_y, again)
            a2a.synchronize()
            combine_error(y.numpy(), expected, np.float16)


def case_bad_config(comm):
    world = comm.Get_size()
    if world > 1:
        with pytest.raises(ValueError, match=f"must be divisible by the number of ranks \\({world}\\)"):
            AllToAll(comm, num_experts=world + 1, experts_per_token=1, hidden_dim=8, max_num_tokens=4)
    with pytest.raises(ValueError, match="must be >= 1"):
        AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=0, max_num_tokens=4)
    # (the kernels divide a routing slot e + E * place by E exactly only below 2^31)
    with pytest.raises(ValueError, match=r"num_experts \* max_num_tokens must be below 2\*\*31"):
        E = world * 2**10
        AllToAll(comm, num_experts=E, experts_per_token=1, hidden_dim=8, max_num_tokens=-(-2**31 // E))
    # and a slot's index t * k + j by k: a node's part of a multi-node call (_region_tokens) may have k > E
    with pytest.raises(ValueError, match=r"experts_per_token \* max_num_tokens must be below 2\*\*31"):
        AllToAll(comm, num_experts=world, experts_per_token=32, hidden_dim=8, max_num_tokens=2**26, _region_tokens=1)
    with pytest.raises(TypeError, match="in_dtype must be one of float16, bfloat16, not float32"):
        AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=8, max_num_tokens=4, in_dtype="float32")
    with pytest.raises(ValueError, match="experts_per_token=3 must be <= num_experts"):
        AllToAll(comm, num_experts=2, experts_per_token=3, hidden_dim=8, max_num_tokens=4)
    with pytest.raises(ValueError, match="push_max_tokens=-1 must be >= 0"):
        AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=8, max_num_tokens=4, push_max_tokens=-1)
    with pytest.raises(TypeError, match="narrow_partials must be a bool, not str"):
        AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=8, max_num_tokens=4, narrow_partials="no")
    with pytest.raises(ValueError, match=r"stream must be one of \('own', 'current'\)"):
        AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=8, max_num_tokens=4, stream="torch")
    with pytest.raises(ValueError, match=r"row_layout must be one of \('packed', 'by_source'\), not 'source'"):
        AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=8, max_num_tokens=4, row_layout="source")


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
            expected = whole if a2a.push_tokens or not whole else min(M, 256 // max(1, min(k, world - 1)))
            assert a2a.push_max_tokens == expected, (k, H, M, a2a.push_tokens, a2a.push_max_tokens, expected)
        with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M,
                      push_max_tokens=3) as a2a:
            assert a2a.push_max_tokens == (3 if H % 8 == 0 else 0), (k, H, M, a2a.push_max_tokens)
    # fp8 rows count at 16 bits, as the contributions that come back do: the same limit as fp16's
    fp8 = (dict(in_dtype="float8_e4m3", out_dtype="bfloat16"), dict(in_dtype="bfloat16", dispatch_dtype="float8_e4m3"))
    for dtypes in fp8:  # given, and quantized on the way
        with AllToAll(comm, num_experts=E, experts_per_token=4, hidden_dim=512, max_num_tokens=1024, **dtypes) as a2a:
            expected = (768 if a2a.push_tokens else 256) // peers
            assert a2a.push_max_tokens == expected, (dtypes, a2a.push_max_tokens, expected)
    assert (DEFAULT_PUSH_BYTES, DEFAULT_PUSH_BACK_BYTES) == (768 * 1024, 256 * 1024)  # the figures above assume them


def case_config_mismatch(comm):
    """Ranks disagreeing on the configuration are named, on every rank."""
    world = comm.Get_size()
    if world == 1:
        pytest.skip("one rank cannot disagree with itself")
    odd = world - 1
    H = 64 if comm.Get_rank() != odd else 128
    with pytest.raises(pyhipa2a.ConfigMismatchError, match=rf"ranks \[{odd}\]") as info:
        AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=H, max_num_tokens=4)
    assert info.value.ranks == (odd,)
    # The push threshold sizes buffers and decides how peers read each other: it must agree too.
    push = 4 if comm.Get_rank() != odd else 2
    with pytest.raises(pyhipa2a.ConfigMismatchError, match=rf"ranks \[{odd}\].*push_max_tokens") as info:
        AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=64, max_num_tokens=4, push_max_tokens=push)
    assert info.value.ranks == (odd,)


def case_bf16_roundtrip_dtype(comm):
    """bf16 outputs come back as ml_dtypes.bfloat16 arrays."""
    world = comm.Get_size()
    with AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=32, max_num_tokens=4,
                  in_dtype="bfloat16") as a2a:
        inputs = draw_world(1, world, world, 1, 32, 4, "bfloat16")
        run_round(a2a, inputs)
        assert a2a.buf["y"].numpy().dtype == resolve("bfloat16")


def case_peer_skips_call(comm):
    """A rank that never calls dispatch is named by the others within timeout + 2 s; no hang."""
    import time
    world = comm.Get_size()
    if world == 1:
        pytest.skip("needs a peer to go missing")
    late = world - 1
    with AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=64, max_num_tokens=4,
                  timeout=2.0) as a2a:
        inputs = draw_world(5, world, world, 1, 64, 4, token_counts=[4] * world)
        if a2a.rank != late:
            start = time.monotonic()
            a2a.dispatch(inputs.xs[a2a.rank], inputs.indices[a2a.rank])
            with pytest.raises(pyhipa2a.A2ATimeoutError, match=f"dispatch flag of rank {late}") as info:
                a2a.synchronize()
            elapsed = time.monotonic() - start
            assert late in info.value.ranks
            assert elapsed < 2.0 + 2.0, f"timeout took {elapsed:.1f} s"
            with pytest.raises(A2AError, match="unusable after an earlier failure"):
                a2a.dispatch(inputs.xs[a2a.rank], inputs.indices[a2a.rank])
        comm.Barrier()  # the late rank closes only after the others saw the timeout


def case_checks_between_back_to_back_replays(comm, H, M, rounds="3"):
    """Rounds of back-to-back graph launches (no host synchronisation between them), each round
    followed by a poisoned, checked launch, as a benchmark's timing loop and its checks alternate.
    Poisoning fills large buffers with no stream (expert_x alone is 940 MB at H=7168, M=256 on 2 ranks);
    such a fill still running when the next call's kernels start would corrupt that call. It did,
    before a fill with no stream waited for itself."""
    from pyhipa2a.testing import check_call, free_inputs, poison, upload_inputs
    H, M, world = int(H), int(M), comm.Get_size()
    E, k = 256 // world * world, 8
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        a2a.expert_y_buffer()  # the fake expert's output, allocated before capturing
        for i in range(int(rounds)):
            T = (M // 8, M // 2, M)[i % 3]  # pushed and pulled calls, as the threshold decides
            inputs = draw_world(900 + i, world, E, k, H, M, token_counts=[T] * world)
            arrays = upload_inputs(a2a, inputs)
            outs = []
            to_dispatch, w = weights_where(arrays[2], WEIGHTS_AT[i % 2])
            graph = a2a.capture(lambda: outs.extend(
                (d := a2a.dispatch(arrays[0], arrays[1], **to_dispatch), a2a.combine(a2a.fake_expert(d), w))))
            try:
                for j in range(3):
                    for _ in range(5):
                        graph.launch()
                    a2a.synchronize()
                    poison(a2a)
                    graph.launch()
                    a2a.synchronize()
                    err = check_call(a2a, inputs, *outs)
                    print(f"rank {a2a.rank} round {i} check {j}: T={T} max err {err:.3g}")
            finally:
                graph.close()
                free_inputs(a2a, arrays)


def case_calls_on_different_streams(comm, H, M, rounds="4"):
    """A caller may change streams between calls (dispatch on one, its expert and combine on
    another, the next call on a third): each call is queued behind the last one, so the results
    are right, and synchronize() without a stream waits for the last call. The hand-offs are
    counted: one event recorded and waited for per change of stream, none otherwise; a refused
    call does not become the last one; after synchronize() nothing is left to wait for; a graph
    launch after a call on another stream is queued behind it too."""
    from pyhipa2a.testing import check_call, free_inputs, poison, upload_inputs
    H, M, world = int(H), int(M), comm.Get_size()
    E, k = 256 // world * world, 8
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        b, me = a2a.backend, a2a.rank
        streams = [b.stream_create() for _ in range(4)]
        handoffs, owned = [], []
        record, wait = b.event_record, b.stream_wait_event
        b.event_record = lambda ev, s: (handoffs.append(("record", b.stream_handle(s))), record(ev, s))[1]
        b.stream_wait_event = lambda s, ev: (handoffs.append(("wait", b.stream_handle(s))), wait(s, ev))[1]
        h, hA = [b.stream_handle(s) for s in streams], b.stream_handle(a2a.stream)

        def inputs_for(seed, T):  # arrays that name no stream (filled synchronously): no waits for them
            inputs = draw_world(seed, world, E, k, H, M, token_counts=[T] * world)
            owned.append(upload_inputs(a2a, inputs, stream=None))
            return inputs, owned[-1]

        try:
            a2a.expert_y_buffer()
            for i in range(int(rounds)):
                T = (M // 8, M)[i % 2]  # a pushed call, then a pulled one
                inputs, (x, idx, w) = inputs_for(700 + i, T)
                poison(a2a)  # synchronizes: nothing is left to wait for
                handoffs.clear()
                d = a2a.dispatch(x, idx, stream=streams[0])
                a2a.combine(a2a.fake_expert(d, stream=streams[1]), w, stream=streams[1])
                assert handoffs == [("record", h[0]), ("wait", h[1])], (i, handoffs)
                # a call refused after its wait was queued (x's dtype is checked then) does not
                # become the last call
                with pytest.raises(TypeError, match="x"):
                    a2a.dispatch(x.view((T, H), np.uint16), idx, stream=streams[3])
                handoffs.clear()
                d = a2a.dispatch(x, idx, stream=streams[2])
                ey = a2a.fake_expert(d, stream=streams[2])
                assert b.stream_handle(ey.stream) == h[2]  # its output names the stream that wrote it
                y = a2a.combine(ey, w, stream=streams[2])
                assert handoffs == [("record", h[1]), ("wait", h[2])], (i, handoffs)
                a2a.synchronize()  # the last call's stream, streams[2]
                err = check_call(a2a, inputs, d, y)
                print(f"rank {me} round {i}: T={T} max err {err:.3g}")
            # one of our own arrays, labelled with a stream (as if written there): used after it
            x3 = pyhipa2a.DeviceArray(b, x.ptr, x.shape, x.dtype, stream=streams[3])
            handoffs.clear()
            d = a2a.dispatch(x3, idx, stream=streams[0])
            a2a.combine(a2a.fake_expert(d, stream=streams[0]), w, stream=streams[0])
            assert handoffs == [("record", h[3]), ("wait", h[0])], handoffs
            a2a.synchronize()
            # a graph captured on the object's stream, launched right after an eager call on streams[2]
            # with other inputs: its results must be the graph's own
            inputs, (x, idx, w) = inputs_for(799, M)
            outs = []
            graph = a2a.capture(lambda: outs.extend(
                (d := a2a.dispatch(x, idx), a2a.combine(a2a.fake_expert(d), w))))
            _, (x2, idx2, w2) = inputs_for(798, M)
            poison(a2a)
            handoffs.clear()
            d = a2a.dispatch(x2, idx2, stream=streams[2])
            a2a.combine(a2a.fake_expert(d, stream=streams[2]), w2, stream=streams[2])
            graph.launch()
            assert handoffs == [("record", h[2]), ("wait", hA)], handoffs
            a2a.synchronize()  # the graph's stream
            check_call(a2a, inputs, *outs)
            graph.close()
        finally:
            b.event_record, b.stream_wait_event = record, wait
            a2a.synchronize()
            for arrays in owned:
                free_inputs(a2a, arrays)
            for s in streams:
                b.stream_destroy(s)


def case_inputs_written_on_another_stream(comm, via="cai", rounds="3"):
    """x, indices, weights and out= made by CuPy on a stream of its own, queued there behind a few
    milliseconds of other work; dispatch and combine are called with no stream= while that stream
    is CuPy's current one. The library must wait for those writes: for __cuda_array_interface__
    arrays on the stream they name (the same arrays every round, so a cached description must not
    skip the wait), for DLPack ones by naming its stream to __dlpack__ at every use. Inputs read
    too early are zeros, and an out= filled late is NaN: either fails the check."""
    cp = pytest.importorskip("cupy")
    from pyhipa2a.testing import check_dispatch_against_oracle, combine_error_against_oracle, poison
    world = comm.Get_size()
    E, k, H, M = 8 * world, 4, 2048, 64
    wrap = DLPackOnly if via == "dlpack" else (lambda a: a)
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        me = a2a.rank
        with cp.cuda.Device(a2a.heap.device.index), cp.cuda.Stream(non_blocking=True) as producer:
            busy = cp.zeros(1 << 27, cp.float32)  # 512 MiB, touched 16 times before the inputs are written
            T = M // 2
            x, idx, w, y = (cp.zeros((T, H), cp.float16), cp.zeros((T, k), cp.int32),
                            cp.zeros((T, k), cp.float32), cp.zeros((T, H), cp.float16))
            # wrapped once: the same objects every round, so a cached description is reused
            xw, iw, ww, yw = (wrap(a) for a in (x, idx, w, y))
            for i in range(int(rounds)):
                inputs = draw_world(300 + i, world, E, k, H, M, token_counts=[T] * world)
                sources = [cp.asarray(h) for h in (inputs.xs[me], inputs.indices[me], inputs.weights[me])]
                for arr in (x, idx, w):
                    arr.fill(0)
                producer.synchronize()
                poison(a2a)
                for _ in range(16):
                    busy += 1.0
                for arr, src in zip((x, idx, w), sources):
                    arr[...] = src                    # queued on the producer stream, behind the busy work
                y.fill(cp.nan)                        # so is this fill of out=: our writes must come after it
                d = a2a.dispatch(xw, iw)
                a2a.combine(a2a.fake_expert(d), ww, out=yw)
                a2a.synchronize()
                check_dispatch_against_oracle(a2a, inputs, d)
                err = combine_error_against_oracle(a2a, inputs, types.SimpleNamespace(numpy=lambda: cp.asnumpy(y)))
                print(f"rank {me} round {i} via {via}: max err {err:.3g}")
            # captured with the producer's stream current: the capture must not wait for work outside
            # it (CUDA refuses that), so ordering the launch is the caller's part
            outs = []
            graph = a2a.capture(lambda: outs.extend(
                (d := a2a.dispatch(xw, iw), a2a.combine(a2a.fake_expert(d), ww, out=yw))))
            inputs = draw_world(399, world, E, k, H, M, token_counts=[T] * world)
            for arr, h in zip((x, idx, w), (inputs.xs[me], inputs.indices[me], inputs.weights[me])):
                arr[...] = cp.asarray(h)
            y.fill(cp.nan)
            producer.synchronize()
            poison(a2a)
            graph.launch()
            a2a.synchronize()
            check_dispatch_against_oracle(a2a, inputs, outs[0])
            combine_error_against_oracle(a2a, inputs, types.SimpleNamespace(numpy=lambda: cp.asnumpy(y)))
            graph.close()


def case_graph_replays(comm, launches="4"):
    """A captured dispatch -> fake expert -> combine replays as a new call each launch: with fresh inputs
    copied into the same device buffers, every launch matches the oracle, eager calls interleave with
    launches, and misuse of capture() is refused without breaking the object."""
    from pyhipa2a.testing import free_buffers, replay_checked, step_buffers
    world = comm.Get_size()
    E, k, H, M = 3 * world, 2, 264, 8
    counts = [(3 * r) % (M + 1) for r in range(world)]  # differ per rank; T=0 on rank 0
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        me = a2a.rank
        T = counts[me]
        buffers = x, idx, w, y = step_buffers(a2a, T)
        captured = {}
        with pytest.raises(A2AError, match="needs expert_y_buffer\\(\\) called before the capture"):
            a2a.capture(lambda: a2a.combine(a2a.fake_expert(a2a.dispatch(x, idx)), w, out=y))
        a2a.expert_y_buffer()

        def step():
            captured["d"] = d = a2a.dispatch(x, idx)
            a2a.combine(a2a.fake_expert(d), w, out=y)

        try:
            graph = a2a.capture(step)
            for i in range(int(launches)):
                inputs = draw_world(100 + i, world, E, k, H, M, token_counts=counts)
                err = replay_checked(a2a, graph, inputs, buffers, captured["d"])
                print(f"rank {me} launch {i}: T={T} max err {err:.3g}")
                if i == 1:  # an eager call between launches, with other token counts
                    run_round(a2a, draw_world(200, world, E, k, H, M))

            host_x = np.zeros((T, H), np.float16)
            with pytest.raises(TypeError, match="inside capture\\(\\), x must be a device array"):
                a2a.capture(lambda: a2a.dispatch(host_x, idx))
            with pytest.raises(A2AError, match="left a dispatch without its combine"):
                a2a.capture(lambda: a2a.dispatch(x, idx))
            with pytest.raises(A2AError, match="synchronize\\(\\) inside capture"):
                a2a.capture(a2a.synchronize)
            d = a2a.dispatch(x, idx)
            with pytest.raises(A2AError, match="dispatch\\(\\) called again before combine\\(\\)"):
                a2a.dispatch(x, idx)
            with pytest.raises(A2AError, match="graph cannot launch while a dispatch\\(\\) awaits its combine"):
                graph.launch()  # its dispatch would reuse the pending call's epoch
            a2a.combine(a2a.fake_expert(d), w)
            run_round(a2a, draw_world(300, world, E, k, H, M))  # still usable after every refusal
            graph.launch()                                      # and so is the graph
            a2a.synchronize()
            graph.close()
            with pytest.raises(A2AError, match="graph is closed"):
                graph.launch()
        finally:
            free_buffers(a2a, buffers)


def case_calls_in_callers_capture(comm, launches="3"):
    """Calls made while another library captures their stream (torch.cuda.graph does that; here the
    backend's own capture stands in for it, unknown to the AllToAll) are recorded into that capture:
    each replay of the caller's graph is a new call that matches the oracle with fresh inputs in the
    same buffers, eager calls interleave with replays, and a dispatch and its combine must be made on
    the same side of the capture."""
    from pyhipa2a.testing import check_call, free_buffers, poison, step_buffers
    world = comm.Get_size()
    E, k, H, M = 3 * world, 2, 264, 8
    counts = [(3 * r + 1) % (M + 1) for r in range(world)]
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        me, b = a2a.rank, a2a.backend
        T = counts[me]
        s = b.stream_create()  # the caller's stream
        buffers = x, idx, w, y = step_buffers(a2a, T)
        a2a.expert_y_buffer()  # (the fake expert's output: memory cannot be allocated while capturing)

        def step(fused: bool):
            d = a2a.dispatch(x, idx, stream=s)
            if fused:
                a2a.combine(d.expert_x, w, out=y, stream=s, expert_scale=1 + me)
            else:
                a2a.combine(a2a.fake_expert(d, stream=s), w, out=y, stream=s)
            return d

        def load(inputs):
            b.stream_synchronize(s)
            for arr, host in zip((x, idx, w), (inputs.xs[me], inputs.indices[me], inputs.weights[me])):
                arr.copy_from(host)
            poison(a2a)
            y.fill_bytes(0xFF)
            b.stream_synchronize(a2a.stream)

        try:
            for fused in (False, True):
                inputs = draw_world(60 + fused, world, E, k, H, M, token_counts=counts)
                load(inputs)
                d = step(fused)  # eager on the caller's stream first: the captured calls must not repeat it
                b.stream_synchronize(s)
                check_call(a2a, inputs, d, y, fused=fused)
                b.capture_begin(s)
                try:
                    d = step(fused)
                finally:
                    graph = b.capture_end(s)
                assert a2a._capturing is None and a2a._pending is None
                for i in range(int(launches)):
                    inputs = draw_world(70 + 10 * fused + i, world, E, k, H, M, token_counts=counts)
                    load(inputs)
                    comm.Barrier()
                    b.graph_launch(graph, s)
                    b.stream_synchronize(s)
                    err = check_call(a2a, inputs, d, y, fused=fused)
                    print(f"rank {me} fused={fused} replay {i}: T={T} max err {err:.3g}")
                    if i == 0:  # an eager call between replays, on the object's own stream
                        run_round(a2a, draw_world(80 + fused, world, E, k, H, M))
                        a2a.synchronize()
                b.graph_destroy(graph)

            # A combine recorded into the capture of a dispatch made outside it: refused, nothing broken.
            d = a2a.dispatch(x, idx)
            b.capture_begin(s)
            with pytest.raises(A2AError, match="made outside it awaits its combine"):
                a2a.combine(d.expert_x, w, stream=s, expert_scale=1 + me)
            b.capture_end(s, keep=False)
            a2a.combine(d.expert_x, w, expert_scale=1 + me)
            run_round(a2a, draw_world(90, world, E, k, H, M))

            # A dispatch recorded alone: the object's next call outside the capture refuses, for good.
            b.capture_begin(s)
            a2a.dispatch(x, idx, stream=s)
            b.capture_end(s, keep=False)
            with pytest.raises(A2AError, match="recorded into another library's capture was followed by combine"):
                a2a.combine(d.expert_x, w, expert_scale=1 + me)
            with pytest.raises(A2AError, match="unusable after an earlier failure"):
                a2a.dispatch(x, idx)
        finally:
            b.stream_synchronize(s)
            free_buffers(a2a, buffers)
            b.stream_destroy(s)


def case_calls_in_torch_graph(comm, launches="3"):
    """torch.cuda.graph captures our calls with PyTorch's tensors on its capture stream
    (AllToAll(stream="current")), after eager calls on that same stream (a serving engine's warm-up),
    and a PyTorch consumer of the output in the same graph; each replay, with fresh inputs copied into
    the same tensors, matches the oracle, with eager calls between replays."""
    from pyhipa2a.testing import check_call, poison
    torch = pytest.importorskip("torch")
    if pyhipa2a.get_backend().kind != "cuda":
        pytest.skip("torch.cuda.graph needs the CUDA backend")
    world = comm.Get_size()
    E, k, H, M = 8 * world, 4, 2048, 64
    counts = [M // 2 - 3 * r for r in range(world)]
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, stream="current") as a2a:
        me = a2a.rank
        dev = torch.device("cuda", a2a.heap.device.index)
        torch.cuda.set_device(dev)
        T = counts[me]
        x = torch.zeros((T, H), dtype=torch.float16, device=dev)
        idx = torch.zeros((T, k), dtype=torch.int32, device=dev)
        w = torch.zeros((T, k), dtype=torch.float32, device=dev)
        capture_stream = torch.cuda.Stream(dev)

        def load(seed):
            inputs = draw_world(seed, world, E, k, H, M, token_counts=counts)
            torch.cuda.synchronize()
            for t, host in zip((x, idx, w), (inputs.xs[me], inputs.indices[me], inputs.weights[me])):
                t.copy_(torch.from_numpy(host))
            torch.cuda.synchronize()
            poison(a2a)
            return inputs

        def step():
            d = a2a.dispatch(x, idx)
            y = a2a.combine(d.expert_x, w, expert_scale=1 + me)
            return d, y, torch.from_dlpack(y).float() * 2  # consumed by PyTorch on the same stream

        with torch.cuda.stream(capture_stream):
            for seed in (1, 2):  # eager, twice: the second repeats the first
                inputs = load(seed)
                d, y, z = step()
                torch.cuda.synchronize()
                check_call(a2a, inputs, d, y, fused=True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=capture_stream):
            d, y, z = step()
        assert a2a._capturing is None and a2a._pending is None
        for i in range(int(launches)):
            inputs = load(10 + i)
            comm.Barrier()
            graph.replay()
            torch.cuda.synchronize()
            err = check_call(a2a, inputs, d, y, fused=True)
            np.testing.assert_array_equal(z.cpu().numpy(), y.numpy().astype(np.float32) * 2)
            print(f"rank {me} replay {i}: T={T} max err {err:.3g}")
            if i == 0:
                run_round(a2a, draw_world(20, world, E, k, H, M), fused=True)  # our own arrays, eager
                a2a.synchronize()


def case_launch_geometry(comm):
    """Launch geometry the device cannot hold (all blocks of a launch resident at once) is refused."""
    world = comm.Get_size()
    shape = dict(num_experts=world, experts_per_token=1, hidden_dim=64, max_num_tokens=4)
    if pyhipa2a.get_backend().kind == "host":
        pytest.skip("the host backend runs one block of one thread")
    with pytest.raises(ValueError, match="block_threads=100 must be a multiple of the warp size"):
        AllToAll(comm, **shape, block_threads=100)
    with pytest.raises(ValueError, match="grid_blocks=1000000 must be between 1 and"):
        AllToAll(comm, **shape, grid_blocks=1000000)
    with AllToAll(comm, **shape, block_threads=128, grid_blocks=3) as a2a:
        assert (a2a.block_threads, a2a.blocks) == (128, 3)
        run_round(a2a, draw_world(9, world, world, 1, 64, 4))
    # Grids of no more blocks than dispatch's route chunks: its senders' first warp (first_sender in
    # kernels_hip/dispatch.hip, route chunks times a block's warps) wraps around the grid, to block 0 of
    # one block and to a routing block (block 2 with 8 chunks) of three.
    E, k = 8 * world, 8
    for blocks, M in ((1, 256), (3, 512)):
        assert route_chunks(k, M) >= blocks
        with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=64, max_num_tokens=M,
                      block_threads=128, grid_blocks=blocks) as a2a:
            assert a2a.blocks == blocks
            for seed, tokens in ((10, [M] * world), (11, [1] * world), (12, None)):
                run_round(a2a, draw_world(seed, world, E, k, 64, M, token_counts=tokens))


def case_launch_sites_made_ahead(comm):
    """Every launch an object's calls make comes from a launch site (kernel, geometry, pack) made with the
    object (Backend.prepare_launch: on CUDA a one-node graph each, with device memory of its own), so
    that its device memory does not grow in the middle of a run: NumPy inputs, new device arrays (a call
    on arrays like the last call's but new), the same arrays again (repeats), one token and M (on a GPU
    the small and the bulk combine kernels: H = 7168 puts M = 128 above the small kernel's limit, 37
    tokens on 264 blocks of an H100, 76 on MI300X's 608), the fake expert as a kernel and fused into
    combine. Every kernel prepared is launched, and every launch is from a site prepared."""
    from pyhipa2a.testing import dispatch_uploaded, free_inputs, fused_combine, upload_inputs

    from . import launch_sites_watched
    backend = pyhipa2a.get_backend()
    world = comm.Get_size()
    E, k, H, M = 4 * world, 4, 7168, 128
    with launch_sites_watched(backend) as (prepared, launched):
        with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, backend=backend) as a2a:
            made = set(prepared)
            kinds = {s[:3] for s in made}  # (a GPU's small combine kernel among them where it runs)
            assert len(kinds) == 3 + (a2a._small_combine is not None), kinds
            assert a2a._small_combine is None or a2a.small_combine_tokens < M, a2a.small_combine_tokens
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
            assert prepared == made, prepared - made  # nothing prepared after the object was made
            assert launched <= made, launched - made
            assert {s[:3] for s in launched} == kinds, kinds - {s[:3] for s in launched}  # every kernel ran


def _framework(lib, device_index):
    """(to_device, fill_later, consume, finish, current, drain, handle) for one producer library: to_device(numpy)
    makes its array; fill_later(dst, src) queues dst = src behind several milliseconds of other work
    on a stream of the library's own (None for JAX, whose arrays are immutable: to_device queues a
    computation instead); consume(our_array) takes one of our outputs through DLPack (the library
    names its stream, we make it wait on the device) and queues work on it; finish(array) brings a
    library array to the host; current() makes the library's producer stream current; drain(arrays)
    waits on the host until the library's queued work, these arrays' included, is done; handle() is the
    library's current stream's handle (None: JAX names none)."""
    if lib == "torch":
        torch = pytest.importorskip("torch")
        torch.cuda.set_device(device_index)
        producer = torch.cuda.Stream()
        busy = torch.zeros(1 << 27, device="cuda")

        def fill_later(dst, src):
            with torch.cuda.stream(producer):
                for _ in range(16):
                    busy.add_(1.0)
                dst.copy_(src)
        return (lambda a: torch.from_numpy(a).cuda(), fill_later, lambda ours: torch.from_dlpack(ours) * 1,
                lambda t: t.cpu().numpy(), lambda: torch.cuda.stream(producer), lambda arrays: torch.cuda.synchronize(),
                lambda: torch.cuda.current_stream().cuda_stream)
    if lib == "cupy":
        cp = pytest.importorskip("cupy")
        cp.cuda.Device(device_index).use()
        producer = cp.cuda.Stream(non_blocking=True)
        busy = cp.zeros(1 << 27, cp.float32)

        def fill_later(dst, src):
            with producer:
                for _ in range(16):
                    busy.__iadd__(1.0)
                dst[...] = src
        return (cp.asarray, fill_later, lambda ours: cp.from_dlpack(ours) * 1, cp.asnumpy, lambda: producer,
                lambda arrays: cp.cuda.Device().synchronize(), lambda: cp.cuda.get_current_stream().ptr)
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    jax = pytest.importorskip("jax")
    jnp = pytest.importorskip("jax.numpy")
    dev = [d for d in jax.devices() if d.platform == "gpu"][device_index]
    busy, compiled = None, {}

    @jax.jit
    def after_busy_work(busy, a):  # (one dispatch: queueing JAX's eager operations costs the host more
        busy = jax.lax.fori_loop(0, 64, lambda _, b: b + 1.0, busy)  # than 512 MiB costs the device)
        return busy, a + (busy[0] * 0).astype(a.dtype)

    def produce(a):  # JAX arrays are immutable: the "late write" is a computation still queued
        nonlocal busy
        if busy is None:
            busy = jax.device_put(np.zeros(1 << 27, np.float32), dev)
        a = jax.device_put(a, dev)
        work = compiled.get((a.shape, a.dtype))  # (compiled ahead: the first array must not finish meanwhile)
        if work is None:
            work = compiled[a.shape, a.dtype] = after_busy_work.lower(busy, a).compile()
        busy, late = work(busy, a)
        return late
    return (produce, None, lambda ours: jnp.from_dlpack(ours) * 1, np.asarray, contextlib.nullcontext,
            lambda arrays: [a.block_until_ready() for a in arrays], lambda: None)


def case_framework_arrays(comm, lib, producer_order="protocol", calls_on="own"):
    """x, indices and weights from torch, CuPy or JAX, written late on the library's own stream; the
    library's arrays are passed as they are (no wrapper), the calls name no stream, and the outputs
    are consumed by the same library through DLPack with no host wait in between. Inputs read too
    early are zeros and an output read too early is poison: either fails. Checked against the oracle
    with gpu-mode's tolerance (allclose rtol=1e-2, atol=5e-3). producer_order="stream": the caller
    orders the producer before the call itself (here: a synchronize of the producer's stream).
    calls_on="current" (AllToAll(stream="current")): the calls run on the library's current stream
    (JAX names none: our own), which the outputs name."""
    from pyhipa2a.testing import check_dispatch_against_oracle, poison
    from pyhipa2a import reference
    world = comm.Get_size()
    E, k, H, M = 8 * world, 4, 2048, 64
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M,
                  producer_order=producer_order, stream=calls_on) as a2a:
        me = a2a.rank
        to_device, fill_later, consume, finish, current, drain, handle = _framework(lib, a2a.heap.device.index)
        T = M // 2
        zeros = [np.zeros((T, H), np.float16), np.zeros((T, k), np.int32), np.zeros((T, k), np.float32)]
        arrays = [to_device(z) for z in zeros]  # the same objects every round (cached descriptions)
        for i in range(3):
            inputs = draw_world(500 + i, world, E, k, H, M, token_counts=[T] * world)
            host = (inputs.xs[me], inputs.indices[me], inputs.weights[me])
            poison(a2a)
            with current():
                if fill_later is None:
                    arrays = [to_device(h) for h in host]  # new JAX arrays each round, still computing
                    assert not any(a.is_ready() for a in arrays), i
                else:
                    for dst, h in zip(arrays, host):
                        fill_later(dst, to_device(h))
                if producer_order == "stream":
                    comm.Barrier()
                    a2a.backend.stream_synchronize(None)  # the caller's own ordering: everything done
                    drain(arrays)
                d = a2a.dispatch(arrays[0], arrays[1])
                y = a2a.combine(d.expert_x, arrays[2], expert_scale=1 + me)
                theirs = handle() if calls_on == "current" else None
                # (a library's default stream is the legacy one: 1 on CUDA, 0 on HIP)
                ran_on = a2a.backend.stream_handle(a2a.stream) if theirs is None else a2a._order.runtime_handle(theirs or 1)
                assert a2a.backend.stream_handle(d.expert_x.stream) == ran_on, (lib, calls_on)
                assert a2a.backend.stream_handle(y.stream) == ran_on, (lib, calls_on)
                # consumed and read back on the library's stream (its reads follow its own work there)
                got = finish(consume(y)).astype(np.float64)
                counts = finish(consume(d.expert_num_tokens))
            expected = reference.combine(inputs.xs, inputs.indices, inputs.weights, E,
                                         reference.fused_expert([1 + r for r in range(world)]), ranks=[me])[me]
            assert np.allclose(got, expected, rtol=1e-2, atol=5e-3), (lib, i, np.abs(got - expected).max())
            a2a.synchronize()
            assert (counts == d.expert_num_tokens.numpy()).all()
            check_dispatch_against_oracle(a2a, inputs, d)
        print(f"rank {me} {lib} ({producer_order}): 3 rounds match the oracle")


def _count_paths(a2a):
    """(full, probed), filled as a2a's calls go: one entry in `full` for each leg that takes the full path,
    and in `probed`, for each array the boundary describes anew, whether its probe's view alone did."""
    full, probed = [], []
    a2a._usable = lambda: (full.append(1), AllToAll._usable(a2a))[1]
    from_probe = a2a._boundary._from_probe
    a2a._boundary._from_probe = lambda *a: (lambda r: (probed.append(r is not None), r)[1])(from_probe(*a))
    return full, probed


def case_new_framework_arrays_at_every_call(comm, lib, calls_on="own"):
    """New PyTorch or CuPy arrays at every call (a layer's activations, a router's output), each written
    late on the library's own stream, with another token count at most calls: the first call takes the
    full path (each element type through its protocol once), the later ones the quick path on the new
    arrays' pointers (pyhipa2a.quick: their probe's view), one given a stream object of the library's own
    the full path again, each array described by its view alone (Boundary._from_probe), and a last one
    given a new object for that stream the quick path (PyTorch makes one at each current_stream()). Every call
    must wait for the stream the library names, or read zeros or the last round's data. Each round on
    poisoned outputs against the oracle, the results consumed by the library with no host wait."""
    from pyhipa2a import reference
    from pyhipa2a.testing import check_dispatch_against_oracle, poison
    world = comm.Get_size()
    E, k, H, M = 8 * world, 4, 2048, 64
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, stream=calls_on) as a2a:
        me = a2a.rank
        to_device, fill_later, consume, finish, current, _, _ = _framework(lib, a2a.heap.device.index)
        if lib == "torch":  # (the stream object lives to the end: its handle is used after it)
            import torch
            side = torch.cuda.Stream()
            side_again = torch.cuda.ExternalStream(side.cuda_stream)  # (a new object for it, as PyTorch makes)
        else:
            import cupy
            side = cupy.cuda.Stream(non_blocking=True)
            side_again = cupy.cuda.ExternalStream(side.ptr)
        full, probed = _count_paths(a2a)
        for i, (T, given) in enumerate(((32, None), (16, None), (32, None), (64, None), (8, side), (16, side_again))):
            inputs = draw_world(900 + i, world, E, k, H, M, token_counts=[T] * world)
            host = (inputs.xs[me], inputs.indices[me], inputs.weights[me])
            poison(a2a)
            full.clear()
            probed.clear()
            with current():
                arrays = [to_device(np.zeros_like(h)) for h in host]  # new objects in new memory, written late
                for dst, h in zip(arrays, host):
                    fill_later(dst, to_device(h))
                d = a2a.dispatch(arrays[0], arrays[1], stream=given)
                y = a2a.combine(d.expert_x, arrays[2], expert_scale=1 + me, stream=given)
                got = finish(consume(y)).astype(np.float64)
            expected = reference.combine(inputs.xs, inputs.indices, inputs.weights, E,
                                         reference.fused_expert([1 + r for r in range(world)]), ranks=[me])[me]
            assert np.allclose(got, expected, rtol=1e-2, atol=5e-3), (lib, calls_on, i, np.abs(got - expected).max())
            a2a.synchronize()
            check_dispatch_against_oracle(a2a, inputs, d)
            # (expert_y, our own array, has no view: one False in each full-path round)
            if i == 0:  # x's, the indices' and the weights' types, each through its protocol
                assert len(full) == 2 and probed.count(True) == 0 and len(probed) == 4, (full, probed)
            elif given is None or given is side_again:  # (the record's stream, named by a new object)
                assert full == [] and probed == [], (i, full, probed)
            else:  # the full path, each new array of the library described by its view
                assert len(full) == 2 and probed.count(True) == 3, (full, probed)
        print(f"rank {me} {lib} ({calls_on}): 6 rounds of new arrays match the oracle")


def case_new_jax_arrays_at_every_call(comm):
    """New JAX arrays at every call, as a JAX program makes them (immutable: each layer's activations
    and router outputs are new arrays), with another token count at most calls. A finished array
    (is_ready) is described by its view and held by its plain export (naming no stream): the first call
    learns each element type through its export for the call's stream, later ones take the quick path on
    the new arrays' pointers, and a finished round given another stream the full path with each array
    described by its view. While a call may still read an input, JAX must not donate its buffer (the
    hold is an external reference: JAX refuses). An array whose computation is still queued goes
    through its export, which makes our stream wait for it on the device: read early, it would be
    another array's data. Each round on poisoned outputs against the oracle, the results consumed by JAX
    with no host wait."""
    from pyhipa2a import reference
    from pyhipa2a.testing import check_dispatch_against_oracle, poison
    world = comm.Get_size()
    E, k, H, M = 8 * world, 4, 2048, 64
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        me = a2a.rank
        _, _, consume, finish, _, drain, _ = _framework("jax", a2a.heap.device.index)
        import jax
        dev = [d for d in jax.devices() if d.platform == "gpu"][a2a.heap.device.index]
        busy = jax.device_put(np.zeros(1 << 27, np.float32), dev)

        @jax.jit
        def after_busy_work(busy, x, indices, weights):  # (one dispatch: JAX's eager ops cost the host more
            busy = jax.lax.fori_loop(0, 64, lambda _, b: b + 1.0, busy)  # than 512 MiB costs the device)
            zero = busy[0] * 0
            return busy, x + zero.astype(x.dtype), indices + zero.astype(indices.dtype), weights + zero
        donate = jax.jit(lambda a: a * 2, donate_argnums=0)
        array_type = type(jax.device_put(np.zeros(1, np.float32), dev))
        exports, export = [], array_type.__dlpack__  # (the stream each export names; None: a hold)
        array_type.__dlpack__ = lambda self, stream=None, **kw: (exports.append(stream),
                                                                  export(self, stream=stream, **kw))[1]
        other = a2a.backend.stream_create()
        try:
            full, probed = _count_paths(a2a)
            for i, (T, finished, given) in enumerate(((32, True, None), (16, True, None), (32, True, None),
                                                      (64, False, None), (8, True, None), (16, True, other))):
                inputs = draw_world(950 + i, world, E, k, H, M, token_counts=[T] * world)
                host = (inputs.xs[me], inputs.indices[me], inputs.weights[me])
                poison(a2a)
                if finished:
                    arrays = [jax.device_put(h, dev) for h in host]
                    drain(arrays)
                else:  # (behind milliseconds of JAX's own work)
                    busy, *arrays = after_busy_work(busy, *(jax.device_put(h, dev) for h in host))
                assert [a.is_ready() for a in arrays] == [finished] * 3, (i, [a.is_ready() for a in arrays])
                exports.clear(), full.clear(), probed.clear()
                d = a2a.dispatch(arrays[0], arrays[1], stream=given)
                y = a2a.combine(d.expert_x, arrays[2], expert_scale=1 + me, stream=given)
                calls = (list(full), list(probed), [s is None for s in exports])
                if finished:
                    try:  # (JAX may also refuse it outright)
                        donate(arrays[0])
                    except Exception:
                        pass
                    assert not arrays[0].is_deleted(), (i, "donated while a call may read it")
                got = finish(consume(y)).astype(np.float64)
                expected = reference.combine(inputs.xs, inputs.indices, inputs.weights, E,
                                             reference.fused_expert([1 + r for r in range(world)]), ranks=[me])[me]
                assert np.allclose(got, expected, rtol=1e-2, atol=5e-3), (i, np.abs(got - expected).max())
                a2a.synchronize(given)
                check_dispatch_against_oracle(a2a, inputs, d)
                exported = [False] * 3  # (x's, the indices' and the weights' export for the call's stream)
                if i == 0:  # each element type learned through its export
                    assert len(calls[0]) == 2 and calls[1].count(True) == 0 and calls[2] == exported, calls
                elif not finished:  # the full path, each unfinished array through its export
                    assert len(calls[0]) == 2 and calls[1].count(True) == 0 and calls[2] == exported, (i, calls)
                elif given is None:  # the quick path on the new arrays' pointers, each held
                    assert calls == ([], [], [True] * 3), (i, calls)
                else:  # the full path, each array described by its view and held
                    assert len(calls[0]) == 2 and calls[1].count(True) == 3 and calls[2] == [True] * 3, (i, calls)
        finally:
            array_type.__dlpack__ = export
            a2a.synchronize()
            a2a.backend.stream_destroy(other)
        print(f"rank {me} jax: 6 rounds of new arrays match the oracle")


def case_producer_arrays_seen_before(comm, lib, calls_on="own"):
    """The arrays a boundary has seen before are asked through their own attributes
    (pyhipa2a.producers), not their protocols. PyTorch: the same tensors every round, round 2's x
    moved to new memory in place (`set_`, as `t.data = ...` does) and the others refilled late on
    PyTorch's current stream; a call that kept x's old pointer, or did not wait for that stream,
    reads the last round's data or zeros. JAX: the same arrays (their computation still queued at
    the first call) passed to three calls. Each call on poisoned outputs against the oracle.
    calls_on="current": the calls run on PyTorch's current stream, so the arrays need no wait and a call
    repeats the last one (round 3) unless what the arrays say has changed (round 2)."""
    from pyhipa2a.testing import check_dispatch_against_oracle, combine_error_against_oracle, poison
    world = comm.Get_size()
    E, k, H, M = 8 * world, 4, 2048, 64
    T = M // 2
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, stream=calls_on) as a2a:
        me = a2a.rank
        to_device, fill_later, _, _, current, _, _ = _framework(lib, a2a.heap.device.index)
        arrays = None
        for i in range(3):
            inputs = draw_world(700 + (i if lib == "torch" else 0), world, E, k, H, M, token_counts=[T] * world)
            host = (inputs.xs[me], inputs.indices[me], inputs.weights[me])
            poison(a2a)
            with current():
                if arrays is None:
                    if lib == "jax":  # (the late work compiled for these shapes first: none may finish meanwhile)
                        [to_device(np.zeros_like(h)) for h in host]
                    arrays = [to_device(h) for h in host]
                    assert lib == "torch" or not any(a.is_ready() for a in arrays)
                elif lib == "torch":
                    arrays[0].set_(to_device(np.zeros_like(host[0])))  # new memory behind the same tensor
                    for dst, h in zip(arrays, host):
                        fill_later(dst, to_device(h))
                d = a2a.dispatch(arrays[0], arrays[1])
                y = a2a.combine(a2a.fake_expert(d), arrays[2])
            a2a.synchronize()
            check_dispatch_against_oracle(a2a, inputs, d)
            err = combine_error_against_oracle(a2a, inputs, y)
            print(f"rank {me} {lib} round {i}: max err {err:.3g}")


# -- fp8 dispatch --------------------------------------------------------------------------------------

def fp8_values(inputs, kind: str, seed: int) -> None:
    """Overwrite the drawn 16-bit tokens (in place) with the values an fp8 test needs:
    - "normal": as drawn (gpu-mode's N(0, 1));
    - "edges": per token, cycling: a block of zeros among normal ones; a row of zeros; a block whose
      largest value maps to the fp8 maximum exactly with the rest spread over 2^-16..1 of it (fp8
      subnormals, the smallest normal, and values that round to zero); large values of the 16-bit
      format; its smallest (fp16 subnormals); negative zeros;
    - "nonfinite": a NaN in one block, an inf in another, -inf in a third of some tokens (those blocks
      arrive as NaN: kernels_hip/fp8.h)."""
    if kind == "normal":
        return
    rng = np.random.default_rng(seed)
    for x in inputs.xs:
        dtype = x.dtype
        # large for the 16-bit format, yet the fake expert's x * (1 + rank) summed over top-k stays finite
        big = (float(np.finfo(np.float16).max) if dtype == np.float16 else 3.0e38) / 64
        tiny = 2.0 ** -24 if dtype == np.float16 else 2.0 ** -133
        for t in range(len(x)):
            row = x[t].astype(np.float32)
            if kind == "edges":
                case = t % 6
                if case == 0:
                    row[128:256] = 0.0
                elif case == 1:
                    row[:] = 0.0
                elif case == 2:
                    row[:128] = np.float32(2.0) ** -rng.integers(0, 17, 128) * rng.choice([-1, 1], 128)
                    row[7] = 448.0
                elif case == 3:
                    row[:] = big * rng.uniform(0.5, 1.0, row.shape) * rng.choice([-1, 1], row.shape)
                elif case == 4:
                    row[:] = tiny * rng.integers(-3, 4, row.shape)
                else:
                    row[::3] = -0.0
            elif kind == "nonfinite" and t % 2 == 0:
                row[5] = np.nan
                if len(row) > 256:
                    row[200] = np.inf
                if len(row) > 512:
                    row[300] = -np.inf
            x[t] = row.astype(dtype)


def case_fp8(comm, way, fp8="float8_e4m3", in16="bfloat16", E_per_rank="4", k="4", H="1024", M="16",
             counts="random", routing="random", values="normal", rounds="2", seed="3", row_layout="packed"):
    """fp8 dispatch, one of two ways in: "quantize" (AllToAll(in_dtype=in16, dispatch_dtype=fp8): 16-bit x,
    quantized by the dispatch kernel) or "given" (AllToAll(in_dtype=fp8, out_dtype=in16): the same tokens
    quantized by the oracle, passed with x_scales). Either way expert_x and expert_x_scales must equal the
    oracle's (reference.quantize_fp8) bit for bit, and the fake expert's combine (on code * scale) must
    match its oracle. The transfer mode comes from PYHIPA2A_PUSH_MAX_TOKENS."""
    world = comm.Get_size()
    E, k, H, M, rounds, seed = int(E_per_rank) * world, int(k), int(H), int(M), int(rounds), int(seed)
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M,
                  **dtype_arguments(in16, fp8, way), row_layout=row_layout) as a2a:
        assert a2a.dispatch_dtype.name in ("float8_e4m3fn", "float8_e4m3fnuz") and a2a.out_dtype == resolve(in16)
        for i in range(rounds):
            rng = np.random.default_rng(1000 * seed + i)
            inputs = draw_world(1000 * seed + i, world, E, k, H, M, in16, token_counts(counts, world, M, rng),
                                routing)
            fp8_values(inputs, values, 1000 * seed + i)
            inputs = inputs_as_given(a2a, inputs, way)
            err = run_round(a2a, inputs)
            print(f"rank {a2a.rank} round {i}: {way} {a2a.dispatch_dtype.name} T={len(inputs.xs[a2a.rank])} "
                  f"pushed={len(inputs.xs[a2a.rank]) <= a2a.push_max_tokens} max err {err:.3g}")


def case_fp8_bad_inputs(comm):
    """fp8's bad input: each a clear error on the calling rank before any kernel runs."""
    from pyhipa2a.dtypes import fp8_for_arch
    world = comm.Get_size()
    shape = dict(num_experts=2 * world, experts_per_token=2, hidden_dim=256, max_num_tokens=4)
    with pytest.raises(ValueError, match="multiple of 128"):
        AllToAll(comm, **{**shape, "hidden_dim": 200}, in_dtype="bfloat16", dispatch_dtype="float8_e4m3")
    with pytest.raises(TypeError, match="give out_dtype"):
        AllToAll(comm, **shape, in_dtype="float8_e4m3")
    with pytest.raises(TypeError, match="not float8_e5m2"):
        AllToAll(comm, **shape, in_dtype="float16", dispatch_dtype="float8_e5m2")
    with pytest.raises(TypeError, match="gfx90a, which has none"):
        fp8_for_arch("float8_e4m3", "gfx90a")
    with pytest.raises(TypeError, match="gfx942 uses float8_e4m3fnuz"):
        fp8_for_arch("float8_e4m3fn", "gfx942")
    with pytest.raises(TypeError, match="sm_90 uses float8_e4m3fn"):
        fp8_for_arch("float8_e4m3fnuz", "sm_90")
    assert fp8_for_arch("float8_e4m3", "gfx942").name == "float8_e4m3fnuz"
    inputs = draw_world(5, world, shape["num_experts"], 2, 256, 4, "bfloat16", [3] * world)
    me = comm.Get_rank()
    with AllToAll(comm, **shape, in_dtype="float8_e4m3", out_dtype="bfloat16") as given, \
            AllToAll(comm, **shape, in_dtype="bfloat16", dispatch_dtype="float8_e4m3") as quantizing:
        q = inputs.quantized(given.dispatch_dtype)
        x, s = q.xs[me], q.x_scales[me]
        for a2a, args, kw, error, match in [
                (given, (x, inputs.indices[me]), {}, TypeError, "pass its scales as x_scales"),
                (given, (x, inputs.indices[me]), {"x_scales": s[:, :1]}, ValueError, "x_scales must have shape"),
                (given, (x, inputs.indices[me]), {"x_scales": s.astype(np.float16)}, TypeError,
                 "x_scales must have dtype float32"),
                (given, (inputs.xs[me], inputs.indices[me]), {"x_scales": s}, TypeError, "x must have dtype"),
                (quantizing, (inputs.xs[me], inputs.indices[me]), {"x_scales": s}, TypeError,
                 "x_scales is for fp8 x"),
                (quantizing, (x, inputs.indices[me]), {}, TypeError, "x must have dtype bfloat16")]:
            with pytest.raises(error, match=match):
                a2a.dispatch(*args, **kw)
        # Nothing ran: both objects still work, each matches the oracle, and they agree bit for bit.
        outs = []
        for a2a, ins in ((given, q), (quantizing, inputs)):
            run_round(a2a, ins)
            d = dispatch(a2a, ins)
            a2a.combine(a2a.fake_expert(d), ins.weights[me])
            a2a.synchronize()
            outs.append((d.expert_num_tokens.numpy(), d.expert_x.numpy().view(np.uint8), d.expert_x_scales.numpy(),
                         d.expert_meta.numpy()))
        (c0, x0, s0, m0), (c1, x1, s1, m1) = outs
        assert np.array_equal(c0, c1)
        for l, n in enumerate(c0):
            order0, order1 = (np.lexsort(m[l, :n].T[::-1]) for m in (m0, m1))
            assert np.array_equal(m0[l, :n][order0], m1[l, :n][order1])
            assert np.array_equal(x0[l, :n][order0], x1[l, :n][order1])
            assert np.array_equal(s0[l, :n][order0].view(np.uint32), s1[l, :n][order1].view(np.uint32))


def case_another_device_current(comm, rounds="3"):
    """Another library leaves a different context current on our thread between our calls (JAX did, with
    two GPUs visible to each rank: cuEventRecord on our stream then failed with an invalid handle).
    Before every public call here another context is made current: the next GPU's primary context where
    the process sees two, else a second context on our GPU. Each call must switch back, the results
    must match the oracle, a captured step must replay, and memory, events and streams made after the
    switch must be in our context (on our GPU)."""
    from pyhipa2a.testing import (check_call, check_dispatch_against_oracle, combine_error_against_oracle,
                                  free_inputs, oracle_expert, poison, upload_inputs)
    world = comm.Get_size()
    E, k, H, M = 8 * world, 4, 2048, 32
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        if a2a.backend.kind != "cuda":
            pytest.skip("contexts are the CUDA driver's")
        from cuda.bindings import driver

        def ok(result):
            assert not result[0], result[0]
            return result[1] if len(result) > 1 else None
        ours = ok(driver.cuCtxGetCurrent())
        other = ok(driver.cuDeviceGet((a2a.heap.device.index + 1) % a2a.heap.device.count))
        if a2a.heap.device.count > 1:
            theirs = ok(driver.cuDevicePrimaryCtxRetain(other))
            release = lambda: ok(driver.cuDevicePrimaryCtxRelease(other))  # noqa: E731
        else:
            try:  # CUDA 13's signature, then 12's
                theirs = ok(driver.cuCtxCreate(None, 0, other))
            except TypeError:
                theirs = ok(driver.cuCtxCreate(0, other))
            ok(driver.cuCtxSetCurrent(ours))
            release = lambda: ok(driver.cuCtxDestroy(theirs))  # noqa: E731
        assert int(theirs) != int(ours)

        def elsewhere():
            ok(driver.cuCtxSetCurrent(theirs))
        elsewhere()
        buffer = a2a.expert_y_buffer()  # the first allocation after construction: in our context all the same
        assert int(ok(driver.cuPointerGetAttribute(driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_CONTEXT,
                                                   buffer.ptr))) == int(ours)
        me = a2a.rank
        for i in range(int(rounds)):
            inputs = draw_world(900 + i, world, E, k, H, M)
            poison(a2a)
            elsewhere()
            d = dispatch(a2a, inputs)
            elsewhere()
            expert_y = a2a.fake_expert(d)
            elsewhere()
            a2a.synchronize()
            elsewhere()
            check_dispatch_against_oracle(a2a, inputs, d)
            elsewhere()
            y = a2a.combine(expert_y, inputs.weights[me])
            elsewhere()
            a2a.synchronize()
            elsewhere()
            err = combine_error_against_oracle(a2a, inputs, y, None, oracle_expert(a2a, False))
            print(f"rank {me} round {i}: max err {err:.3g}")
        inputs = draw_world(999, world, E, k, H, M)
        elsewhere()
        x, idx, w = arrays = upload_inputs(a2a, inputs)
        outputs = {}

        def step():
            outputs["d"] = a2a.dispatch(x, idx)
            outputs["y"] = a2a.combine(a2a.fake_expert(outputs["d"]), w)
        graph = a2a.capture(step)
        poison(a2a)
        elsewhere()
        graph.launch()
        elsewhere()
        a2a.synchronize()
        check_call(a2a, inputs, outputs["d"], outputs["y"])
        graph.close()
        free_inputs(a2a, arrays)
        # A caller's own events and streams from our backend (the bench's timing events, made after JAX
        # had switched contexts) must be ours too: recording them on our streams failed before.
        elsewhere()
        b = a2a.backend
        start, end, stream = b.event_create(), b.event_create(), b.stream_create()
        elsewhere()
        b.event_record(start, a2a.stream)
        b.stream_wait_event(stream, start)
        b.event_record(end, stream)
        b.event_synchronize(end)
        assert b.event_elapsed_ms(start, end) >= 0
        b.stream_destroy(stream)
        b.event_destroy(start)
        b.event_destroy(end)
        release()
