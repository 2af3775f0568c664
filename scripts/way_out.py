"""The way in and out in the caller's library, timed as gpu-mode's harness does:
`mpirun -n N python scripts/way_out.py torch|cupy|jax [current|own] [iterations]`.

Per gpu-mode benchmark shape, with inputs of the library: the host time of handing y and expert_x out as
that library's arrays (pyhipa2a hands PyTorch's and CuPy's out as they are; an older pyhipa2a, or JAX,
needs the library's from_dlpack), and the wall of one eager step (dispatch, combine with the fused expert,
the output in the library; barrier, the step, synchronize) beside the wall of pyhipa2a's own graph of the
same step. Medians over 50 calls, max over ranks; the geomean last. Runs against whichever pyhipa2a is
first on the path (PYTHONPATH), so two versions compare in one job.
"""
from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time

from mpi4py import MPI

import pyhipa2a
from pyhipa2a import AllToAll
from pyhipa2a.testing import draw_world, fused_step_graph

SHAPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpumode_all2all.json")


def library(name: str, device: int | None, hosts):
    """(inputs on the device, from_dlpack, synchronize, is the library's array) for PyTorch, CuPy or JAX;
    device None: the host backend's (CPU) arrays."""
    if name == "torch":
        import torch
        if device is None:
            return [torch.from_numpy(h) for h in hosts], torch.from_dlpack, lambda: None, \
                lambda a: isinstance(a, torch.Tensor)
        torch.cuda.set_device(device)
        return ([torch.from_numpy(h).cuda() for h in hosts], torch.from_dlpack, torch.cuda.synchronize,
                lambda a: isinstance(a, torch.Tensor))
    if name == "cupy":
        import cupy
        cupy.cuda.Device(device).use()
        return ([cupy.asarray(h) for h in hosts], cupy.from_dlpack, lambda: cupy.cuda.Device().synchronize(),
                lambda a: isinstance(a, cupy.ndarray))
    import jax
    where = jax.devices("cpu")[0] if device is None else [d for d in jax.devices() if d.platform == "gpu"][device]
    return [jax.device_put(h, where) for h in hosts], jax.dlpack.from_dlpack, lambda: None, \
        lambda a: isinstance(a, jax.Array)


def median_us(comm, once, iters: int, warmup: int = 10) -> float:
    times = []
    for i in range(iters + warmup):
        sample = once()
        if i >= warmup:
            times.append(sample)
    return comm.allreduce(statistics.median(times) * 1e6, op=MPI.MAX)


def main() -> int:
    name, calls_on = sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "current"
    iters = int(sys.argv[3]) if len(sys.argv) > 3 else 50
    comm, rows = MPI.COMM_WORLD, []
    world = comm.Get_size()
    for shape in json.load(open(SHAPES))["benchmarks"]:
        E, k, H, M = (shape[n] for n in ("num_experts", "experts_per_token", "hidden_dim", "max_num_tokens"))
        with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, stream=calls_on) as a2a:
            me = a2a.rank
            inputs = draw_world(shape.get("seed", 1), world, E, k, H, M)
            device = None if a2a.backend.kind == "host" else a2a.heap.device.index
            (x, idx, w), from_dlpack, sync, theirs = library(name, device,
                                                             (inputs.xs[me], inputs.indices[me], inputs.weights[me]))

            def step():
                d = a2a.dispatch(x, idx)
                return d, a2a.combine(d.expert_x, w, expert_scale=1 + me)

            def out(a):
                return a if theirs(a) else from_dlpack(a)

            def handing_out():
                d, y = step()
                t0 = time.perf_counter()
                out(y), out(d.expert_x)
                spent = (time.perf_counter() - t0) / 2
                a2a.synchronize()
                sync()
                return spent

            def eager_wall():
                a2a.synchronize()
                sync()
                comm.Barrier()
                t0 = time.perf_counter()
                y = out(step()[1])
                if name == "jax":
                    y.block_until_ready()
                sync()
                a2a.synchronize()
                comm.Barrier()
                return time.perf_counter() - t0
            with fused_step_graph(a2a, inputs) as graph:
                def graph_wall():
                    a2a.synchronize()
                    comm.Barrier()
                    t0 = time.perf_counter()
                    graph.launch()
                    a2a.synchronize()
                    comm.Barrier()
                    return time.perf_counter() - t0
                row = [median_us(comm, f, iters, min(10, iters)) for f in (handing_out, eager_wall, graph_wall)]
            rows.append(row)
            if me == 0:
                print(f"{name} ({calls_on}) E={E} k={k} H={H} M={M}: handing out {row[0]:.1f} us an array, "
                      f"eager wall {row[1]:.1f} us, graph wall {row[2]:.1f} us, eager / graph {row[1] / row[2]:.2f}")
    if comm.Get_rank() == 0:
        g = [math.exp(sum(math.log(r[i]) for r in rows) / len(rows)) for i in range(3)]
        print(f"geomean ({name}, {calls_on}, {os.path.dirname(pyhipa2a.__file__)}): handing out {g[0]:.1f} us an "
              f"array, eager wall {g[1]:.1f} us, graph wall {g[2]:.1f} us, eager / graph {g[1] / g[2]:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
