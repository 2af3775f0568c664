"""CollectiveMatmul: tensor parallelism's all-gather + GEMM and GEMM + reduce-scatter, the exchange hidden behind
the GEMMs chunk by chunk.

    with CollectiveMatmul(comm, max_rows=M, k=K, n=N, dtype="bfloat16") as cm:
        c = cm.all_gather_matmul(a_shard, b)        # a_shard [M/W, K], b [K, N] -> c [M, N]
        c_shard = cm.matmul_reduce_scatter(a, b)    # a [M, K/W], b [K/W, N] -> c_shard [M/W, N]

How a call runs (docs/COLLECTIVE.md has the picture): the caller's stream runs the GEMMs, one chunk of rows a
rank; a copy stream a peer moves rows between heaps with the copy engine and raises a readiness word in the
peer's heap (pyhipa2a.signals); the GEMM of a chunk waits for its word on the device. Chunks go in ring order:
all_gather_matmul starts on its own rows while the others arrive (rank r - 1's first); matmul_reduce_scatter
starts on the rows for rank r + 1, so its own partial sums are computed last, behind the copies of the others.
The call's stream waits for the copy streams before it returns, so it covers everything the call does.
"""
from __future__ import annotations

import functools
import threading
import time

import numpy as np

from . import producers
from .array import DeviceArray
from .bootstrap import bounded_barrier, world_size
from .dtypes import check_supported
from .errors import A2AError, A2ATimeoutError, ConfigMismatchError
from .heap import SymmetricHeap
from .inputs import Boundary
from .streams import Streams
from .watchdog import Watchdog

VIEWS_KEPT = 256  # the caller's-library views of our memory kept for gemm= (a new array's are made anew)


class CollectiveMatmul:
    """Heap buffers for one (max_rows, k, n, dtype), made once; every rank makes the same calls in order.
    `pieces`: each rank's rows move in this many pieces, each on its own copy stream and awaited by its own word.
    `remote_sums`: matmul_reduce_scatter's GEMMs write a peer's partial sums straight into its heap, across the
    link, instead of into ours for a copy engine to move."""

    def __init__(self, comm=None, *, max_rows: int, k: int, n: int, dtype="bfloat16", pieces: int = 1,
                 remote_sums: bool = False, backend=None, device: int | None = None, timeout: float = 60.0):
        for name, value in (("max_rows", max_rows), ("k", k), ("n", n), ("pieces", pieces)):
            if int(value) != value or value < 1:
                raise ValueError(f"{name} must be a positive integer, not {value!r}")
        self.dtype = check_supported(dtype, "dtype")
        self.world = world_size(comm)
        self.max_rows, self.k, self.n, self.pieces = int(max_rows), int(k), int(n), int(pieces)
        self.remote_sums = bool(remote_sums)
        self.shard_rows = -(-self.max_rows // self.world)  # the most rows a rank holds
        w, m, item = self.world, self.shard_rows, self.dtype.itemsize
        kinds = ("rows_read", "sums_read") + tuple(f"{kind}{j}" for kind in ("rows", "sums") for j in range(pieces))
        slabs = 2 if remote_sums else 3  # [W, m, n] each: partial sums received, AG's output, staged sums
        nbytes = (w * m * k + slabs * w * m * n + m * n + w) * item + 2 * len(kinds) * w * 4 + 8 * 256
        self.heap = heap = SymmetricHeap(comm, nbytes, backend=backend, device=device, timeout=timeout)
        self.backend, self.rank, self.timeout = heap.backend, heap.rank, float(timeout)
        self._blas = self._broken = self._last = self._finished = self._failure = self._watchdog = None
        self._lock = threading.Lock()  # a call's queuing, and giving up on it (the watchdog's thread too)
        self._made: list = []
        self._staging: dict = {}  # argument name -> (pointer, bytes): NumPy arguments' device copies
        try:
            from .signals import Signals
            self.gathered = heap.alloc((w, m, k), self.dtype)   # all_gather_matmul: rank s's rows land in [s]
            self.partials = heap.alloc((w, m, n), self.dtype)   # matmul_reduce_scatter: rank s's sums of ours
            # ... and ours of rank d's rows, before the copy (none where the GEMM writes them to the peer)
            self.staged = None if remote_sums else heap.alloc((w, m, n), self.dtype)
            self.ag_out = heap.alloc((w * m, n), self.dtype)    # outputs when no out= is given
            self.rs_out = heap.alloc((m, n), self.dtype)
            self.ones = heap.alloc((w,), self.dtype)
            self.ones.copy_from(np.ones(w, self.dtype))
            self.signals = Signals(heap, kinds, raised_at_start=("rows_read", "sums_read"))
            heap.verify()
            self.stream = self._made_stream()
            # A copy stream a (peer, piece): each piece of our rows to a peer on its own copy engine where the
            # GPU has enough.
            self.copies = [None if p == self.rank else [self._made_stream() for _ in range(self.pieces)]
                           for p in range(w)]
            self.watch = self._made_stream()  # reads words while the others may be stuck
            self._finished = self.backend.event_create()  # recorded after each call (its stream may go first)
            self._watchdog = Watchdog(self.backend, self._finished, self._abandon)
            library_device = None if self.backend.kind == "host" else heap.device.index
            self._streams = Streams(self.backend, self.stream, True, library_device)
            self._boundary = Boundary(self.backend, heap.device.index, self._streams)
            self._views: dict = {}
            bounded_barrier(heap.comm, self.timeout, "CollectiveMatmul setup")
        except BaseException:
            self._release()
            heap.close(wait_for_peers=False)
            raise

    def _made_stream(self):
        stream = self.backend.stream_create()
        self._made.append(stream)
        return stream

    # -- the two operations -----------------------------------------------------------------------
    def all_gather_matmul(self, a_shard, b, out=None, *, gathered=None, gemm=None, stream=None):
        """C [W*m, n] = all_gather(a_shard [m, k]) @ b [k, n]; `gathered` [W*m, k], where given, receives the
        gathered rows. `gemm(a_rows, b, out_rows, stream_handle)` runs the caller's GEMM instead of the vendor's."""
        with self._lock:
            return self._all_gather_matmul(a_shard, b, out, gathered, gemm, stream)

    def matmul_reduce_scatter(self, a, b, out=None, *, gemm=None, stream=None):
        """C_shard [m, n] = rows r*m.. of sum over ranks of (a [W*m, k_r] @ b [k_r, n]), summed in fp32.
        `gemm(a_rows, b, out_rows, stream_handle)` runs the caller's GEMM of the partial sums."""
        with self._lock:
            return self._matmul_reduce_scatter(a, b, out, gemm, stream)

    def _all_gather_matmul(self, a_shard, b, out, gathered, gemm, stream):
        w, r, k, n = self.world, self.rank, self.k, self.n
        s, capturing, m = self._begin("all_gather_matmul", stream, (a_shard, b, out, gathered), a_shard, "a_shard",
                                      k)
        take = self._taker(s, capturing)
        a_ptr = take("a_shard", a_shard, (m, k))
        b_ptr = take("b", b, (k, n))
        out, out_ptr = self._output("out", out, self.ag_out, (w * m, n), take, a_shard, s)
        g_ptr = take("gathered", gathered, (w * m, k)) if gathered is not None else None
        row_out, row_a = n * self.dtype.itemsize, k * self.dtype.itemsize
        # Slots lie the most rows a rank apart: a rank that sent another count overwrites only its own slot.
        slot = self.shard_rows * row_a
        sig, awaited, cuts = self.signals, [], self._cuts(m)
        try:
            for i in range(1, w):  # every copy stream at once: rank r's rows to rank (r + i)'s slot [r]
                p = (r + i) % w
                what = "word that it read our all_gather_matmul rows"
                self._free_slot(p, "rows_read", what, s, awaited)
                for j, (first, count) in enumerate(cuts):
                    copy = self.copies[p][j]
                    self.backend.copy_device(self.heap.translate(self.gathered.ptr + r * slot + first * row_a, p),
                                             a_ptr + first * row_a, count * row_a, copy)
                    sig.raise_on(p, f"rows{j}", copy, count=m)
            for i in range(w):  # own rows first, then rank r - 1's (the first to arrive), r - 2's, ...
                src = (r - i) % w
                for j, (first, count) in enumerate(cuts if src != r else [(0, m)]):
                    rows = a_ptr if src == r else self.gathered.ptr + src * slot + first * row_a
                    if src != r:
                        what = f"all_gather_matmul rows, piece {j} (count: rows a rank)"
                        sig.wait(src, f"rows{j}", s, what, count=m)
                        awaited.append((src, f"rows{j}", m, what))
                    out_row = src * m + first
                    if gemm is None:
                        self._vendor().matmul(s, rows, b_ptr, out_ptr + out_row * row_out, count, n, k, lda=k, ldb=n,
                                              ldc=n, dtype=self.dtype)
                    else:
                        a_rows = a_shard if src == r else self._ours(rows, (count, k), b)
                        gemm(a_rows, b, self._rows(out, out_row, count, out_ptr, n, b), self.backend.stream_handle(s))
                    if g_ptr is not None:
                        self.backend.copy_device(g_ptr + out_row * row_a, rows, count * row_a, s)
                if src != r:
                    sig.raise_on(src, "rows_read", s)
            self._join_copies(s)
        except (A2ATimeoutError, ConfigMismatchError):  # (the host backend's waits are bounded where they run)
            self._fail(s, ((out_ptr, w * m * row_out), (g_ptr, w * m * row_a)))
            raise
        self._end(s, capturing, awaited, ((out_ptr, w * m * row_out), (g_ptr, w * m * row_a)))
        return out

    def _matmul_reduce_scatter(self, a, b, out, gemm, stream):
        w, r, n = self.world, self.rank, self.n
        s, capturing, rows_total = self._begin("matmul_reduce_scatter", stream, (a, b, out), a, "a", None)
        if rows_total % w:
            raise ValueError(f"a has {rows_total} rows: matmul_reduce_scatter needs a multiple of the {w} ranks")
        m, k = rows_total // w, int(a.shape[1])
        take = self._taker(s, capturing)
        a_ptr = take("a", a, (w * m, k))
        b_ptr = take("b", b, (k, n))
        out, out_ptr = self._output("out", out, self.rs_out, (m, n), take, a, s)
        item = self.dtype.itemsize
        slot = self.shard_rows * n * item
        sig, awaited, cuts = self.signals, [], self._cuts(m)
        row_c = n * item
        try:
            for i in range(1, w):  # the sums for rank r + 1 first: it waits for ours first
                d = (r + i) % w
                for j, (first, count) in enumerate(cuts):
                    theirs = self.heap.translate(self.partials.ptr + r * slot + first * row_c, d)
                    if self.remote_sums:  # (the GEMM's own stores cross the link: no staging, no copy)
                        if j == 0:
                            what = "word that it reduced our matmul_reduce_scatter sums"
                            sig.wait(d, "sums_read", s, what)
                            awaited.append((d, "sums_read", 0, what))
                        self._partial(gemm, s, a, a_ptr, d * m + first, count, b, b_ptr, theirs)
                        sig.raise_on(d, f"sums{j}", s, count=m)
                        continue
                    staged = self.staged.ptr + d * slot + first * row_c
                    self._partial(gemm, s, a, a_ptr, d * m + first, count, b, b_ptr, staged)
                    if j == 0:
                        what = "word that it reduced our matmul_reduce_scatter sums"
                        self._free_slot(d, "sums_read", what, s, awaited)
                    else:
                        self.backend.stream_wait_stream(self.copies[d][j], s, within_capture=True)
                    copy = self.copies[d][j]
                    self.backend.copy_device(theirs, staged, count * row_c, copy)
                    sig.raise_on(d, f"sums{j}", copy, count=m)
            self._partial(gemm, s, a, a_ptr, r * m, m, b, b_ptr, self.partials.ptr + r * slot)
            for i in range(1, w):
                src = (r - i) % w
                for j in range(len(cuts)):
                    what = f"matmul_reduce_scatter sums, piece {j} (count: rows a rank)"
                    sig.wait(src, f"sums{j}", s, what, count=m)
                    awaited.append((src, f"sums{j}", m, what))
            # The sum over ranks as one GEMM: [1, W] ones times the [W, m*n] slots (rows shard_rows*n apart),
            # accumulated in fp32 and rounded once.
            self._vendor().matmul(s, self.ones.ptr, self.partials.ptr, out_ptr, 1, m * n, w, lda=w,
                                  ldb=self.shard_rows * n, ldc=m * n, dtype=self.dtype)
            for i in range(1, w):
                sig.raise_on((r - i) % w, "sums_read", s)
            self._join_copies(s)
        except (A2ATimeoutError, ConfigMismatchError):
            self._fail(s, ((out_ptr, m * n * item),))
            raise
        self._end(s, capturing, awaited, ((out_ptr, m * n * item),))
        return out

    # -- one call's steps ---------------------------------------------------------------------------
    def _begin(self, op: str, stream, arrays, lead, name: str, k):
        """(the call's stream, whether another library captures it, the lead array's rows) after the checks every
        call makes before queuing work."""
        if self._failure is not None:
            raise self._reported()
        if self._broken is not None:
            raise A2AError(f"CollectiveMatmul: {op} refused: an earlier call failed ({self._broken}); close() it")
        if self.heap.closed:
            raise A2AError("CollectiveMatmul is closed")
        shape = getattr(lead, "shape", None)
        if shape is None or len(shape) != 2:
            raise TypeError(f"{name} must be a 2-D array, not {type(lead).__name__}"
                            + ("" if shape is None else f" of shape {tuple(shape)}"))
        rows = int(shape[0])
        if k is not None:  # (all_gather_matmul: the lead is the shard)
            if not 1 <= rows <= self.shard_rows:
                raise ValueError(f"{name} has {rows} rows: this CollectiveMatmul takes 1 to {self.shard_rows} a "
                                 f"rank (max_rows={self.max_rows} over {self.world} ranks)")
        elif not self.world <= rows <= self.shard_rows * self.world:
            raise ValueError(f"{name} has {rows} rows: this CollectiveMatmul takes {self.world} to "
                             f"{self.shard_rows * self.world}")
        self.backend.activate()
        streams = self._streams
        if stream is None:
            s = streams.current(arrays)[0]
        else:
            s = streams.given(stream)
        capturing = self._streams.capturable_elsewhere(s) and self.backend.stream_capturing(s)
        if not capturing:
            streams.follow(s)  # after the last call on another stream: our buffers are reused in its order
        return s, capturing, rows

    def _cuts(self, m: int) -> list:
        """(first row, rows) of each piece of a rank's m rows."""
        size = -(-m // self.pieces)
        return [(first, min(size, m - first)) for first in range(0, m, size)]

    def _free_slot(self, peer: int, kind: str, what: str, s, awaited) -> None:
        """Queue the copies to `peer` after what `s` queued so far and after `peer` said its slot of ours is free:
        the first piece's stream waits for the word, the others for that stream."""
        first, *others = self.copies[peer]
        self.backend.stream_wait_stream(first, s, within_capture=True)
        self.signals.wait(peer, kind, first, what)
        awaited.append((peer, kind, 0, what))
        for copy in others:
            self.backend.stream_wait_stream(copy, first, within_capture=True)

    def _join_copies(self, s) -> None:
        """The call's stream waits for every copy stream: it covers all the call did (and reuses its buffers)."""
        for copies in self.copies:
            for copy in copies or ():
                self.backend.stream_wait_stream(s, copy, within_capture=True)

    def _taker(self, s, capturing: bool):
        keep = []

        def take(name, obj, shape):
            stage = self._stage(name, obj) if isinstance(obj, np.ndarray) and not capturing else None
            taken = self._boundary.take(name, obj, shape, self.dtype, s, capturing=capturing, stage_ptr=stage)
            keep.append(taken.keep)
            return taken.ptr
        return take

    def _stage(self, name: str, host: np.ndarray) -> int:
        """Device memory a NumPy argument `name` is copied to (made at its first use, grown as needed)."""
        ptr, nbytes = self._staging.get(name, (None, 0))
        if nbytes < host.nbytes:
            if ptr is not None:
                self.backend.free(ptr)
                del self._staging[name]
            ptr, nbytes = self.backend.malloc_ipc(max(host.nbytes, 1)), max(host.nbytes, 1)
            self._staging[name] = (ptr, nbytes)
        return ptr

    def _output(self, name, given, ours, shape, take, like, s):
        """(the array the call returns, its pointer): `given` (out=), else our buffer's first rows (valid until
        the next call of the operation), as an array of the library of `like` where it has one."""
        if given is not None:
            return given, take(name, given, shape)
        probe = producers.stream_source(like)
        if probe is not None and probe.lasting_views:
            return self._ours(ours.ptr, shape, like), ours.ptr
        return DeviceArray(self.backend, ours.ptr, shape, self.dtype, owner=self.heap, stream=s), ours.ptr

    def _vendor(self):
        if self._blas is None:
            self._blas = self.backend.open_blas()
        return self._blas

    def _partial(self, gemm, s, a, a_ptr, first: int, m: int, b, b_ptr, c_ptr) -> None:
        """[m, n] at c_ptr = rows first.. of a, times b: the vendor's GEMM, or the caller's."""
        k, n = int(a.shape[1]), self.n
        rows = a_ptr + first * k * self.dtype.itemsize
        if gemm is None:
            self._vendor().matmul(s, rows, b_ptr, c_ptr, m, n, k, lda=k, ldb=n, ldc=n, dtype=self.dtype)
        else:
            gemm(self._rows(a, first, m, a_ptr, k, b), b, self._ours(c_ptr, (m, n), b), self.backend.stream_handle(s))

    def _rows(self, obj, first: int, count: int, ptr: int, cols: int, like):
        """Rows first..first+count of the caller's array `obj` (at ptr, `cols` wide) for the caller's GEMM: its
        own slice where it has one, else a view of ours."""
        if type(obj) is not DeviceArray and hasattr(obj, "__getitem__"):
            return obj[first:first + count]
        return self._ours(ptr + first * cols * self.dtype.itemsize, (count, cols), like)

    def _ours(self, ptr: int, shape, like):
        """Our memory at `ptr` as an array of the library of `like` (made once and kept: an import costs more
        than a call's host work), else as a DeviceArray."""
        probe = producers.stream_source(like)
        key = (ptr, shape, probe)
        view = self._views.get(key)
        if view is None:
            view = DeviceArray(self.backend, ptr, shape, self.dtype, owner=self.heap)
            if probe is not None and probe.lasting_views:
                view = probe.export(view)
            if len(self._views) >= VIEWS_KEPT:
                self._views.clear()
            self._views[key] = view
        return view

    def _end(self, s, capturing: bool, awaited, outputs) -> None:
        if capturing:
            return  # (nothing ran: a replay of the graph is the graph's caller's to wait for)
        self._streams.queued(s)
        self.backend.event_record(self._finished, s)
        self._last = (s, awaited, outputs)
        self._watchdog.arm(time.monotonic() + self.timeout)

    def _fail(self, s, outputs) -> None:
        """A call that timed out: its outputs read as poison (NaN), and the object refuses later calls."""
        for ptr, nbytes in outputs:
            if ptr is not None:
                self.backend.memset(ptr, 0xFF, nbytes, s)
        self.backend.event_record(self._finished, s)
        self._broken = "a peer never came, or disagreed"

    # -- host waits -------------------------------------------------------------------------------
    def synchronize(self, stream=None) -> None:
        """Wait for this rank's last call (or for `stream`), at most `timeout` seconds. A call not done by then
        (here, or by the watchdog's count when no one waits) is given up on: its ranks never heard from are
        named (A2ATimeoutError; ConfigMismatchError for a rank that sent another row count), its stuck waits
        released so the streams drain, its outputs poisoned (NaN), and the object refuses later calls."""
        if self._failure is not None:
            raise self._reported()
        if self._last is None and stream is None:
            return
        self.backend.activate()
        if stream is None:
            done = functools.partial(self.backend.event_done, self._finished)
        else:
            done = functools.partial(self.backend.stream_done, self._streams.given(stream))
        deadline, pause = time.monotonic() + self.timeout, 1e-5
        while not done():
            if time.monotonic() > deadline:
                self._abandon()
                if self._failure is not None:
                    raise self._reported()
                if not done():  # (a stream of the caller's, busy with more than our call)
                    raise A2ATimeoutError(f"CollectiveMatmul: the stream did not finish in {self.timeout:g} s")
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
        if stream is None:
            with self._lock:
                self._last = None
                self._watchdog.disarm()
        if self._failure is not None:  # (given up on by the watchdog meanwhile)
            raise self._reported()

    def _abandon(self) -> None:
        """Give up on the last call, if it is still pending (synchronize past its timeout, or the watchdog):
        keep the error for the caller, release the stuck waits, poison the outputs, let the streams drain."""
        with self._lock:
            if self._last is None or self.backend.event_done(self._finished):
                return
            s, awaited, outputs = self._last
            self._last = None
            stuck = self.signals.not_seen(awaited, self.watch)
            self._failure = self.signals.stuck_error(stuck, self.watch) if stuck else A2ATimeoutError(
                f"CollectiveMatmul: rank {self.rank}'s last call did not finish in {self.timeout:g} s, though every "
                "rank's words came")
            self.signals.force(stuck, self.watch)
            self._fail(s, outputs)
        deadline = time.monotonic() + self.timeout  # (released, the stream drains; then the poison is in place)
        while not self.backend.event_done(self._finished) and time.monotonic() < deadline:
            time.sleep(1e-4)

    def _reported(self) -> BaseException:
        """The kept failure, handed to the caller once (later calls are refused as broken)."""
        failure, self._failure = self._failure, None
        return failure

    # -- teardown ---------------------------------------------------------------------------------------
    def _release(self) -> None:
        if self._watchdog is not None:
            self._watchdog.close()
            self._watchdog = None
        if self._blas is not None:
            self._blas.close()
            self._blas = None
        for stream in self._made:
            self.backend.stream_destroy(stream)
        if self._finished is not None:
            self.backend.event_destroy(self._finished)
            self._finished = None
        for ptr, _ in self._staging.values():
            self.backend.free(ptr)
        self._made, self._staging = [], {}

    def close(self) -> None:
        """Idempotent; waits (bounded) for this rank's calls and for peers before unmapping the heap."""
        if self.heap.closed:
            return
        try:
            if self._broken is None:
                self.synchronize()
        finally:
            self._release()
            self.heap.close(wait_for_peers=self._broken is None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
