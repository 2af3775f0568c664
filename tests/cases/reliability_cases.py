"""Multi-rank cases for failures: dead peers, contract violations seen only on the device."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import pyhipa2a
from pyhipa2a import A2ADeviceError, A2AError, A2ATimeoutError, AllToAll, DeviceArray
from pyhipa2a.testing import draw_world


def case_peer_dies(comm, outdir):
    """The last rank stops dead mid-run (SIGSTOP: it never runs again, and the process manager does not
    notice, so it cannot take the survivors down); every other rank raises A2ATimeoutError naming it
    within timeout + 2 s and frees its memory. The survivors kill it at the end."""
    try:
        _peer_dies(comm, outdir)
    except BaseException:  # kept in a file: the job's output may be lost with the dead process
        import traceback
        with open(os.path.join(outdir, f"error{comm.Get_rank()}.txt"), "w") as f:
            traceback.print_exc(file=f)
        raise


def _peer_dies(comm, outdir):
    world = comm.Get_size()
    if world == 1:
        pytest.skip("needs a peer to die")
    dead, timeout = world - 1, 2.0
    a2a = AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=64, max_num_tokens=4, timeout=timeout)
    inputs = draw_world(5, world, world, 1, 64, 4, token_counts=[4] * world)
    # The survivors' own communicator, made while everyone is alive: they leave together, since the
    # process manager may take the job down once a process has exited.
    survivors = comm.Split(0 if comm.Get_rank() != dead else pyhipa2a.bootstrap._mpi().UNDEFINED)
    dead_pid = comm.bcast(os.getpid(), root=dead)
    comm.Barrier()
    if a2a.rank == dead:
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3600)  # never reached: the survivors kill this process
    time.sleep(0.5)
    start = time.monotonic()
    a2a.dispatch(inputs.xs[a2a.rank], inputs.indices[a2a.rank])
    with pytest.raises(A2ATimeoutError, match=f"rank {dead} never arrived") as info:
        a2a.synchronize()
    elapsed = time.monotonic() - start
    assert dead in info.value.ranks and elapsed < timeout + 2.0, elapsed
    with pytest.raises(A2AError, match="unusable"):
        a2a.dispatch(inputs.xs[a2a.rank], inputs.indices[a2a.rank])
    # Results go to files: the process manager may lose the output of a job that lost a process.
    report = open(os.path.join(outdir, f"rank{a2a.rank}.txt"), "w")
    report.write(f"PEER-DEATH-DETECTED after {elapsed:.2f} s\n")
    report.flush()
    a2a.close()  # after the timeout, close() frees local memory without talking to the dead rank
    report.write("CLOSED\n")
    report.close()
    survivors.Barrier()
    if survivors.Get_rank() == 0:
        os.kill(dead_pid, signal.SIGKILL)
    os._exit(0)  # MPI_Finalize could wait for the dead rank forever


def case_device_checks_indices(comm):
    """Indices handed over as a device array skip the host check: the kernels report them, write nothing bad."""
    world = comm.Get_size()
    E, k, H, M = 2 * world, 2, 64, 8
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        inputs = draw_world(9, world, E, k, H, M, token_counts=[4] * world)
        bad = inputs.indices[a2a.rank].copy()
        bad[1, 0] = E + 5            # out of range
        bad[2, 1] = bad[2, 0]        # repeated in its row
        dev = DeviceArray(a2a.backend, a2a.buf["weights_stage"].ptr, bad.shape, np.int32, owner=a2a.heap)
        dev.view(bad.shape).copy_from(bad)
        a2a.dispatch(inputs.xs[a2a.rank], dev)
        # Both entries are reported by concurrent warps on a GPU; the first report wins.
        with pytest.raises(A2ADeviceError, match=rf"expert index ({E + 5} at flat position 2|"
                                                 rf"{bad[2, 0]} at flat position 5)"):
            a2a.synchronize()
        # Only valid entries were delivered. A GPU stops waiting once its rank reported an error, so
        # fewer may have landed, never more, and every delivered row names a real (rank, token, slot).
        valid = np.zeros(a2a.local_experts, np.int64)
        for r in range(world):
            idx = inputs.indices[r].copy()
            idx[1, 0], idx[2, 1] = E + 5, idx[2, 0]
            for t in range(idx.shape[0]):
                seen = set()
                for e in idx[t]:
                    if 0 <= e < E and e not in seen and e // a2a.local_experts == a2a.rank:
                        valid[e % a2a.local_experts] += 1
                    seen.add(e)
        counts = a2a.buf["num_tokens"].numpy()
        assert (counts >= 0).all() and (counts <= valid).all(), (counts, valid)
        meta = a2a.buf["recv_meta"].numpy()
        for l, n in enumerate(counts):
            src, tok, slot = meta[l, :n, 0], meta[l, :n, 1], meta[l, :n, 2]
            assert ((src >= 0) & (src < world) & (tok >= 0) & (tok < 4) & (slot >= 0) & (slot < k)).all()
        with pytest.raises(A2AError, match="unusable after an earlier failure"):
            a2a.dispatch(inputs.xs[a2a.rank], inputs.indices[a2a.rank])


def case_foreign_non_contiguous(comm):
    """A DLPack array with strides is refused with a clear error."""
    world = comm.Get_size()
    with AllToAll(comm, num_experts=world, experts_per_token=1, hidden_dim=32, max_num_tokens=4) as a2a:
        assert a2a.backend.kind == "host", "host arrays stand in for a foreign framework's here"
        base = np.zeros((4, 64), np.float16)
        strided = base[:, ::2]

        class Foreign:  # only DLPack, like another framework's array
            shape, dtype = strided.shape, strided.dtype

            def __dlpack__(self, **kw):
                return strided.__dlpack__(**kw)

            def __dlpack_device__(self):
                return strided.__dlpack_device__()
        with pytest.raises(ValueError, match="x must be C-contiguous"):
            a2a.dispatch(Foreign(), np.zeros((4, 1), np.int32))
        assert pyhipa2a.AllToAll is AllToAll
