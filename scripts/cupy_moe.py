"""MoE layer with CuPy and no PyTorch: `mpirun -n N python scripts/cupy_moe.py`.

dispatch -> a CuPy elementwise "expert" -> combine, with CuPy arrays handed
in and out without copies: pyhipa2a reads CuPy's x / indices / weights in
place (__cuda_array_interface__), CuPy views pyhipa2a's expert_x in place,
and combine writes into a CuPy array given as `out=`. Everything is queued on
one CuPy stream; the result is checked against pyhipa2a.reference.
"""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402
from mpi4py import MPI  # noqa: E402

from pyhipa2a import AllToAll, reference  # noqa: E402
from pyhipa2a.testing import combine_error, draw_world  # noqa: E402

E_PER_RANK, K, H, M = 8, 4, 2048, 64

# The expert: y = x * (1 + rank), in fp32, rounded to fp16 (gpu-mode's stand-in for a GEMM).
scale_expert = cp.ElementwiseKernel("float16 x, float32 s", "float16 y", "y = (float16)((float)x * s)",
                                    "scale_expert")


def main() -> int:
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    E = E_PER_RANK * world
    # pyhipa2a picks device (node-local rank % GPUs); CuPy must use the same one.
    with AllToAll(comm, num_experts=E, experts_per_token=K, hidden_dim=H, max_num_tokens=M) as a2a:
        device = cp.cuda.Device(a2a.heap.device.index)
        worst = 0.0
        with device, cp.cuda.Stream(non_blocking=True) as stream:
            for step in range(3):
                inputs = draw_world(100 + step, world, E, K, H, M)
                x = cp.asarray(inputs.xs[rank])
                assert x.device.id == device.id, (x.device.id, device.id)
                indices = cp.asarray(inputs.indices[rank])
                weights = cp.asarray(inputs.weights[rank])

                d = a2a.dispatch(x, indices, stream=stream)
                expert_x = cp.asarray(d.expert_x)            # a view of the symmetric heap, no copy
                assert expert_x.data.ptr == d.expert_x.ptr
                expert_y = scale_expert(expert_x, cp.float32(1 + rank))   # rows past the counts are ignored
                y = cp.empty((x.shape[0], H), cp.float16)
                a2a.combine(expert_y, weights, out=y, stream=stream)

                stream.synchronize()
                a2a.synchronize(stream=stream)
                expected = reference.combine(inputs.xs, inputs.indices, inputs.weights, E, ranks=[rank])[rank]
                worst = max(worst, combine_error(cp.asnumpy(y), expected, np.float16))
        worst = comm.allreduce(worst, op=MPI.MAX)
        if rank == 0:
            print(f"cupy_moe: {world} ranks, E={E} k={K} H={H} M={M}: 3 steps correct, max |y - oracle| {worst:.3g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
