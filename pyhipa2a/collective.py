"""CollectiveMatmul: tensor parallelism's all-gather + GEMM and GEMM + reduce-scatter, the exchange hidden behind
the GEMMs chunk by chunk.

    with CollectiveMatmul(comm, max_rows=M, k=K, n=N, dtype="bfloat16") as cm:
        c = cm.all_gather_matmul(a_shard, b)        # a_shard [M/W, K], b [K, N] -> c [M, N]
        c_shard = cm.matmul_reduce_scatter(a, b)    # a [M, K/W], b [K/W, N] -> c_shard [M/W, N]

This object makes what the calls share (the heap's buffers, readiness words, streams, the vendor's BLAS) and
hands each call to its operation (pyhipa2a.collective_ops: the work a call queues, in ring order;
pyhipa2a.collective_call: the path a call takes). A call that comes back with the same pointers and row counts
is launched as one graph recorded from the first ones (pyhipa2a.replays): one driver call instead of twenty;
one that also repeats the last call's argument objects runs as its plan (pyhipa2a.repeat), checks and launch.
"""
from __future__ import annotations

import inspect
import threading
import weakref

from .arguments import checked_bool, checked_int, checked_timeout
from .bootstrap import agreed, bounded_barrier, mpi, world_size
from .collective_arrays import CallerArrays
from .collective_call import Shared
from .collective_ops import AllGatherMatmul, CopyStreams, MatmulReduceScatter
from .dtypes import check_supported
from .errors import A2AError, RuntimeFailure
from .heap import SymmetricHeap
from .inflight import InFlight
from .replays import Replays
from .signals import Signals
from .streams import Streams


class CollectiveMatmul:
    """Heap buffers for one (max_rows, k, n, dtype), made once; every rank makes the same calls in order.
    `pieces`: each rank's rows move in this many pieces, each on its own copy stream and awaited by its own word.
    `remote_sums`: matmul_reduce_scatter's GEMMs write a peer's partial sums straight into its heap, across the
    link, instead of into ours for a copy engine to move."""

    def __init__(self, comm=None, *, max_rows: int, k: int, n: int, dtype="bfloat16", pieces: int = 1,
                 remote_sums: bool = False, backend=None, device: int | None = None, timeout: float = 60.0):
        def checked():
            return ({name: checked_int(name, value, least=1) for name, value in
                     (("max_rows", max_rows), ("k", k), ("n", n), ("pieces", pieces))},
                    check_supported(dtype, "dtype"), checked_bool("remote_sums", remote_sums), checked_timeout(timeout))
        # (before anything collective: a rank that refuses its arguments tells the others, who raise too)
        sizes, self.dtype, self.remote_sums, *_ = agreed(mpi().COMM_WORLD if comm is None else comm,
                                                         "CollectiveMatmul()", checked)
        self.world = world_size(comm)
        self.max_rows, self.k, self.n, self.pieces = sizes.values()
        self.shard_rows = -(-self.max_rows // self.world)  # the most rows a rank holds
        w, m, item = self.world, self.shard_rows, self.dtype.itemsize
        kinds = AllGatherMatmul.kinds(self.pieces) + MatmulReduceScatter.kinds(self.pieces)
        # [W, m, k] rows gathered; [W, m, n] sums received, and staged where the copy engine moves them; outputs
        slabs = 1 if remote_sums else 2
        nbytes = (w * m * k + slabs * w * m * n + (w + 1) * m * n) * item + len(kinds) * w * 4 + 8 * 256
        self.heap = heap = SymmetricHeap(comm, nbytes, backend=backend, device=device, timeout=timeout)
        self.backend, self.rank, self.timeout = heap.backend, heap.rank, heap.timeout  # (the heap checked it)
        self._flight = self._blas = self._replays = self._arrays = self._gather = self._scatter = self._signals = None
        self._gemm_checked = None  # the last gemm= that _check_gemm passed
        # A call's queuing, and giving up on calls (the watchdog's thread too); re-entered where a call waits for
        # the ones before it (a NumPy argument's copy) and gives up on them.
        self._lock = threading.RLock()
        self._made: list = []
        try:
            refused = self.backend.stream_waits_refused()  # (every GEMM waits for its rows' readiness word)
            if refused:
                raise A2AError(f"CollectiveMatmul: {refused}")
            self._signals = signals = Signals(heap, kinds,
                                              raised_at_start=(AllGatherMatmul.FREED, MatmulReduceScatter.FREED))
            self.stream = self._made_stream()
            watch = self._made_stream()  # reads words while the others may be stuck
            self._replays = Replays(self.backend, self._made_stream())
            self._flight = InFlight(self.backend, signals, watch, self.timeout, self._lock)
            # (stopped at exit too, while the runtime still answers: a watchdog polling a call of an object never
            # closed would otherwise ask the driver as the process tears it down)
            self._stop_flight = weakref.finalize(self, self._flight.close)
            streams = Streams(self.backend, self.stream, True,
                              None if self.backend.kind == "host" else heap.device.index)
            self._arrays = CallerArrays(self.backend, heap, self.dtype, streams, lambda: self._flight.wait())
            try:  # (now, not at a first GEMM that a capture records: making it allocates)
                self._blas = self.backend.open_blas()
            except RuntimeFailure as e:
                self._blas = e
            copies = CopyStreams(self.backend, signals, w, self.rank, self.pieces, self._made_stream)
            shared = Shared(backend=self.backend, heap=heap, signals=signals, streams=streams, arrays=self._arrays,
                            flight=self._flight, replays=self._replays, copies=copies, blas=self._blas, world=w,
                            rank=self.rank, max_rows=self.max_rows, shard_rows=m, k=self.k, n=self.n, dtype=self.dtype,
                            pieces=self.pieces)
            self._streams = streams
            self._gather = AllGatherMatmul(shared)
            self._scatter = MatmulReduceScatter(shared, self.remote_sums)
            # (every rank made its parts, else a timeout here; then the collective check, which must not wait on
            # a rank that failed before it)
            bounded_barrier(heap.comm, self.timeout, "CollectiveMatmul setup")
            heap.verify()
        except BaseException:
            self._release()
            heap.close(wait_for_peers=False)
            raise

    def _made_stream(self):
        stream = self.backend.stream_create()
        self._made.append(stream)
        return stream

    def all_gather_matmul(self, a_shard, b, out=None, *, gathered=None, gemm=None, stream=None):
        """C [W*m, n] = all_gather(a_shard [m, k]) @ b [k, n]; `gathered` [W*m, k], where given, receives the
        gathered rows. `gemm(a_rows, b, out_rows, stream_handle)` runs the caller's GEMM instead of the vendor's."""
        self._check_gemm(gemm)
        with self._lock:
            return self._gather(a_shard, b, out, gathered, gemm, stream)

    def matmul_reduce_scatter(self, a, b, out=None, *, gemm=None, stream=None):
        """C_shard [m, n] = rows r*m.. of sum over ranks of (a [W*m, k_r] @ b [k_r, n]), summed in fp32.
        `gemm(a_rows, b, out_rows, stream_handle)` runs the caller's GEMM of the partial sums."""
        self._check_gemm(gemm)
        with self._lock:
            return self._scatter(a, b, out, gemm, stream)

    def _check_gemm(self, gemm) -> None:
        """gemm=: a function of four arguments (a_rows, b, out_rows, stream), refused before the call touches
        anything (a call that queued part of its work before the GEMM raised would leave the object unusable);
        its signature is read once a function (a loop passes the same one)."""
        if gemm is None or gemm is self._gemm_checked:
            return
        if not callable(gemm):
            raise TypeError(f"gemm must be None or a function gemm(a_rows, b, out_rows, stream), not "
                            f"{type(gemm).__name__}")
        try:
            inspect.signature(gemm).bind(None, None, None, None)
        except TypeError as error:
            raise TypeError(f"gemm must take four arguments (a_rows, b, out_rows, stream): {error}") from None
        except ValueError:
            pass  # (a callable whose signature Python cannot read: taken as it is)
        self._gemm_checked = gemm

    def synchronize(self, stream=None) -> None:
        """Wait for this rank's last call (or for `stream`), at most `timeout` seconds. A call not done by then
        (here, or by the watchdog's count when no one waits) is given up on: its ranks never heard from are
        named (A2ATimeoutError; ConfigMismatchError for a rank that sent another row count), its stuck waits
        released so the streams drain, its outputs poisoned (NaN), and the object refuses later calls."""
        if self.heap.closed:
            raise A2AError("CollectiveMatmul is closed")
        self.backend.activate()
        self._flight.wait(None if stream is None else self._streams.given(stream))

    def _release(self, broken: bool = False) -> None:
        """Frees what the object made; `broken`: a call was given up on, and its streams may not have drained."""
        for op in (self._gather, self._scatter):
            if op is not None:
                op.close()
        if self._replays is not None:
            self._replays.close()
            self._replays = None
        if self._flight is not None:
            self._stop_flight()
            self._flight = None
        if self._signals is not None:
            self._signals.close(streams_drained=not broken)
            self._signals = None
        if self._blas is not None and not isinstance(self._blas, Exception):
            self._blas.close()
        self._blas = None
        for stream in self._made:
            self.backend.stream_destroy(stream)
        self._made = []
        if self._arrays is not None:
            self._arrays.close()

    def close(self) -> None:
        """Idempotent; waits (bounded) for this rank's calls and for peers before unmapping the heap."""
        if self.heap.closed:
            return
        try:
            if self._flight.broken is None:
                self.synchronize()
        finally:
            broken = self._flight.broken is not None
            self._release(broken)
            self.heap.close(wait_for_peers=not broken)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

