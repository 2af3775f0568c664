"""Multi-rank cases for failures: dead peers, contract violations seen only on the device."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import pyhipa2a
from mpi4py import MPI
from pyhipa2a import A2ADeviceError, A2AError, A2ATimeoutError, AllToAll, DeviceArray
from pyhipa2a.testing import draw_world, run_round
from tests.cases import routed_to


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
    survivors = comm.Split(0 if comm.Get_rank() != dead else pyhipa2a.bootstrap.mpi().UNDEFINED)
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
        dev = DeviceArray(a2a.backend, a2a.buffers["weights_stage"].ptr, bad.shape, np.int32, owner=a2a.heap)
        dev.view(bad.shape).copy_from(bad)
        result = a2a.dispatch(inputs.xs[a2a.rank], dev)
        # Both entries are reported by concurrent warps on a GPU; the first report wins.
        with pytest.raises(A2ADeviceError, match=rf"expert index ({E + 5} at flat position 2|"
                                                 rf"{bad[2, 0]} at flat position 5)"):
            a2a.synchronize()
        # The call failed, so its outputs are poisoned on the device for consumers that read without
        # asking (-1 counts and meta, NaN rows: all-ones bytes), and our own arrays refuse to be read.
        assert (a2a.buffers["num_tokens"].numpy() == -1).all()
        assert (a2a.buffers["recv_meta"].numpy() == -1).all()
        assert (a2a.buffers["recv_x"].numpy().view(np.uint16) == 0xFFFF).all()
        with pytest.raises(A2ADeviceError, match="expert index"):
            result.expert_num_tokens.numpy()
        with pytest.raises(A2AError, match="unusable after an earlier failure"):
            a2a.dispatch(inputs.xs[a2a.rank], inputs.indices[a2a.rank])


def case_contiguous_rows_beyond_R(comm):
    """row_layout="contiguous" with max_recv_rows R: rows that fit R exactly (each expert's rounded up to
    row_align) arrive whole; rows whose rounded end passes R (here by one row_align) are an error reported on
    the rank that receives them, with every output poisoned, never a row dropped unseen. A grouped dispatch
    that fails so releases the streams that wait for its groups."""
    from pyhipa2a import reference
    from pyhipa2a.testing import check_dispatch_against_oracle, poison
    world = comm.Get_size()
    E, k, H, M, align = 4 * world, 3, 64, 16, 8
    inputs = draw_world(31, world, E, k, H, M, token_counts=[M] * world)
    me = comm.Get_rank()
    counts = reference.dispatch(inputs.xs, inputs.indices, E)[me].expert_num_tokens
    mine = int(reference.contiguous_offsets(counts, align)[-1])
    need = comm.allreduce(mine, op=MPI.MAX)  # (R is the same on every rank: the buffers are in the heap)
    params = dict(num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, row_layout="contiguous",
                  row_align=align, timeout=5.0)
    with AllToAll(comm, max_recv_rows=need, **params) as a2a:
        assert a2a.config.recv_rows == need
        run_round(a2a, inputs)
        poison(a2a)
        d = a2a.dispatch(inputs.xs[me], inputs.indices[me])
        a2a.synchronize()
        check_dispatch_against_oracle(a2a, inputs, d)
        a2a.combine(d.expert_x, inputs.weights[me], expert_scale=2.0)
        a2a.synchronize()
    with AllToAll(comm, max_recv_rows=need - align, **params) as a2a:
        d = a2a.dispatch(inputs.xs[me], inputs.indices[me], weights=inputs.weights[me], groups=2)
        if mine < need:
            # Our rows fit; but we read our sources' tokens in their heaps, and a source whose rows overflowed (or
            # that failed, in turn, reading such a source's) may fail while we read them: then so do we, our
            # outputs poison, naming it (its next call may rewrite them): likelier the more ranks there are.
            try:
                a2a.synchronize()
            except A2ADeviceError as e:
                assert "while this rank read its tokens where they lie" in str(e), e
                assert (a2a.buffers["num_tokens"].numpy() == -1).all()
                assert (a2a.buffers["recv_meta"].numpy() == -1).all()
            else:
                check_dispatch_against_oracle(a2a, inputs, d)
            return
        # (The host backend has run the call by now, so the first wait already raises; on a GPU the waits are
        # queued on our own stream, and synchronize() returns only if the failed call released them.)
        with pytest.raises(A2ADeviceError, match=f"rank {me}: local expert .* overflowed its rows"):
            a2a.wait_group(0)
            a2a.wait_group(1)
            a2a.synchronize()
        # (A wait may have raised from the host's mirror of the status, written as the kernel reports and
        # before it poisons its outputs: the device is done with them once synchronize() is.)
        with pytest.raises(A2ADeviceError, match="overflowed"):
            a2a.synchronize()
        assert (a2a.buffers["num_tokens"].numpy() == -1).all()
        # (offsets all R: a grouped GEMM reading them takes NaN rows, not a fault, and [0] != 0 marks them)
        assert (a2a.buffers["offsets"].numpy() == a2a.config.recv_rows).all()
        assert (a2a.buffers["recv_meta"].numpy() == -1).all()
        assert (a2a.buffers["recv_x"].numpy().view(np.uint16) == 0xFFFF).all()
        with pytest.raises(A2ADeviceError, match="overflowed"):
            d.expert_offsets.numpy()


def case_failed_rank_poisons_later_calls(comm, row_layout="packed"):
    """A kernel that starts while its rank's status already holds an error (an earlier call failed on
    the device, and the host has not seen it yet, as in a graph replayed blindly) poisons the outputs it
    would have written, even where the call itself sees nothing go wrong (expert_layout too, where the
    rows are laid out by source, expert_offsets where they are contiguous)."""
    world = comm.Get_size()
    E, k, H, M = 4 * world, 2, 256, 8
    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, timeout=5.0,
                  row_layout=row_layout) as a2a:
        inputs = draw_world(13, world, E, k, H, M)
        x, idx, w = inputs.xs[a2a.rank], inputs.indices[a2a.rank], inputs.weights[a2a.rank]
        T = x.shape[0]
        d = a2a.dispatch(x, idx)
        y = a2a.combine(a2a.fake_expert(d), w).numpy()[:T]
        assert (a2a.buffers["num_tokens"].numpy() >= 0).all() and not np.isnan(y.astype(np.float32)).any()
        # Every rank's status says "failed" on the device only: the host's mirror stays clear, so the
        # host launches the next call, and each of its kernels finds the error as it begins.
        a2a.buffers["status"].copy_from(np.array([pyhipa2a.errors.STATUS_TIMEOUT, 0, 0, 0], np.uint32))
        comm.Barrier()
        d = a2a.dispatch(x, idx)
        a2a.synchronize()
        assert (a2a.buffers["num_tokens"].numpy() == -1).all()
        assert (a2a.buffers["recv_meta"].numpy() == -1).all()
        assert (a2a.buffers["recv_x"].numpy().view(np.uint16) == 0xFFFF).all()
        assert (d.expert_layout is not None, d.expert_offsets is not None) == (row_layout == "by_source",
                                                                                row_layout == "contiguous")
        if row_layout == "by_source":
            assert (a2a.buffers["layout"].numpy() == -1).all()
        if row_layout == "contiguous":
            assert (a2a.buffers["offsets"].numpy() == a2a.config.recv_rows).all()
        # The fake expert reads poisoned counts (-1) as "all rows": poison in, poison out, nothing
        # read or written past its buffers.
        expert_y = a2a.fake_expert(d)
        assert np.isnan(expert_y.numpy().astype(np.float32)).all()
        y = a2a.combine(expert_y, w).numpy()
        assert (y[:T].view(np.uint16) == 0xFFFF).all()


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


def case_skipped_call(comm, leg, on_timeout):
    """The last rank skips one leg (dispatch, or the combine after it). On every other rank the
    outputs of that call never read as data: `.numpy()`, DLPack and the CUDA array interface raise the
    timeout naming the skipper, the buffers hold poison (NaN rows, -1 counts and meta) for consumers
    that read without asking, synchronize() raises, and so does the next call. With
    on_timeout="trap" the process cannot use its device any more: every later device operation fails."""
    world = comm.Get_size()
    if world == 1:
        pytest.skip("needs a peer that skips")
    skipper, E, k, H, M, T = world - 1, 2 * world, 2, 64, 8, 5
    a2a = AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M, timeout=1.5,
                   on_timeout=on_timeout)
    inputs = routed_to(draw_world(11, world, E, k, H, M, token_counts=[T] * world), E - 1)  # (the skipper's)
    x, idx, w = inputs.xs[a2a.rank], inputs.indices[a2a.rank], inputs.weights[a2a.rank]
    skips = a2a.rank == skipper
    # A GPU context that trapped cannot free anything, so those ranks leave without closing, saying so.
    dead_context = on_timeout == "trap" and a2a.backend.kind != "host"

    def leave():
        comm.Barrier()  # MPI only: no device work
        if dead_context:
            print(f"[rank {comm.Get_rank()}] LEFT-AFTER-TRAP", flush=True)
            os._exit(0)
        a2a.close()

    if not (skips and leg == "dispatch"):
        d = a2a.dispatch(x, idx)
    if skips:
        return leave()
    y = a2a.combine(d.expert_x, w) if leg == "combine" else None
    failed = [d.expert_num_tokens, d.expert_x, d.expert_meta] if leg == "dispatch" else [y]
    named = rf"rank {skipper} never arrived"
    for out in failed:
        with pytest.raises(A2ATimeoutError, match=named):
            out.numpy()
        with pytest.raises(A2ATimeoutError, match=named):
            out.__dlpack__()
        if a2a.backend.kind == "cuda":
            with pytest.raises(A2ATimeoutError, match=named):
                out.__cuda_array_interface__
    with pytest.raises(A2ATimeoutError, match=named):
        a2a.synchronize()
    with pytest.raises(A2AError, match="unusable|timed out"):
        a2a.dispatch(x, idx)
    if on_timeout == "trap":
        # The device is gone for this process: a plain memset (nothing of ours) fails too.
        with pytest.raises(pyhipa2a.RuntimeFailure):
            a2a.backend.memset(a2a.buffers["y"].ptr, 0, 16)
            a2a.backend.stream_synchronize(None)
        return leave()
    # Poison, read past the outputs' checks (the heap's own views carry none).
    if leg == "dispatch":
        assert (a2a.buffers["num_tokens"].numpy() == -1).all()
        assert (a2a.buffers["recv_meta"].numpy() == -1).all()
        assert np.isnan(a2a.buffers["recv_x"].numpy().astype(np.float32)).all()
    else:
        assert np.isnan(a2a.buffers["y"].numpy()[:T].astype(np.float32)).all()
    leave()


def case_agreement_waits_and_names_the_refusing_rank(comm):
    """A setup's agreement (bootstrap.agreed) waits for a late rank as MPI would; a rank whose check refused its
    arguments raises its own error, and every other rank a ConfigMismatchError naming it in its words (having
    undone what it made); ranks at different steps of setup name each other; the ranks stay in step throughout."""
    from pyhipa2a.bootstrap import agreed
    from pyhipa2a.errors import ConfigMismatchError
    world, me = comm.Get_size(), comm.Get_rank()
    if world == 1:
        pytest.skip("one rank has no peer to tell")
    last = world - 1
    if me == last:
        time.sleep(1.5)
    assert agreed(comm, "late", lambda: me * 2) == me * 2

    def refuse():
        raise ImportError("no bindings for this GPU here")  # (any exception: a rank that sent nothing would hang)
    undone = []
    if me == last:
        with pytest.raises(ImportError, match="no bindings"):
            agreed(comm, "refused", refuse, undo=undone.append)
    else:
        with pytest.raises(ConfigMismatchError, match=f"refused: rank {last} refused its arguments \\(ImportError: "
                                                      "no bindings for this GPU here\\)") as info:
            agreed(comm, "refused", lambda: me, undo=undone.append)
        assert info.value.ranks == (last,)
    assert undone == ([] if me == last else [me])
    step = "elsewhere" if me == last else "here"
    with pytest.raises(ConfigMismatchError, match="at another step of setup") as info:
        agreed(comm, step, lambda: me)
    assert info.value.ranks == (tuple(range(last)) if me == last else (last,))
    assert agreed(comm, "after", lambda: me) == me


def case_barrier_names_the_late_rank(comm):
    """A bounded barrier that times out names the rank that never arrived, on every rank that waited; the
    late rank, arriving after, passes it, and the ranks are in step again at the next barrier."""
    from pyhipa2a.bootstrap import bounded_barrier
    world, me = comm.Get_size(), comm.Get_rank()
    if world == 1:
        pytest.skip("one rank has no peer to be late")
    bounded_barrier(comm, 10.0, "before")
    late = world - 1
    if me == late:
        time.sleep(1.5)
        bounded_barrier(comm, 10.0, "late")
    else:
        with pytest.raises(A2ATimeoutError, match=f"late: rank {me} waited 0.5 s at a barrier; rank {late} never "
                                                  "arrived") as info:
            bounded_barrier(comm, 0.5, "late")
        assert info.value.ranks == (late,)
    bounded_barrier(comm, 10.0, "after")
