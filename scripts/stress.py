"""Many calls, every one checked: `mpirun -n N python scripts/stress.py [--calls 10000]`.

Three AllToAll objects of different shapes and dtypes stay alive and are
called in a random order (the same on every rank). Token counts are random,
including 0 and M, and routing is skewed: uniform, one hot expert, or whole
ranks sending nothing. Every output is checked against pyhipa2a.reference
with poisoned outputs. Calls are made four ways: NumPy inputs on the
object's stream; the same with the fake expert fused into combine
(combine(d.expert_x, w, expert_scale=1 + rank)); device inputs with the call
split over two streams (dispatch on one, the expert and combine on the other);
and device inputs after a burst of unchecked back-to-back calls (no host
synchronisation in between), the checked call last. Every `--churn` calls one object is closed and built
again, so teardown is exercised too. `--ranks-per-node G` makes every call one across nodes of G ranks
(AllToAll(ranks_per_node=G), nodes simulated on one). Device memory in use is reported after
warm-up and at the end, and must not grow. Exits non-zero on any mismatch,
error or growth.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from pyhipa2a import AllToAll  # noqa: E402
from pyhipa2a.testing import (check_call, draw_world, failure_line, free_inputs, poison, run_round,  # noqa: E402
                              upload_inputs)

WAYS = ("numpy", "fused", "two_streams", "after_burst")


def device_round(a2a, inputs, way: str, streams) -> float:
    """One checked call on device inputs: split over `streams`, or after 3 unchecked calls."""
    arrays = upload_inputs(a2a, inputs)
    try:
        if way == "after_burst":
            for _ in range(3):
                a2a.combine(a2a.fake_expert(a2a.dispatch(arrays[0], arrays[1])), arrays[2])
        poison(a2a)
        first, second = streams if way == "two_streams" else (None, None)
        d = a2a.dispatch(arrays[0], arrays[1], stream=first)
        y = a2a.combine(a2a.fake_expert(d, stream=second), arrays[2], stream=second)
        a2a.synchronize()
        return check_call(a2a, inputs, d, y)
    finally:
        free_inputs(a2a, arrays)  # every rank frees in the same order, after its check


def configs(world: int) -> list[dict]:
    return [
        dict(num_experts=2 * world, experts_per_token=2, hidden_dim=128, max_num_tokens=16, in_dtype="float16"),
        dict(num_experts=8 * world, experts_per_token=4, hidden_dim=1000, max_num_tokens=32, in_dtype="float16"),
        dict(num_experts=4 * world, experts_per_token=3, hidden_dim=264, max_num_tokens=8, in_dtype="bfloat16"),
        dict(num_experts=8 * world, experts_per_token=8, hidden_dim=1024, max_num_tokens=32, in_dtype="float16",
             narrow_partials=True),  # partial sums in the output's format, checked with their extra rounding
    ]


def token_counts(rng, world: int, M: int) -> np.ndarray:
    counts = rng.integers(0, M + 1, size=world)
    mode = rng.integers(0, 4)
    if mode == 1:
        counts[rng.integers(0, world)] = 0          # one rank sends nothing
    elif mode == 2:
        counts[:] = M                               # full
    elif mode == 3:
        counts[rng.random(world) < 0.5] = 0         # about half the ranks send nothing
    return counts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=10000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=10.0)
    p.add_argument("--churn", type=int, default=1000, help="rebuild one object every this many calls")
    p.add_argument("--slack", type=int, default=0, help="bytes of memory growth tolerated")
    p.add_argument("--ranks-per-node", type=int, default=None,
                   help="calls across nodes of this many ranks (AllToAll(ranks_per_node=)), simulated on one")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    shapes = [dict(s, ranks_per_node=args.ranks_per_node) for s in configs(world)]
    a2as = [AllToAll(comm, timeout=args.timeout, **s) for s in shapes]
    maker = a2as[0].backend  # the streams' creator (a2as[0] itself may be rebuilt)
    streams = [maker.stream_create() for _ in range(2)]
    ways = {w: 0 for w in WAYS}
    rng = np.random.default_rng(args.seed)
    worst, failure, start = 0.0, None, time.monotonic()
    try:
        def one_call(i: int, which: int | None = None, way: str | None = None) -> float:
            """A checked call (of object `which`, made `way`; random where not given)."""
            which = int(rng.integers(0, len(a2as))) if which is None else which
            s = shapes[which]
            counts = token_counts(rng, world, s["max_num_tokens"])
            routing = "hot" if rng.random() < 0.25 else "random"
            inputs = draw_world((args.seed * 1_000_003 + i) % 2**63, world, s["num_experts"], s["experts_per_token"],
                                s["hidden_dim"], s["max_num_tokens"], s["in_dtype"], counts, routing)
            way = WAYS[int(rng.integers(0, len(WAYS)))] if way is None else way
            ways[way] += 1
            if way in ("numpy", "fused"):
                return run_round(a2as[which], inputs, fused=way == "fused")
            return device_round(a2as[which], inputs, way, streams)

        def warm_up(which: int, i: int) -> None:
            """Every kernel of object `which` loaded and launched each way, its buffers touched. (Its launch
            sites, on CUDA a one-node graph each with device memory of its own, are made with the object:
            pyhipa2a.legs.Leg.)"""
            for n, way in enumerate(WAYS):
                one_call(i - n, which, way)

        for which in range(len(a2as)):
            warm_up(which, -1 - which * len(WAYS))
        comm.Barrier()
        memory_start = a2as[0].backend.memory_in_use()
        for i in range(args.calls):
            if args.churn and i and i % args.churn == 0:
                victim = (i // args.churn) % len(a2as)
                a2as[victim].close()
                a2as[victim] = AllToAll(comm, timeout=args.timeout, **shapes[victim])
                warm_up(victim, -100 - i)  # the new object's first calls, before memory is compared
            worst = max(worst, one_call(i))
        comm.Barrier()
        memory_end = a2as[0].backend.memory_in_use()
    except Exception as e:  # report on every rank, then agree on the verdict
        failure = failure_line(rank, e)
        memory_start = memory_end = 0
    finally:
        for a2a in a2as:
            try:
                a2a.close()
            except Exception:
                pass
        for s in streams:
            maker.stream_destroy(s)
    grew = memory_end - memory_start
    ok = failure is None and grew <= args.slack
    failures = [f for f in comm.allgather(failure) if f]
    growth = comm.allgather(grew)
    all_ok = comm.allreduce(ok, op=MPI.LAND)
    worst = comm.allreduce(worst, op=MPI.MAX)
    if rank == 0:
        kind = a2as[0].backend.kind
        print(f"pyhipa2a stress: {kind}, {world} ranks, {args.calls} calls checked against the oracle "
              f"in {time.monotonic() - start:.1f} s, max combine error {worst:.3g}; calls made each way: "
              + ", ".join(f"{w} {n}" for w, n in ways.items()))
        print(f"memory in use after warm-up {memory_start / 2**20:.2f} MiB, at the end {memory_end / 2**20:.2f} MiB; "
              f"growth per rank (bytes): {growth}")
        for f in failures:
            print("FAIL:", f)
        print("stress:", "PASS" if all_ok else "FAIL")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
