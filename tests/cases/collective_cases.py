"""Multi-rank cases of CollectiveMatmul (run under mpiexec by tests/test_collective.py).

Every case draws the whole world's inputs from a seed, poisons the outputs (NaN bytes), runs the library and
checks this rank's result against NumPy in fp32 (the GEMM's accumulation), within the rounding of the result.
"""
from __future__ import annotations

import functools
import os
import time

import numpy as np
import pytest

import pyhipa2a
from pyhipa2a import A2AError, A2ATimeoutError, ConfigMismatchError, DeviceArray
from pyhipa2a.collective import CollectiveMatmul
from pyhipa2a.dtypes import resolve

DTYPES = ("bfloat16", "float16")


_UPLOADED: list = []  # (backend, pointer) of every array upload() made, freed when its case ends


def upload(cm, host: np.ndarray) -> DeviceArray:
    """`host` in device memory of its own (freed when the case ends: frees_uploads)."""
    ptr = cm.backend.malloc_ipc(max(host.nbytes, 1))
    _UPLOADED.append((cm.backend, ptr))
    arr = DeviceArray(cm.backend, ptr, host.shape, host.dtype)
    arr.copy_from(host)
    return arr


def free_uploads() -> None:
    while _UPLOADED:
        backend, ptr = _UPLOADED.pop()
        backend.free(ptr)


def frees_uploads(case):
    """The case's uploads are freed when it ends, however (the host backend's are files in /dev/shm)."""
    @functools.wraps(case)
    def run(*args, **kwargs):
        try:
            return case(*args, **kwargs)
        finally:
            free_uploads()
    return run


def poisoned(cm, shape, dtype) -> DeviceArray:
    arr = upload(cm, np.zeros(shape, dtype))
    arr.fill_bytes(0xFF)
    return arr


def draw(seed: int, shape, dtype) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal(shape) / np.sqrt(shape[-1])).astype(dtype)


def close_to(got: np.ndarray, want: np.ndarray, dtype, what: str) -> None:
    """Within two roundings of the result's type (fp32 sums differ in order only)."""
    got = np.asarray(got, np.float32)
    assert np.isfinite(got).all(), f"{what}: poison left in the result"
    eps = 2.0 ** -7 if resolve(dtype).name == "bfloat16" else 2.0 ** -10
    bound = 2 * eps * np.abs(want) + 1e-3
    worst = np.abs(got - want) - bound
    where = np.unravel_index(worst.argmax(), worst.shape)
    assert (worst <= 0).all(), f"{what}: off by {np.abs(got - want).max():.3g} at {where}"


def k_slices(k: int, world: int) -> list[tuple[int, int]]:
    """Uneven slices of K across ranks (matmul_reduce_scatter takes any k a rank)."""
    edges = np.linspace(0, k, world + 1).astype(int)
    return list(zip(edges[:-1], edges[1:]))


@frees_uploads
def case_against_numpy(comm, shapes="64,48,40;37,48,40;1,16,8", pieces="1", remote_sums="0"):
    """Both operations, both types, full and ragged shard rows, with and without out= and gathered=, each call
    twice on fresh inputs (the readiness words reused); each rank's rows moved in `pieces` pieces."""
    rank, world = comm.Get_rank(), comm.Get_size()
    shapes = [tuple(map(int, s.split(","))) for s in shapes.split(";")]
    seed = 10
    for dtype in DTYPES:
        d = resolve(dtype)
        with CollectiveMatmul(comm, max_rows=max(m for m, _, _ in shapes) * world, k=shapes[0][1],
                              n=shapes[0][2], dtype=dtype, pieces=int(pieces), remote_sums=remote_sums == "1",
                              timeout=30) as cm:
            for m, k, n in shapes:
                if (k, n) != (cm.k, cm.n):
                    continue
                for turn in range(2):
                    seed += 1
                    a = draw(seed, (world * m, k), d)
                    b = draw(seed + 1, (k, n), d)
                    out = poisoned(cm, (world * m, n), d) if turn else None
                    gathered = poisoned(cm, (world * m, k), d) if turn else None
                    c = cm.all_gather_matmul(upload(cm, a[rank * m:(rank + 1) * m]), upload(cm, b), out,
                                             gathered=gathered)
                    assert out is None or c is out
                    cm.synchronize()  # (a DeviceArray of ours that names no stream is read on the legacy one)
                    close_to(c.numpy(), a.astype(np.float32) @ b.astype(np.float32), d,
                             f"all_gather_matmul {dtype} m={m} turn {turn}")
                    if gathered is not None:
                        np.testing.assert_array_equal(gathered.numpy(), a)
                    cut = k_slices(k, world)
                    lo, hi = cut[rank]
                    out = poisoned(cm, (m, n), d) if turn else None
                    c = cm.matmul_reduce_scatter(upload(cm, np.ascontiguousarray(a[:, lo:hi])),
                                                 upload(cm, np.ascontiguousarray(b[lo:hi])), out)
                    cm.synchronize()
                    partials = [(a[:, x:y].astype(np.float32) @ b[x:y].astype(np.float32)).astype(d)
                                for x, y in cut]
                    want = np.sum([p.astype(np.float32) for p in partials], axis=0)[rank * m:(rank + 1) * m]
                    close_to(c.numpy(), want, d, f"matmul_reduce_scatter {dtype} m={m} turn {turn}")
            cm.synchronize()
    print(f"rank {rank}: {len(shapes)} shapes x {len(DTYPES)} types x 2 turns agree with NumPy")


@frees_uploads
def case_numpy_inputs_and_caller_gemm(comm):
    """NumPy arguments (copied in), and gemm= a callable of the caller's, given the rows it must multiply."""
    rank, world = comm.Get_rank(), comm.Get_size()
    d = resolve("bfloat16")
    m, k, n = 24, 32, 16
    calls = []

    def gemm(a_rows, b, out_rows, stream):
        calls.append(a_rows.shape)
        host = a_rows.numpy().astype(np.float32) @ b.numpy().astype(np.float32)
        out_rows.copy_from(host.astype(d))

    with CollectiveMatmul(comm, max_rows=m * world, k=k, n=n, dtype=d, timeout=30) as cm:
        if cm.backend.kind != "host":
            pytest.skip("a GEMM of NumPy's runs at once: the host backend's order (GPUs: torch's gemm=, bench)")
        a, b = draw(1, (world * m, k), d), draw(2, (k, n), d)
        c = cm.all_gather_matmul(a[rank * m:(rank + 1) * m], b)
        close_to(c.numpy(), a.astype(np.float32) @ b.astype(np.float32), d, "NumPy inputs")
        c = cm.all_gather_matmul(upload(cm, a[rank * m:(rank + 1) * m]), upload(cm, b), gemm=gemm)
        close_to(c.numpy(), a.astype(np.float32) @ b.astype(np.float32), d, "gemm= all_gather_matmul")
        assert calls == [(m, k)] * world, calls
        lo, hi = k_slices(k, world)[rank]
        c = cm.matmul_reduce_scatter(upload(cm, np.ascontiguousarray(a[:, lo:hi])),
                                     upload(cm, np.ascontiguousarray(b[lo:hi])), gemm=gemm)
        want = sum((a[:, x:y].astype(np.float32) @ b[x:y].astype(np.float32)).astype(d).astype(np.float32)
                   for x, y in k_slices(k, world))[rank * m:(rank + 1) * m]
        close_to(c.numpy(), want, d, "gemm= matmul_reduce_scatter")
        # NumPy arguments, copied in: the GEMM is given their copies (device arrays, as every other argument it gets)
        c = cm.all_gather_matmul(a[rank * m:(rank + 1) * m], b, gemm=gemm)
        close_to(c.numpy(), a.astype(np.float32) @ b.astype(np.float32), d, "gemm= of NumPy rows, all_gather_matmul")
        c = cm.matmul_reduce_scatter(np.ascontiguousarray(a[:, lo:hi]), np.ascontiguousarray(b[lo:hi]), gemm=gemm)
        close_to(c.numpy(), want, d, "gemm= of NumPy rows, matmul_reduce_scatter")

        def failing_gemm(a_rows, b, out_rows, stream):
            raise RuntimeError("the caller's GEMM failed")
        with pytest.raises(RuntimeError, match="the caller's GEMM failed"):  # (on every rank: nobody waits)
            cm.all_gather_matmul(a[rank * m:(rank + 1) * m], b, gemm=failing_gemm)
        with pytest.raises(A2AError, match=r"earlier call failed \(RuntimeError: the caller's GEMM failed\)"):
            cm.all_gather_matmul(a[rank * m:(rank + 1) * m], b)


@frees_uploads
def case_bad_input_is_refused(comm):
    """Every mistake is a clear exception on the calling rank before any work is queued, and the object still
    works; ranks that disagree on the rows a rank are named on every rank (the readiness words carry the count)."""
    rank, world = comm.Get_rank(), comm.Get_size()
    d = resolve("float16")
    m, k, n = 8, 16, 8
    with pytest.raises(ValueError, match="max_rows must be >= 1; got 0"):
        CollectiveMatmul(comm, max_rows=0, k=k, n=n)
    for wrong, error, message in ((dict(max_rows=2.5), TypeError, "max_rows must be an int, not float"),
                                  (dict(remote_sums="no"), TypeError, "remote_sums must be a bool, not str"),
                                  (dict(timeout=float("nan")), ValueError, "timeout must be a finite number")):
        with pytest.raises(error, match=message):  # (a coercion would take them: 2; True; a wait for ever)
            CollectiveMatmul(comm, **{**dict(max_rows=m * world, k=k, n=n, dtype=d), **wrong})
    # A runtime that cannot wait on the heap's words (ROCm with GPU_STREAMOPS_CP_WAIT set: runtime/hip.py)
    kind = type(pyhipa2a.get_backend())
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kind, "stream_waits_refused", lambda self: "no waits on heap words here")
        with pytest.raises(A2AError, match="CollectiveMatmul: no waits on heap words here"):
            CollectiveMatmul(comm, max_rows=m * world, k=k, n=n, dtype=d, timeout=2.0)
    cm = CollectiveMatmul(comm, max_rows=m * world, k=k, n=n, dtype=d, timeout=2.0)
    a, b = upload(cm, draw(1, (m, k), d)), upload(cm, draw(2, (k, n), d))
    with pytest.raises(TypeError, match="a_shard must be a 2-D array"):
        cm.all_gather_matmul(upload(cm, np.zeros(k, d)), b)
    with pytest.raises(ValueError, match=f"takes 1 to {m} a rank"):
        cm.all_gather_matmul(upload(cm, np.zeros((m + 1, k), d)), b)
    with pytest.raises(TypeError, match="float32"):
        cm.all_gather_matmul(upload(cm, np.zeros((m, k), np.float32)), b)
    with pytest.raises(ValueError, match="b"):
        cm.all_gather_matmul(a, upload(cm, np.zeros((k + 1, n), d)))
    with pytest.raises(ValueError, match="out"):
        cm.all_gather_matmul(a, b, poisoned(cm, (world * m + 1, n), d))
    # (a NumPy array is copied in, never back: the result would never be in it)
    with pytest.raises(TypeError, match="out must be a device array"):
        cm.all_gather_matmul(a, b, np.zeros((world * m, n), d))
    with pytest.raises(TypeError, match="gathered must be a device array"):
        cm.all_gather_matmul(a, b, gathered=np.zeros((world * m, k), d))
    with pytest.raises(TypeError, match="gemm must be None or a function"):
        cm.matmul_reduce_scatter(upload(cm, draw(5, (world * m, k), d)), b, gemm=5)
    with pytest.raises(TypeError, match=r"gemm must take four arguments \(a_rows, b, out_rows, stream\)"):
        cm.all_gather_matmul(a, b, gemm=lambda a_rows, b, out_rows: None)  # (refused before anything is queued)
    if world > 1:
        with pytest.raises(ValueError, match=f"multiple of the {world} ranks"):
            cm.matmul_reduce_scatter(upload(cm, np.zeros((world * m - 1, k), d)), b)
    full = draw(4, (world * m, k), d)
    c = cm.all_gather_matmul(upload(cm, full[rank * m:(rank + 1) * m]), b)
    close_to(c.numpy(), full.astype(np.float32) @ b.numpy().astype(np.float32), d, "after the refusals")
    if world > 1:
        odd = world - 1
        with pytest.raises(ConfigMismatchError, match="ranks disagree") as info:
            cm.all_gather_matmul(upload(cm, draw(3, (m - 1 if rank == odd else m, k), d)), b)
            cm.synchronize()
        named = info.value.ranks  # (the odd rank names the first of the others it waited for, or all)
        assert named == (odd,) if rank != odd else named and set(named) <= set(range(odd)), named
    cm.close()
    with pytest.raises(A2AError, match="its memory was freed by close\\(\\)"):
        c.numpy()


@frees_uploads
def case_missing_peer_times_out(comm, noticed_by="synchronize", op="all_gather_matmul", pieces="1"):
    """The last rank never calls: every other rank's call of `op` raises A2ATimeoutError naming it: on the host
    backend at once; on GPUs at synchronize(), or, where nobody waits through us (`noticed_by="watchdog"`, also
    with a second call queued behind the first), at the next call, after the watchdog released the streams and
    poisoned the output. Later calls are refused."""
    rank, world = comm.Get_rank(), comm.Get_size()
    if world == 1:
        pytest.skip("one rank has no peer to miss")
    d = resolve("bfloat16")
    m, k, n = 8, 16, 8
    cm = CollectiveMatmul(comm, max_rows=m * world, k=k, n=n, dtype=d, pieces=int(pieces), timeout=1.0)
    if noticed_by.startswith("watchdog") and cm.backend.kind == "host":
        pytest.skip("the host backend's waits are bounded where they run: the call itself raises")
    gather = op == "all_gather_matmul"
    a = upload(cm, draw(1, (m, k) if gather else (world * m, k), d))  # (reduce-scatter: any k a rank)
    b = upload(cm, draw(2, (k, n), d))
    call = getattr(cm, op)
    missing = world - 1
    if rank == missing:
        time.sleep(4.0)  # never calls, and outlives its peers' timeouts
        with pytest.raises(A2ATimeoutError, match="SymmetricHeap.close"):
            cm.close()  # its peers left without the closing barrier: a bounded wait, then unmapped anyway
    else:
        out = poisoned(cm, (world * m if gather else m, n), d)
        out.fill_bytes(0)
        start = time.monotonic()
        with pytest.raises(A2ATimeoutError, match=f"rank {missing}") as info:
            call(a, b, out)
            if noticed_by == "watchdog, two calls":  # (the second queued behind the first's stuck wait)
                call(a, b, out)
            if noticed_by.startswith("watchdog"):
                time.sleep(2.0)  # (no host wait of ours: the watchdog gives up after the 1 s timeout)
                cm.backend.stream_synchronize(cm.stream)  # (a wait of the caller's: it returns)
                assert np.isnan(out.numpy().astype(np.float32)).all(), "the watchdog must poison the output"
                call(a, b, out)
            else:
                cm.synchronize()
        assert info.value.ranks == (missing,) and time.monotonic() - start < 3.5, info.value.ranks
        assert np.isnan(out.numpy().astype(np.float32)).all(), "a failed call's output must read as poison"
        with pytest.raises(A2AError, match="an earlier call failed"):
            call(a, b)
        cm.close()
    free_uploads()
    comm.Barrier()
    print(f"[rank {rank}] tests.cases.collective_cases:case_missing_peer_times_out ok", flush=True)
    os._exit(0)  # (the last rank's unmatched closing barrier must not hold MPI_Finalize)


@frees_uploads
def case_captured_graph_replays(comm):
    """Both operations recorded on a capturing stream, replayed on new inputs filled in place."""
    rank, world = comm.Get_rank(), comm.Get_size()
    d = resolve("bfloat16")
    m, k, n = 16, 32, 24
    with CollectiveMatmul(comm, max_rows=m * world, k=k, n=n, dtype=d, timeout=30) as cm:
        backend = cm.backend
        a, b = upload(cm, np.zeros((m, k), d)), upload(cm, np.zeros((k, n), d))
        a_rs = upload(cm, np.zeros((world * m, k), d))
        out, out_rs = poisoned(cm, (world * m, n), d), poisoned(cm, (m, n), d)
        stream = backend.stream_create()
        cm.all_gather_matmul(a, b, out, stream=stream)  # (once before the capture: cuBLAS's first call sets up)
        cm.matmul_reduce_scatter(a_rs, b, out_rs, stream=stream)
        cm.synchronize()
        backend.capture_begin(stream)
        cm.all_gather_matmul(a, b, out, stream=stream)
        cm.matmul_reduce_scatter(a_rs, b, out_rs, stream=stream)
        graph = backend.capture_end(stream)
        for turn in range(3):
            full, bb = draw(20 + turn, (world * m, k), d), draw(30 + turn, (k, n), d)
            rs = draw(40 + turn, (world * m, k), d)
            a.copy_from(full[rank * m:(rank + 1) * m])
            b.copy_from(bb)  # (the same b on every rank, so the reduce-scatter's sum is rs_all @ b summed)
            a_rs.copy_from(rs)
            out.fill_bytes(0xFF)
            out_rs.fill_bytes(0xFF)
            comm.Barrier()
            backend.graph_launch(graph, stream)
            backend.stream_synchronize(stream)
            close_to(out.numpy(), full.astype(np.float32) @ bb.astype(np.float32), d, f"replay {turn}")
            everyone = comm.allgather(rs)
            want = sum((x.astype(np.float32) @ bb.astype(np.float32)).astype(d).astype(np.float32)
                       for x in everyone)[rank * m:(rank + 1) * m]
            close_to(out_rs.numpy(), want, d, f"replay {turn} (reduce-scatter)")
        backend.graph_destroy(graph)
        backend.stream_destroy(stream)


@frees_uploads
def case_repeated_calls_replay(comm, pieces="1"):
    """The same arrays called again and again, refilled in place, with two output arrays in turn, then without
    out=, then with the first again: the first calls queue step by step, a call that comes back is recorded
    and later ones replay the graph (pyhipa2a.replays), a call that repeats the last with the same arguments
    runs as its plan (pyhipa2a.repeat); every result is checked, the outputs poisoned before each call."""
    rank, world = comm.Get_rank(), comm.Get_size()
    d = resolve("float16")
    m, k, n = 12, 32, 24
    with CollectiveMatmul(comm, max_rows=m * world, k=k, n=n, dtype=d, pieces=int(pieces), timeout=30) as cm:
        a, b = upload(cm, np.zeros((m, k), d)), upload(cm, np.zeros((k, n), d))
        lo, hi = k_slices(k, world)[rank]
        a_rs, b_rs = upload(cm, np.zeros((world * m, hi - lo), d)), upload(cm, np.zeros((hi - lo, n), d))
        outs = [poisoned(cm, (world * m, n), d) for _ in range(2)]
        outs_rs = [poisoned(cm, (m, n), d) for _ in range(2)]
        gathered = poisoned(cm, (world * m, k), d)
        for turn in range(10):
            full, bb = draw(50 + turn, (world * m, k), d), draw(60 + turn, (k, n), d)
            a.copy_from(full[rank * m:(rank + 1) * m])
            b.copy_from(bb)
            a_rs.copy_from(np.ascontiguousarray(full[:, lo:hi]))
            b_rs.copy_from(np.ascontiguousarray(bb[lo:hi]))
            given = turn < 5 or turn == 9  # (turns 5 to 8: our own buffers, returned)
            out, out_rs = (outs[turn % 2], outs_rs[turn % 2]) if given else (None, None)
            for arr in (out, out_rs, gathered):
                if arr is not None:
                    arr.fill_bytes(0xFF)
            c = cm.all_gather_matmul(a, b, out, gathered=gathered)
            c_rs = cm.matmul_reduce_scatter(a_rs, b_rs, out_rs)
            cm.synchronize()
            assert not given or (c is out and c_rs is out_rs)
            close_to(c.numpy(), full.astype(np.float32) @ bb.astype(np.float32), d, f"all_gather_matmul turn {turn}")
            np.testing.assert_array_equal(gathered.numpy(), full)
            partials = [(full[:, x:y].astype(np.float32) @ bb[x:y].astype(np.float32)).astype(d)
                        for x, y in k_slices(k, world)]
            want = np.sum([p.astype(np.float32) for p in partials], axis=0)[rank * m:(rank + 1) * m]
            close_to(c_rs.numpy(), want, d, f"matmul_reduce_scatter turn {turn}")


@frees_uploads
def case_torch_tensors_and_gemm(comm):
    """PyTorch tensors in, PyTorch tensors out (views of ours, read on the current stream), with the vendor's GEMM
    and with torch.matmul as gemm= on the stream it is given."""
    torch = pytest.importorskip("torch")
    rank, world = comm.Get_rank(), comm.Get_size()
    m, k, n = 40, 64, 48
    with CollectiveMatmul(comm, max_rows=m * world, k=k, n=n, dtype="bfloat16", timeout=30) as cm:
        if cm.backend.kind != "cuda":
            pytest.skip("PyTorch's GPU tensors need the CUDA backend")
        d = resolve("bfloat16")

        def gemm(a_rows, b, out_rows, stream):
            assert isinstance(a_rows, torch.Tensor) and isinstance(out_rows, torch.Tensor)
            # (the handle as the CUDA array interface spells it: 1 is the legacy default stream)
            with torch.cuda.stream(torch.cuda.default_stream() if stream == 1 else torch.cuda.ExternalStream(stream)):
                torch.matmul(a_rows, b, out=out_rows)

        for turn, chosen in enumerate((None, gemm, None, gemm)):
            full, b = draw(50 + turn, (world * m, k), d), draw(60 + turn, (k, n), d)
            def as_torch(x):
                return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16).cuda()
            c = cm.all_gather_matmul(as_torch(full[rank * m:(rank + 1) * m]), as_torch(b), gemm=chosen)
            assert isinstance(c, torch.Tensor) and c.shape == (world * m, n)
            close_to(c.float().cpu().numpy(), full.astype(np.float32) @ b.astype(np.float32), d, f"torch AG {turn}")
            lo, hi = k_slices(k, world)[rank]
            c = cm.matmul_reduce_scatter(as_torch(np.ascontiguousarray(full[:, lo:hi])),
                                         as_torch(np.ascontiguousarray(b[lo:hi])), gemm=chosen)
            want = sum((full[:, x:y].astype(np.float32) @ b[x:y].astype(np.float32)).astype(d).astype(np.float32)
                       for x, y in k_slices(k, world))[rank * m:(rank + 1) * m]
            close_to(c.float().cpu().numpy(), want, d, f"torch RS {turn}")


@frees_uploads
def case_torch_graph_replays(comm):
    """Both operations inside torch.cuda.graph (PyTorch's capture of its current stream), replayed on inputs
    refilled in place: the copy streams and the readiness words are the graph's."""
    torch = pytest.importorskip("torch")
    rank, world = comm.Get_rank(), comm.Get_size()
    m, k, n = 32, 64, 48
    with CollectiveMatmul(comm, max_rows=m * world, k=k, n=n, dtype="bfloat16", pieces=2, timeout=30) as cm:
        if cm.backend.kind != "cuda":
            pytest.skip("PyTorch's graphs need the CUDA backend")
        d = resolve("bfloat16")
        a = torch.zeros(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.zeros(k, n, device="cuda", dtype=torch.bfloat16)
        a_rs = torch.zeros(world * m, k, device="cuda", dtype=torch.bfloat16)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # (warm-up on the capture's stream, as PyTorch asks)
            cm.all_gather_matmul(a, b)
            cm.matmul_reduce_scatter(a_rs, b)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            c = cm.all_gather_matmul(a, b)
            c_rs = cm.matmul_reduce_scatter(a_rs, b)
        for turn in range(3):
            full, rs = draw(70 + turn, (world * m, k), d), draw(90 + turn, (world * m, k), d)
            bb = draw(80 + turn, (k, n), d)
            for dst, src in ((a, full[rank * m:(rank + 1) * m]), (b, bb), (a_rs, rs)):
                dst.copy_(torch.from_numpy(np.ascontiguousarray(src).view(np.int16)).view(torch.bfloat16))
            c.fill_(float("nan"))
            c_rs.fill_(float("nan"))
            torch.cuda.synchronize()
            comm.Barrier()
            graph.replay()
            torch.cuda.synchronize()
            close_to(c.float().cpu().numpy(), full.astype(np.float32) @ bb.astype(np.float32), d, f"replay {turn}")
            want = sum((x.astype(np.float32) @ bb.astype(np.float32)).astype(d).astype(np.float32)
                       for x in comm.allgather(rs))[rank * m:(rank + 1) * m]
            close_to(c_rs.float().cpu().numpy(), want, d, f"replay {turn} (reduce-scatter)")
        del graph


@frees_uploads
def case_issue_shapes(comm, rows_checked="192"):
    """The benchmark's shapes (issue 56's table, M up to 16384), both types: rows drawn from every rank's block
    checked against NumPy in fp32."""
    rank, world = comm.Get_rank(), comm.Get_size()
    shapes = ((2048, 7168, 4096), (8192, 7168, 4096), (16384, 8192, 8192))
    for dtype in DTYPES:
        d = resolve(dtype)
        for M, K, N in shapes:
            m = M // world
            with CollectiveMatmul(comm, max_rows=M, k=K, n=N, dtype=dtype, pieces=2, timeout=60) as cm:
                if cm.backend.kind == "host":
                    pytest.skip("NumPy's GEMMs of these sizes take minutes on the host backend")
                a, b = draw(M, (M, K), d), draw(K, (K, N), d)
                check = np.sort(np.random.default_rng(M + 1).choice(M, int(rows_checked), replace=False))
                c = cm.all_gather_matmul(upload(cm, a[rank * m:(rank + 1) * m]), upload(cm, b))
                got = c.numpy()[check]
                close_to(got, a[check].astype(np.float32) @ b.astype(np.float32), d, f"AG {dtype} {M},{K},{N}")
                cut = k_slices(K, world)
                lo, hi = cut[rank]
                c = cm.matmul_reduce_scatter(upload(cm, np.ascontiguousarray(a[:, lo:hi])),
                                             upload(cm, np.ascontiguousarray(b[lo:hi])))
                mine = check[(check >= rank * m) & (check < (rank + 1) * m)]
                want = sum((a[mine, x:y].astype(np.float32) @ b[x:y].astype(np.float32)).astype(d).astype(np.float32)
                           for x, y in cut)
                close_to(c.numpy()[mine - rank * m], want, d, f"RS {dtype} {M},{K},{N}")
    print(f"rank {rank}: {len(shapes)} shapes x {len(DTYPES)} types agree with NumPy on {rows_checked} rows each")


@frees_uploads
def case_jax_arrays(comm):
    """JAX arrays in (eager): read where they lie, through DLPack; the result is ours (a DeviceArray)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # (our heap shares the GPU with JAX's pool)
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    rank, world = comm.Get_rank(), comm.Get_size()
    d = resolve("bfloat16")
    m, k, n = 24, 32, 16
    with CollectiveMatmul(comm, max_rows=m * world, k=k, n=n, dtype=d, timeout=30) as cm:
        platform = "cpu" if cm.backend.kind == "host" else "gpu"
        try:
            device = jax.devices(platform)[cm.heap.device.index if platform == "gpu" else 0]
        except RuntimeError:
            pytest.skip(f"this JAX has no {platform} device")
        for turn in range(2):
            full, b = draw(100 + turn, (world * m, k), d), draw(110 + turn, (k, n), d)
            a_shard = jax.device_put(jnp.asarray(full[rank * m:(rank + 1) * m]), device)
            c = cm.all_gather_matmul(a_shard, jax.device_put(jnp.asarray(b), device))
            close_to(c.numpy(), full.astype(np.float32) @ b.astype(np.float32), d, f"JAX inputs, turn {turn}")
