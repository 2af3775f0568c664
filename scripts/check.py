"""Correctness on the gpu-mode shapes: `mpirun -n N python scripts/check.py`.

For every test shape of gpu-mode's amd_distributed/all2all (world size
replaced by the ranks running; shapes whose experts do not divide are
skipped): fp16 in and out, num_tokens drawn per rank in [1, M), the fake
grouped GEMM expert_y = expert_x * (1 + rank), dispatch checked exactly and
combine checked with allclose(rtol=1e-2, atol=5e-3) against pyhipa2a.reference.
`--dispatch-dtype float8_e4m3` dispatches in fp8 (e4m3, one float32 scale per
128 elements; combine stays 16-bit): x quantized by the dispatch kernel
(`--fp8-input quantize`) or given in fp8 with its scales (`given`); expert_x
and its scales are checked bit for bit, and the fake expert reads code * scale.
Prints a PASS/FAIL table with the largest error; exits non-zero on any FAIL.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from mpi4py import MPI  # noqa: E402

from pyhipa2a import AllToAll  # noqa: E402
from pyhipa2a.config import LAYOUT_CHOICES  # noqa: E402
from pyhipa2a.bootstrap import node_layout  # noqa: E402
from pyhipa2a.testing import (GPU_MODE_TOLERANCE, draw_world, dtype_arguments, failure_line,  # noqa: E402
                              inputs_as_given, run_round)
from pyhipa2a.dtypes import FP8_BLOCK  # noqa: E402

SHAPES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpumode_all2all.json")


def load_shapes(which: str) -> list[dict]:
    with open(SHAPES_FILE) as f:
        return json.load(f)[which]


def check_shape(comm, s: dict, rounds: int, dtype: str, timeout: float, narrow_partials: bool = False,
                fused: bool = False, dispatch_dtype: str | None = None,
                fp8_input: str = "quantize", weights_at: str = "combine",
                ranks_per_node: int | None = None, row_layout: str = "packed") -> tuple[bool, float, str]:
    """(ok on this rank, largest combine error, message)."""
    world = comm.Get_size()
    try:
        with AllToAll(comm, num_experts=s["num_experts"], experts_per_token=s["experts_per_token"],
                      hidden_dim=s["hidden_dim"], max_num_tokens=s["max_num_tokens"],
                      **dtype_arguments(dtype, dispatch_dtype, fp8_input), timeout=timeout,
                      narrow_partials=narrow_partials, ranks_per_node=ranks_per_node, row_layout=row_layout) as a2a:
            worst = 0.0
            for r in range(rounds):
                inputs = draw_world(s["seed"] + 7919 * r, world, s["num_experts"], s["experts_per_token"],
                                    s["hidden_dim"], s["max_num_tokens"], dtype)
                inputs = inputs_as_given(a2a, inputs, fp8_input)
                worst = max(worst, run_round(a2a, inputs, tolerance=GPU_MODE_TOLERANCE, fused=fused,
                                             weights_at=weights_at))
            return True, worst, ""
    except Exception as e:  # reported in the table; the other ranks time out instead of hanging
        if os.environ.get("PYHIPA2A_DEBUG"):
            traceback.print_exc()
        return False, float("nan"), failure_line(comm.Get_rank(), e)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", choices=("tests", "benchmarks"), default="tests")
    p.add_argument("--rounds", type=int, default=3, help="fresh random inputs per shape")
    p.add_argument("--dtype", default="float16", choices=("float16", "bfloat16"))
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--narrow-partials", action="store_true",
                   help="AllToAll(narrow_partials=True): partial sums cross in the output dtype")
    p.add_argument("--fused-expert", action="store_true",
                   help="the fake expert fused into combine: combine(d.expert_x, w, expert_scale=1 + rank)")
    p.add_argument("--dispatch-dtype", choices=("float8_e4m3",), default=None,
                   help="dispatch in fp8 (e4m3 with block scales); default: --dtype throughout")
    p.add_argument("--fp8-input", choices=("quantize", "given"), default="quantize",
                   help="fp8 dispatch: 16-bit x quantized by the dispatch kernel, or x given in fp8 with x_scales")
    p.add_argument("--weights-at", choices=("combine", "dispatch"), default="combine",
                   help="the call that takes the weights: combine(expert_y, w) or dispatch(x, idx, weights=w)")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="split the ranks into simulated nodes of this many (default: PYHIPA2A_RANKS_PER_NODE, "
                        "else the machines they run on); nodes exchange through NCCL (MPI on the host backend)")
    p.add_argument("--row-layout", choices=LAYOUT_CHOICES, default="packed",
                   help="AllToAll(row_layout=): each expert's rows packed, or by source (checked against "
                        "expert_layout)")
    p.add_argument("--max-hidden", type=int, default=None, help="only the shapes whose hidden_dim is at most this")
    p.add_argument("--only", default="", help="only the shapes whose row name contains this (e.g. 'E=128  k=8')")
    args = p.parse_args()
    if args.dispatch_dtype and args.fused_expert:
        p.error("--fused-expert reads expert_x as expert_y, which is 16-bit: not with fp8 dispatch")
    comm = MPI.COMM_WORLD
    world, rank = comm.Get_size(), comm.Get_rank()
    layout = node_layout(comm, args.ranks_per_node)
    rows, all_ok = [], True
    for s in load_shapes(args.shapes):
        name = (f"E={s['num_experts']:<4d} k={s['experts_per_token']} H={s['hidden_dim']:<5d} "
                f"M={s['max_num_tokens']:<4d}")
        if (args.max_hidden is not None and s["hidden_dim"] > args.max_hidden) or args.only not in name:
            continue
        if s["num_experts"] % world:
            rows.append((name, "SKIP", "", f"{s['num_experts']} experts do not divide over {world} ranks"))
            continue
        if args.dispatch_dtype and s["hidden_dim"] % FP8_BLOCK:
            rows.append((name, "SKIP", "", f"fp8 dispatch needs H to be a multiple of {FP8_BLOCK}"))
            continue
        ok, err, msg = check_shape(comm, s, args.rounds, args.dtype, args.timeout, args.narrow_partials,
                                   args.fused_expert, args.dispatch_dtype, args.fp8_input, args.weights_at,
                                   args.ranks_per_node, args.row_layout)
        ok = comm.allreduce(ok, op=MPI.LAND)
        worst = comm.allreduce(err if err == err else float("inf"), op=MPI.MAX)
        msgs = [m for m in comm.allgather(msg) if m]
        all_ok &= ok
        rows.append((name, "PASS" if ok else "FAIL", f"{worst:.3g}" if ok else "", "; ".join(msgs)))
    if rank == 0:
        nodes = f" ({layout.nodes} nodes of {layout.ranks_per_node} ranks)" if layout.nodes > 1 else ""
        print(f"pyhipa2a check: {world} ranks{nodes}, {args.dtype}, {args.rounds} rounds per shape, "
              f"allclose(rtol={GPU_MODE_TOLERANCE[0]}, atol={GPU_MODE_TOLERANCE[1]})"
              + (f", dispatch {args.dispatch_dtype} ({args.fp8_input} fp8 x)" if args.dispatch_dtype else "")
              + (", narrow partials" if args.narrow_partials else "")
              + (", fake expert fused into combine" if args.fused_expert else "")
              + f", weights to {args.weights_at}"
              + (f", rows {args.row_layout}" if args.row_layout != "packed" else ""))
        print(f"{'shape':<34} {'result':<6} {'max err':<9} note")
        for name, verdict, err, note in rows:
            print(f"{name:<34} {verdict:<6} {err:<9} {note}")
        print("check:", "PASS" if all_ok else "FAIL")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
