"""CollectiveMatmul: tensor parallelism's all-gather + GEMM and GEMM + reduce-scatter, the exchange hidden behind
the GEMMs chunk by chunk.

    with CollectiveMatmul(comm, max_rows=M, k=K, n=N, dtype="bfloat16") as cm:
        c = cm.all_gather_matmul(a_shard, b)        # a_shard [M/W, K], b [K, N] -> c [M, N]
        c_shard = cm.matmul_reduce_scatter(a, b)    # a [M, K/W], b [K/W, N] -> c_shard [M/W, N]

How a call runs (docs/COLLECTIVE.md has the picture): the caller's stream runs the GEMMs, one chunk of rows a
rank (or a piece of one); a copy stream for each peer (and piece) moves rows between heaps with the copy engine
and raises a readiness word in the peer's heap (pyhipa2a.signals); the GEMM of a chunk waits for its word on
the device. Chunks go in ring order: all_gather_matmul starts on its own rows while the others arrive (rank
r - 1's first); matmul_reduce_scatter starts on the rows for rank r + 1, so its own partial sums are computed
last, behind the copies of the others. The call's stream waits for the copy streams before the call returns,
so it covers everything the call does. A call that comes back with the same pointers and row counts is
launched as one graph recorded from the first ones (pyhipa2a.replays): one driver call instead of twenty;
one that also repeats the last call's argument objects runs as its plan (pyhipa2a.repeat), checks and launch.
"""
from __future__ import annotations

import functools
import threading
import weakref

from .bootstrap import bounded_barrier, world_size
from .collective_arrays import CallerArrays
from .dtypes import check_supported
from .errors import A2AError
from .runtime.base import RuntimeFailure
from .heap import SymmetricHeap
from .inflight import InFlight
from .kernels import KernelLibrary
from .repeat import MISSED, Record, plan_or_none, run
from .replays import Replays
from .signals import Signals
from .streams import Streams

SUM_THREADS, SUM_BLOCKS_PER_SM = 256, 4  # the sum's geometry: enough loads in flight to be bound by bytes


class SlotSum:
    """The reduce-scatter's last step (kernels_hip/reduce.hip): n slots of 16-bit partial sums added in fp32,
    rounded once; its code and arguments made once."""

    def __init__(self, backend, device, dtype):
        self._library = KernelLibrary(backend, device.arch)
        self._kernel = self._library.kernel("sum_slots_" + ("bf16" if dtype.name == "bfloat16" else "f16"))
        self._pack = self._kernel.pack()
        self._blocks = SUM_BLOCKS_PER_SM * device.multiprocessors

    def launch(self, s, slots: int, out: int, count: int, stride: int, n: int) -> None:
        """out[count] = the sum of the n slots at `slots`, `stride` elements apart, on stream `s`."""
        self._pack.set_scalars(slots, out, count, stride, n)
        self._kernel.launch(self._pack, self._blocks, SUM_THREADS, s)

    def close(self) -> None:
        self._library.close()


def lead_rows(lead, name: str, least: int, most: int, per: str) -> int:
    """The rows of a call's first array, a 2-D one of `least` to `most` rows (else a clear error)."""
    shape = getattr(lead, "shape", None)
    if shape is None or len(shape) != 2:
        raise TypeError(f"{name} must be a 2-D array, not {type(lead).__name__}"
                        + ("" if shape is None else f" of shape {tuple(shape)}"))
    rows = int(shape[0])
    if not least <= rows <= most:
        raise ValueError(f"{name} has {rows} rows: this CollectiveMatmul takes {least} to {most}{per}")
    return rows


def failure(e: BaseException) -> str:
    """Why a call that raised `e` once its words were touched leaves the object refusing calls."""
    return f"{type(e).__name__}: {e}"


def cut_rows(m: int, pieces: int) -> list:
    """(first row, rows) of each piece of a rank's m rows (fewer pieces where m is smaller)."""
    size = -(-m // pieces)
    return [(first, min(size, m - first)) for first in range(0, m, size)]


class CopyStreams:
    """A copy stream for each (peer, piece): each piece of our rows goes to a peer on its own copy engine, where
    the GPU has enough of them."""

    def __init__(self, backend, signals, world: int, rank: int, pieces: int, make_stream):
        self.backend, self.signals = backend, signals
        self.to = [None if p == rank else [make_stream() for _ in range(pieces)] for p in range(world)]
        self._used: list = []  # the streams this call gave work (a capture may join no other)

    def follow(self, copy, producer) -> None:
        """`copy` waits for what `producer` (the call's stream, or another copy stream) queued so far."""
        self.backend.stream_wait_stream(copy, producer, within_capture=True)
        self._used.append(copy)

    def fork(self, s, peer: int | None = None) -> None:
        """The first piece's copy stream to `peer` (to every peer: None) waits for what `s` queued so far."""
        for p in range(len(self.to)) if peer is None else (peer,):
            if self.to[p] is not None:
                self.follow(self.to[p][0], s)

    def after_free_slot(self, peer: int, kind: str, what: str, awaited) -> None:
        """Queue the copies to `peer` (forked already) after `peer` raised `kind` (its slot of ours is free): the
        first piece's stream waits for the word, the others for that stream."""
        first, *others = self.to[peer]
        self.signals.wait(peer, kind, first, what)
        awaited.append((peer, kind, 0, what))
        for copy in others:
            self.follow(copy, first)

    def join(self, s) -> None:
        """`s` waits for every copy stream the call used: the call's stream covers all the call did (and reuses
        its buffers)."""
        used, self._used = self._used, []
        for copy in dict.fromkeys(used):
            self.backend.stream_wait_stream(s, copy, within_capture=True)


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
        # Each piece's word (its kind, and what its timeout message calls it), named once
        self._rows_words = tuple((f"rows{j}", f"all_gather_matmul rows, piece {j} (count: rows a rank)")
                                 for j in range(pieces))
        self._sums_words = tuple((f"sums{j}", f"matmul_reduce_scatter sums, piece {j} (count: rows a rank)")
                                 for j in range(pieces))
        kinds = ("rows_read", "sums_read") + tuple(kind for kind, _ in self._rows_words + self._sums_words)
        slabs = 2 if remote_sums else 3  # [W, m, n] each: partial sums received, AG's output, staged sums
        nbytes = (w * m * k + slabs * w * m * n + m * n) * item + 2 * len(kinds) * w * 4 + 8 * 256
        self.heap = heap = SymmetricHeap(comm, nbytes, backend=backend, device=device, timeout=timeout)
        self.backend, self.rank, self.timeout = heap.backend, heap.rank, float(timeout)
        self._blas = self._flight = self._sum = self._joined = self._replays = None
        # A call's queuing, and giving up on calls (the watchdog's thread too); re-entered where a call waits for
        # the ones before it (a NumPy argument's copy) and gives up on them.
        self._lock = threading.RLock()
        self._made: list = []
        self._arrays = None
        # Each operation's last call (pyhipa2a.repeat's Record) and, once a replayed call repeats it with the
        # same arguments, its plan with the key of the graph it launches
        self._records: dict = {}
        self._plans: dict = {}
        try:
            self.gathered = heap.alloc((w, m, k), self.dtype)   # all_gather_matmul: rank s's rows land in [s]
            self.partials = heap.alloc((w, m, n), self.dtype)   # matmul_reduce_scatter: rank s's sums of ours
            # ... and ours of rank d's rows, before the copy (none where the GEMM writes them to the peer)
            self.staged = None if remote_sums else heap.alloc((w, m, n), self.dtype)
            self.ag_out = heap.alloc((w * m, n), self.dtype)    # outputs when no out= is given
            self.rs_out = heap.alloc((m, n), self.dtype)
            self.signals = Signals(heap, kinds, raised_at_start=("rows_read", "sums_read"))
            heap.verify()
            self.stream = self._made_stream()
            self.copies = CopyStreams(self.backend, self.signals, w, self.rank, self.pieces, self._made_stream)
            self.watch = self._made_stream()  # reads words while the others may be stuck
            self._replays = Replays(self.backend, self._made_stream())
            self._flight = InFlight(self.backend, self.signals, self.watch, self.timeout, self._lock)
            # (stopped at exit too, while the runtime still answers: a watchdog polling a call of an object never
            # closed would otherwise ask the driver as the process tears it down)
            self._stop_flight = weakref.finalize(self, self._flight.close)
            library_device = None if self.backend.kind == "host" else heap.device.index
            self._streams = Streams(self.backend, self.stream, True, library_device)
            self._arrays = CallerArrays(self.backend, heap, self.dtype, self._streams, lambda: self._flight.wait())
            self._sum = SlotSum(self.backend, heap.device, self.dtype)
            try:  # (now, not at a first GEMM that a capture records: making it allocates)
                self._blas = self.backend.open_blas()
            except RuntimeFailure as e:
                self._blas = e
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
            entry = self._plans.get("all_gather_matmul")
            if entry is not None:
                result = run(entry[0], a_shard, b, out, gathered, gemm, stream)
                if result is not MISSED:
                    return result
            try:
                return self._all_gather_matmul(a_shard, b, out, gathered, gemm, stream)
            finally:
                self._leave_capture()

    def matmul_reduce_scatter(self, a, b, out=None, *, gemm=None, stream=None):
        """C_shard [m, n] = rows r*m.. of sum over ranks of (a [W*m, k_r] @ b [k_r, n]), summed in fp32.
        `gemm(a_rows, b, out_rows, stream_handle)` runs the caller's GEMM of the partial sums."""
        with self._lock:
            entry = self._plans.get("matmul_reduce_scatter")
            if entry is not None:
                result = run(entry[0], a, b, out, gemm, stream)
                if result is not MISSED:
                    return result
            try:
                return self._matmul_reduce_scatter(a, b, out, gemm, stream)
            finally:
                self._leave_capture()

    def _all_gather_matmul(self, a_shard, b, out, gathered, gemm, stream):
        w, r, k, n = self.world, self.rank, self.k, self.n
        inputs = (a_shard, b, out, gathered)
        s, lead, capturing, m = self._begin("all_gather_matmul", stream, inputs, a_shard, "a_shard", shard=True)
        arrays: list = []
        take = self._arrays.taker(s, capturing, arrays)
        a_ptr = take("a_shard", a_shard, (m, k))
        b_ptr = take("b", b, (k, n))
        out, out_ptr = self._arrays.output(take, "out", out, self.ag_out, (w * m, n), a_shard, s)
        g_ptr = take("gathered", gathered, (w * m, k)) if gathered is not None else None
        row_out, row_a = n * self.dtype.itemsize, k * self.dtype.itemsize
        # Slots lie the most rows a rank apart: a rank that sent another count overwrites only its own slot.
        slot = self.shard_rows * row_a
        sig, cuts = self.signals, cut_rows(m, self.pieces)

        def multiply(s, src: int, first: int, count: int, rows: int) -> None:
            out_row = src * m + first
            if gemm is None:
                self._vendor().matmul(s, rows, b_ptr, out_ptr + out_row * row_out, count, n, k, lda=k, ldb=n, ldc=n,
                                      dtype=self.dtype)
            else:
                a_rows = a_shard if src == r else self._arrays.ours(rows, (count, k), b)
                gemm(a_rows, b, self._arrays.rows(out, out_row, count, out_ptr, n, b), self.backend.stream_handle(s))
            if g_ptr is not None:
                self.backend.copy_device(g_ptr + out_row * row_a, rows, count * row_a, s)

        def queue(s) -> list:
            """Queue the call on `s`; the waits it queued ((source, kind, count, what) each)."""
            awaited = []
            try:
                # The copies leave once a_shard is ready (forked before anything else is queued on s), and the
                # GPU starts on our own rows while the host queues the rest.
                self.copies.fork(s)
                multiply(s, r, 0, m, a_ptr)
                for i in range(1, w):  # every copy stream at once: rank r's rows to rank (r + i)'s slot [r]
                    p = (r + i) % w
                    what = "word that it read our all_gather_matmul rows"
                    self.copies.after_free_slot(p, "rows_read", what, awaited)
                    for j, (first, count) in enumerate(cuts):
                        copy = self.copies.to[p][j]
                        self.backend.copy_device(self.heap.translate(self.gathered.ptr + r * slot + first * row_a, p),
                                                 a_ptr + first * row_a, count * row_a, copy)
                        sig.raise_on(p, self._rows_words[j][0], copy, count=m)
                for i in range(1, w):  # rank r - 1's rows (the first to arrive), then r - 2's, ...
                    src = (r - i) % w
                    for j, (first, count) in enumerate(cuts):
                        kind, what = self._rows_words[j]
                        sig.wait(src, kind, s, what, count=m)
                        awaited.append((src, kind, m, what))
                        multiply(s, src, first, count, self.gathered.ptr + src * slot + first * row_a)
                    sig.raise_on(src, "rows_read", s)
            finally:
                self.copies.join(s)
            return awaited
        outputs = ((out_ptr, w * m * row_out), (g_ptr, w * m * row_a))
        key = None if gemm is not None else ("all_gather_matmul", m, a_ptr, b_ptr, out_ptr, g_ptr)
        awaited = self._queue(s, capturing, key, queue, outputs)
        if not capturing:
            self._remember(key, s, lead, inputs + (gemm, stream), inputs, arrays, m, out, awaited, outputs)
        return out

    def _matmul_reduce_scatter(self, a, b, out, gemm, stream):
        w, r, n = self.world, self.rank, self.n
        inputs = (a, b, out)
        s, lead, capturing, rows_total = self._begin("matmul_reduce_scatter", stream, inputs, a, "a", shard=False)
        if rows_total % w:
            raise ValueError(f"a has {rows_total} rows: matmul_reduce_scatter needs a multiple of the {w} ranks")
        m, k = rows_total // w, int(a.shape[1])
        arrays: list = []
        take = self._arrays.taker(s, capturing, arrays)
        a_ptr = take("a", a, (w * m, k))
        b_ptr = take("b", b, (k, n))
        out, out_ptr = self._arrays.output(take, "out", out, self.rs_out, (m, n), a, s)
        item = self.dtype.itemsize
        slot = self.shard_rows * n * item
        sig, cuts = self.signals, cut_rows(m, self.pieces)
        row_c = n * item

        def queue(s) -> list:
            """Queue the call on `s`; the waits it queued ((source, kind, count, what) each)."""
            awaited = []
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
                            sig.raise_on(d, self._sums_words[j][0], s, count=m)
                            continue
                        staged = self.staged.ptr + d * slot + first * row_c
                        self._partial(gemm, s, a, a_ptr, d * m + first, count, b, b_ptr, staged)
                        if j == 0:
                            what = "word that it reduced our matmul_reduce_scatter sums"
                            self.copies.fork(s, d)
                            self.copies.after_free_slot(d, "sums_read", what, awaited)
                        else:
                            self.copies.follow(self.copies.to[d][j], s)
                        copy = self.copies.to[d][j]
                        self.backend.copy_device(theirs, staged, count * row_c, copy)
                        sig.raise_on(d, self._sums_words[j][0], copy, count=m)
                self._partial(gemm, s, a, a_ptr, r * m, m, b, b_ptr, self.partials.ptr + r * slot)
                for i in range(1, w):
                    src = (r - i) % w
                    for kind, what in self._sums_words[:len(cuts)]:
                        sig.wait(src, kind, s, what, count=m)
                        awaited.append((src, kind, m, what))
                self._sum.launch(s, self.partials.ptr, out_ptr, m * n, self.shard_rows * n, w)
                for i in range(1, w):
                    sig.raise_on((r - i) % w, "sums_read", s)
            finally:
                self.copies.join(s)
            return awaited
        key = None if gemm is not None else ("matmul_reduce_scatter", m, k, a_ptr, b_ptr, out_ptr)
        outputs = ((out_ptr, m * n * item),)
        awaited = self._queue(s, capturing, key, queue, outputs)
        if not capturing:
            self._remember(key, s, lead, inputs + (gemm, stream), inputs, arrays, m, out, awaited, outputs)
        return out

    # -- one call's steps ---------------------------------------------------------------------------
    def _begin(self, op: str, stream, arrays, first, name: str, shard: bool):
        """(the call's stream, how it was chosen (pyhipa2a.streams), whether another library captures it, the
        rows of `first`, the call's first array) after the checks every call makes before queuing work;
        `shard`: `first` holds one rank's rows (else all ranks'). The operation's plan is dropped: a call that
        fails leaves none."""
        self._plans.pop(op, None)
        if self.heap.closed:
            raise A2AError("CollectiveMatmul is closed")
        self._flight.refuse_if_failed(op)
        if shard:
            rows = lead_rows(first, name, 1, self.shard_rows,
                             f" a rank (max_rows={self.max_rows} over {self.world} ranks)")
        else:
            rows = lead_rows(first, name, self.world, self.shard_rows * self.world, "")
        self.backend.activate()
        streams = self._streams
        s, lead = streams.current(arrays) if stream is None else (streams.given(stream), None)
        capturing = streams.capturable_elsewhere(s) and self.backend.stream_capturing(s)
        if capturing:  # (another library's capture: our launches on s join it as nodes of their own)
            self.backend.capture_join(s)
            self._joined = s
        else:
            streams.follow(s)  # after the last call on another stream: our buffers are reused in its order
        return s, lead, capturing, rows

    def _leave_capture(self) -> None:
        if self._joined is not None:
            self.backend.capture_leave(self._joined)
            self._joined = None

    def _vendor(self):
        if isinstance(self._blas, Exception):  # (a caller with gemm= of their own may never need it)
            raise RuntimeFailure(f"the vendor's GEMM is unavailable: {self._blas}") from self._blas
        return self._blas

    def _partial(self, gemm, s, a, a_ptr, first: int, m: int, b, b_ptr, c_ptr) -> None:
        """[m, n] at c_ptr = rows first.. of a, times b: the vendor's GEMM, or the caller's."""
        k, n = int(a.shape[1]), self.n
        rows = a_ptr + first * k * self.dtype.itemsize
        if gemm is None:
            self._vendor().matmul(s, rows, b_ptr, c_ptr, m, n, k, lda=k, ldb=n, ldc=n, dtype=self.dtype)
        else:
            arrays = self._arrays
            gemm(arrays.rows(a, first, m, a_ptr, k, b), b, arrays.ours(c_ptr, (m, n), b), self.backend.stream_handle(s))

    def _queue(self, s, capturing: bool, key, queue, outputs) -> list:
        """Queue a call on `s` with `queue(stream) -> its waits` (or replay it: pyhipa2a.replays; never into
        another library's capture) and note it in flight; `outputs`: the (pointer, bytes) it writes, poisoned
        if it fails once its words were touched. Its waits ((source, kind, count, what) each)."""
        try:
            awaited = queue(s) if capturing else self._replays.queue(key, s, queue)
        except BaseException as e:  # (a timeout where the host backend waits, or anything once words were touched)
            self._flight.failed(s, outputs, failure(e))
            raise
        for op, (_, held) in list(self._plans.items()):  # (a recording may have dropped another plan's graph)
            if not self._replays.holds(held):
                del self._plans[op]
        if not capturing:  # (else nothing ran: a replay of the graph is the graph's caller's to wait for)
            self._streams.queued(s)
            self._flight.queued(s, awaited, outputs)
        return awaited

    def _remember(self, key, s, lead, args: tuple, inputs: tuple, arrays: list, rows: int, result, awaited,
                  outputs) -> None:
        """Note the call just queued on `s` (key None: one never replayed); where it was replayed and repeats
        its operation's last call with the same arguments, make its plan (pyhipa2a.repeat): the checks that
        must still hold, then the graph's launch, in one step. A plan only speeds repeats up: one that cannot
        be made warns and never fails the call."""
        if key is None:
            return
        op = key[0]
        record = Record(args, (None,) * len(args), s, lead, inputs, tuple(arrays), rows, result,
                        (functools.partial(self._flight.queued, s, awaited, outputs),), ((self._streams, "last", s),))
        last, self._records[op] = self._records.get(op), record
        if not (self._replays.holds(key) and record.same(last)):
            return

        def launch(stream) -> None:
            try:
                self._replays.launch(key, stream)
            except BaseException as e:
                self._flight.failed(stream, outputs, failure(e))
                raise

        conditions = ((self.heap, "closed", False), (self._flight, "broken", None), (self._flight, "unreported", None))
        plan = plan_or_none(record, conditions, self._streams, self.backend, 0, launch,
                            lambda: self._plans.pop(op, None))
        if plan is not None:
            self._plans[op] = (plan, key)

    def synchronize(self, stream=None) -> None:
        """Wait for this rank's last call (or for `stream`), at most `timeout` seconds. A call not done by then
        (here, or by the watchdog's count when no one waits) is given up on: its ranks never heard from are
        named (A2ATimeoutError; ConfigMismatchError for a rank that sent another row count), its stuck waits
        released so the streams drain, its outputs poisoned (NaN), and the object refuses later calls."""
        if self.heap.closed:
            raise A2AError("CollectiveMatmul is closed")
        self.backend.activate()
        self._flight.wait(None if stream is None else self._streams.given(stream))

    # -- teardown ---------------------------------------------------------------------------------------
    def _release(self) -> None:
        self._plans, self._records = {}, {}
        if self._replays is not None:
            self._replays.close()
            self._replays = None
        if self._flight is not None:
            self._stop_flight()
            self._flight = None
        if self._blas is not None and not isinstance(self._blas, Exception):
            self._blas.close()
        self._blas = None
        for stream in self._made:
            self.backend.stream_destroy(stream)
        if self._arrays is not None:
            self._arrays.close()
        if self._sum is not None:
            self._sum.close()
            self._sum = None
        self._made = []

    def close(self) -> None:
        """Idempotent; waits (bounded) for this rank's calls and for peers before unmapping the heap."""
        if self.heap.closed:
            return
        try:
            if self._flight.broken is None:
                self.synchronize()
        finally:
            broken = self._flight.broken is not None
            self._release()
            self.heap.close(wait_for_peers=not broken)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
