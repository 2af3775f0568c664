"""Collective matmul on GPUs (pyhipa2a.CollectiveMatmul) beside NCCL's collective then the same GEMM, and the GEMM
alone, in one run: PyTorch tensors, bf16, CUDA-event medians, the slowest rank's.

    mpirun -n 2 python scripts/collective_bench.py [--iters 20] [--json out.json]

Each shape's rows: NCCL (all_gather_into_tensor / reduce_scatter_tensor) alone, torch.matmul alone, the two in
sequence, and ours with the vendor's GEMM and with torch.matmul as gemm=; every result of ours is checked against
the sequential one first. Ours on the same arrays at every call is replayed as one graph from the third call
on (pyhipa2a.replays); "step by step" is ours on another output array at every call (more of them than are
remembered), queued step by step as a first call is. Last, whether a GEMM waiting for a chunk holds
multiprocessors: GEMMs on another stream are timed alone and while our call waits for a rank that is late by 50 ms.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from pyhipa2a.replays import GRAPHS_KEPT

SHAPES = (("ag", 2048, 7168, 4096), ("ag", 8192, 7168, 4096), ("ag", 16384, 8192, 8192),
          ("rs", 2048, 7168, 4096), ("rs", 8192, 7168, 4096), ("rs", 16384, 8192, 8192))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    p.add_argument("--shape", action="append", help="op,M,K,N (op ag or rs); default: the issue's table")
    p.add_argument("--pieces", default="1,2,4", help="pieces a rank's rows move in (each its own copy stream)")
    p.add_argument("--json")
    args = p.parse_args()
    from mpi4py import MPI
    import torch
    import torch.distributed as dist
    from pyhipa2a.collective import CollectiveMatmul

    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(comm.bcast(29500 + os.getpid() % 2000))
    dist.init_process_group("nccl", rank=rank, world_size=world,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    dtype = getattr(torch, args.dtype)
    shapes = [(s.split(",")[0], *map(int, s.split(",")[1:])) for s in args.shape] if args.shape else SHAPES
    gen = torch.Generator(device="cuda").manual_seed(1234 + rank)

    def timed(fn) -> float:
        """Median us of fn() on the current stream, the slowest rank's."""
        for _ in range(args.warmup):
            fn()
        times = []
        for _ in range(args.iters):
            torch.cuda.synchronize()
            comm.Barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        return max(comm.allgather(statistics.median(times)))

    rows, piece_counts = [], [int(p) for p in args.pieces.split(",")]
    for op, M, K, N in shapes:
        m = M // world
        # (p, remote): remote, the reduce-scatter's GEMMs write a peer's sums into its heap themselves
        variants = [(p, False) for p in piece_counts] + ([(p, True) for p in piece_counts] if op == "rs" else [])
        objects = {(p, remote): CollectiveMatmul(comm, max_rows=M, k=K, n=N, dtype=args.dtype, pieces=p,
                                                 remote_sums=remote) for p, remote in variants}
        if op == "ag":
            a = torch.randn(m, K, device="cuda", dtype=dtype, generator=gen) / K ** 0.5
            b = torch.randn(K, N, device="cuda", dtype=dtype, generator=torch.Generator("cuda").manual_seed(7))
            full = torch.empty(M, K, device="cuda", dtype=dtype)
            out = torch.empty(M, N, device="cuda", dtype=dtype)

            def nccl():
                dist.all_gather_into_tensor(full, a)

            def gemm_alone():
                torch.matmul(full, b, out=out)

            def sequence():
                nccl()
                gemm_alone()

            def ours(cm, gemm=None, out=None):
                return cm.all_gather_matmul(a, b, out, gemm=gemm)
        else:
            a = torch.randn(M, K // world, device="cuda", dtype=dtype, generator=gen) / K ** 0.5
            b = torch.randn(K // world, N, device="cuda", dtype=dtype, generator=gen)
            partial = torch.empty(M, N, device="cuda", dtype=dtype)
            out = torch.empty(m, N, device="cuda", dtype=dtype)

            def gemm_alone():
                torch.matmul(a, b, out=partial)

            def nccl():
                dist.reduce_scatter_tensor(out, partial)

            def sequence():
                gemm_alone()
                nccl()

            def ours(cm, gemm=None, out=None):
                return cm.matmul_reduce_scatter(a, b, out, gemm=gemm)
        sequence()
        torch.cuda.synchronize()
        want = (out if op == "rs" else torch.matmul(full, b)).float()
        errors = []
        for cm in objects.values():
            for gemm in (None, torch_gemm):
                got = ours(cm, gemm)
                torch.cuda.synchronize()
                errors.append(float((got.float() - want).abs().max() / (want.abs().max() + 1e-6)))
        row = dict(op=op, M=M, K=K, N=N, ranks=world, nccl=timed(nccl), gemm=timed(gemm_alone),
                   sequence=timed(sequence), max_relative_error=max(comm.allgather(max(errors))))
        for (p, remote), cm in objects.items():
            row[variant_name(p, remote)] = timed(lambda: ours(cm))
        row["ours_torch_gemm"] = timed(lambda: ours(objects[variants[0]], torch_gemm))
        # Outputs at as many row offsets into one buffer as needed for no call's pointers to be remembered
        # (the buffer's rows are the output's and one per other pointer)
        keys = 2 * GRAPHS_KEPT + 1
        spare = torch.empty(out.shape[0] + keys, out.shape[1], device="cuda", dtype=dtype)
        cycle = iter(range(1 << 30))
        row["ours_step_by_step"] = timed(lambda: ours(objects[variants[0]],
                                                      out=spare[next(cycle) % keys:][:out.shape[0]]))
        best = min(variants, key=lambda v: row[variant_name(*v)])
        row.update(ours=row[variant_name(*best)], best=variant_name(*best))
        row["x_sequence"] = row["ours"] / row["sequence"]
        row["x_gemm"] = row["ours"] / row["gemm"]
        rows.append(row)
        for cm in objects.values():
            cm.close()
        if rank == 0:
            print(json.dumps(row), flush=True)
    idle = idle_wait(comm, torch, CollectiveMatmul, args.dtype, dtype)
    if rank == 0:
        print(f"\ncollective matmul, {world} ranks, {torch.cuda.get_device_name()}, {args.dtype}, us (median, "
              "slowest rank)")
        print(f"{'op':3} {'M':>6} {'K':>5} {'N':>5} {'NCCL':>8} {'GEMM':>8} {'seq':>8} {'ours best':>9} {'x seq':>6} "
              f"{'x GEMM':>6}  each variant (p: pieces, r: remote sums)  step by step  torch gemm= {'rel err':>8}")
        for r in rows:
            each = " ".join(f"{k[5:]}={v:.1f}" for k, v in r.items() if k.startswith("ours_p"))
            print(f"{r['op']:3} {r['M']:6} {r['K']:5} {r['N']:5} {r['nccl']:8.1f} {r['gemm']:8.1f} "
                  f"{r['sequence']:8.1f} {r['ours']:9.1f} {r['x_sequence']:6.2f} {r['x_gemm']:6.2f}  {each}  "
                  f"{r['ours_step_by_step']:.1f}  {r['ours_torch_gemm']:.1f} {r['max_relative_error']:8.1e}")
        print(f"a GEMM on another stream: {idle['alone']:.1f} us alone, {idle['beside_wait']:.1f} us while our "
              f"call waits for a late rank ({idle['beside_wait'] / idle['alone']:.2f}x)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(dict(rows=rows, idle=idle), f, indent=1)
    dist.destroy_process_group()
    return 0


def variant_name(pieces: int, remote: bool) -> str:
    return f"ours_p{pieces}" + ("r" if remote else "")


def torch_gemm(a, b, out, stream):
    import torch
    # (the handle as the CUDA array interface spells it: 1 is the legacy default stream)
    with torch.cuda.stream(torch.cuda.default_stream() if stream == 1 else torch.cuda.ExternalStream(stream)):
        torch.matmul(a, b, out=out)


def idle_wait(comm, torch, CollectiveMatmul, dtype_name, dtype) -> dict:
    """20 GEMMs on another stream, timed alone and while rank 0's call waits 50 ms for rank 1's rows."""
    rank = comm.Get_rank()
    x = torch.randn(4096, 4096, device="cuda", dtype=dtype)
    y = torch.empty_like(x)
    side = torch.cuda.Stream()

    def side_gemms() -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(side):
            start.record()
            for _ in range(20):
                torch.matmul(x, x, out=y)
            end.record()
        return start, end
    with CollectiveMatmul(comm, max_rows=2048, k=1024, n=1024, dtype=dtype_name) as cm:
        a = torch.randn(2048 // comm.Get_size(), 1024, device="cuda", dtype=dtype)
        b = torch.randn(1024, 1024, device="cuda", dtype=dtype)
        cm.all_gather_matmul(a, b)
        torch.cuda.synchronize()
        s, e = side_gemms()
        e.synchronize()
        s, e = side_gemms()
        e.synchronize()
        alone = s.elapsed_time(e) * 1e3
        comm.Barrier()
        if rank == 1:
            time.sleep(0.05)  # (held back on the host: nothing of rank 1's runs meanwhile)
        cm.all_gather_matmul(a, b)
        if rank == 0:
            s, e = side_gemms()
        torch.cuda.synchronize()
        beside = s.elapsed_time(e) * 1e3
        comm.Barrier()
    return dict(alone=alone, beside_wait=beside) if rank == 0 else dict(alone=np.nan, beside_wait=np.nan)


if __name__ == "__main__":
    raise SystemExit(main())
