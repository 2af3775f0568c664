"""Multi-rank cases of fp8 dispatch: both ways in, every edge (run under mpiexec by the tests).

Every case draws the whole world's inputs from a seed, poisons the outputs,
runs the library and checks this rank's outputs against pyhipa2a.reference.
"""
from __future__ import annotations


import numpy as np
import pytest

from pyhipa2a import AllToAll
from tests.cases.exchange_cases import token_counts
from pyhipa2a.dtypes import resolve
from pyhipa2a.testing import dispatch, draw_world, dtype_arguments, inputs_as_given, layout_arguments, run_round


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
                  **dtype_arguments(in16, fp8, way), **layout_arguments(row_layout)) as a2a:
        assert (a2a.config.dispatch_dtype.name in ("float8_e4m3fn", "float8_e4m3fnuz")
                and a2a.config.out_dtype == resolve(in16))
        for i in range(rounds):
            rng = np.random.default_rng(1000 * seed + i)
            inputs = draw_world(1000 * seed + i, world, E, k, H, M, in16, token_counts(counts, world, M, rng),
                                routing)
            fp8_values(inputs, values, 1000 * seed + i)
            inputs = inputs_as_given(a2a, inputs, way)
            err = run_round(a2a, inputs)
            print(f"rank {a2a.rank} round {i}: {way} {a2a.config.dispatch_dtype.name} T={len(inputs.xs[a2a.rank])} "
                  f"pushed={len(inputs.xs[a2a.rank]) <= a2a.config.push_max_tokens} max err {err:.3g}")


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
        q = inputs.quantized(given.config.dispatch_dtype)
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
        for local, n in enumerate(c0):
            order0, order1 = (np.lexsort(m[local, :n].T[::-1]) for m in (m0, m1))
            assert np.array_equal(m0[local, :n][order0], m1[local, :n][order1])
            assert np.array_equal(x0[local, :n][order0], x1[local, :n][order1])
            assert np.array_equal(s0[local, :n][order0].view(np.uint32), s1[local, :n][order1].view(np.uint32))


