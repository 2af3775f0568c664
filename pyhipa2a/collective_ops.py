"""CollectiveMatmul's two operations: the work a call queues, chunk by chunk in ring order (docs/COLLECTIVE.md).

The call's stream runs the GEMMs, one chunk of rows a rank (or a piece of one); a copy stream for each peer
(and piece) moves rows between heaps with the copy engine and raises a readiness word in the peer's heap
(pyhipa2a.signals); the GEMM of a chunk waits for its word on the device. The call's stream waits for the
copy streams before the call returns, so it covers everything the call does.
"""
from __future__ import annotations

from .collective_call import Operation, Prepared, lead_rows
from .inputs import check_writable
from .kernels import KernelLibrary

SUM_THREADS, SUM_BLOCKS_PER_SM = 256, 4  # the sum's geometry: enough loads in flight to be bound by bytes


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

    def fork(self, s) -> None:
        """The first piece's copy stream to every peer waits for what `s` queued so far."""
        for streams in self.to:
            if streams is not None:
                self.follow(streams[0], s)

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


class AllGatherMatmul(Operation):
    """C [W*m, n] = all_gather(a_shard [m, k]) @ b [k, n]. Our own rows' GEMM is queued first, so the GPU starts at
    once; each peer's chunk is multiplied as soon as its word is in, rank r - 1's first."""
    name = "all_gather_matmul"
    FREED, WORD = "rows_read", "rows"

    def __init__(self, shared):
        super().__init__(shared)
        w, m = shared.world, shared.shard_rows
        self.gathered = shared.heap.alloc((w, m, shared.k), shared.dtype)  # rank s's rows land in [s]
        self.out = shared.heap.alloc((w * m, shared.n), shared.dtype)      # the output when no out= is given

    def check(self, inputs) -> None:
        sh = self.shared
        lead_rows(inputs[0], "a_shard", 1, sh.shard_rows, f" a rank (max_rows={sh.max_rows} over {sh.world} ranks)")

    def prepare(self, take, s, a_shard, b, out, gathered, gemm) -> Prepared:
        sh = self.shared
        w, r, k, n, m = sh.world, sh.rank, sh.k, sh.n, int(a_shard.shape[0])
        a_ptr = take("a_shard", a_shard, (m, k))
        b_ptr = take("b", b, (k, n))
        b_given = sh.arrays.given(b, b_ptr, (k, n))  # (what gemm= gets)
        out, out_ptr = sh.arrays.output(take, "out", out, self.out, (w * m, n), a_shard, s)
        if gathered is not None:
            check_writable("gathered", gathered, "the gathered rows are written only to device memory")
        g_ptr = take("gathered", gathered, (w * m, k)) if gathered is not None else None
        row_out, row_a = n * sh.dtype.itemsize, k * sh.dtype.itemsize
        # Slots lie the most rows a rank apart: a rank that sent another count overwrites only its own slot.
        slot = sh.shard_rows * row_a
        sig, copies, cuts = sh.signals, sh.copies, cut_rows(m, sh.pieces)

        def multiply(s, src: int, first: int, count: int, rows: int) -> None:
            out_row = src * m + first
            if gemm is None:
                sh.vendor().matmul(s, rows, b_ptr, out_ptr + out_row * row_out, count, n, k, lda=k, ldb=n, ldc=n,
                                   dtype=sh.dtype)
            else:
                a_rows = sh.arrays.rows(a_shard, first, count, a_ptr, k, b) if src == r else \
                    sh.arrays.ours(rows, (count, k), b)
                gemm(a_rows, b_given, sh.arrays.rows(out, out_row, count, out_ptr, n, b), sh.backend.stream_handle(s))
            if g_ptr is not None:
                sh.backend.copy_device(g_ptr + out_row * row_a, rows, count * row_a, s)

        def queue(s) -> list:
            awaited = []
            try:
                # The copies leave once a_shard is ready (forked before anything else is queued on s), and the
                # GPU starts on our own rows while the host queues the rest.
                if gemm is None and w > 1:  # (the kernels of the GEMMs queued behind waits, loaded now, into
                    # out: the call writes every row of it after)
                    sh.vendor().prime(s, [(a_ptr, b_ptr, count, n, k, k, n, n, sh.dtype, None) for _, count in cuts],
                                      out_ptr)
                copies.fork(s)
                multiply(s, r, 0, m, a_ptr)
                for i in range(1, w):  # every copy stream at once: rank r's rows to rank (r + i)'s slot [r]
                    p = (r + i) % w
                    copies.after_free_slot(p, self.FREED, "word that it read our all_gather_matmul rows", awaited)
                    for (kind, _), (first, count), copy in zip(self.piece_words, cuts, copies.to[p]):
                        theirs = sh.heap.translate(self.gathered.ptr + r * slot + first * row_a, p)
                        sh.backend.copy_device(theirs, a_ptr + first * row_a, count * row_a, copy)
                        sig.raise_on(p, kind, copy, count=m)
                for i in range(1, w):  # rank r - 1's rows (the first to arrive), then r - 2's, ...
                    src = (r - i) % w
                    for (kind, what), (first, count) in zip(self.piece_words, cuts):
                        sig.wait(src, kind, s, what, count=m)
                        awaited.append((src, kind, m, what))
                        multiply(s, src, first, count, self.gathered.ptr + src * slot + first * row_a)
                    sig.raise_on(src, self.FREED, s)
            finally:
                copies.join(s)
            return awaited
        key = None if gemm is not None else (self.name, m, a_ptr, b_ptr, out_ptr, g_ptr)
        return Prepared(out, m, key, queue, ((out_ptr, w * m * row_out), (g_ptr, w * m * row_a)))


class MatmulReduceScatter(Operation):
    """C_shard [m, n] = rows r*m.. of the sum over ranks of a [W*m, k_r] @ b [k_r, n], in fp32. The partial sums
    for rank r + 1 come first (it waits for ours first), our own last, behind the copies of the others'. At two
    ranks with the vendor's GEMM and rows in pieces, our GEMM of each piece adds the peer's partial sums of it,
    read from their slot once in (C = A @ B + D), so no pass over the sums is left after the last GEMM; otherwise
    our own go to slot [r] and one kernel adds the W slots (docs/COLLECTIVE.md: how each rounds)."""
    name = "matmul_reduce_scatter"
    FREED, WORD = "sums_read", "sums"

    def __init__(self, shared, remote_sums: bool):
        super().__init__(shared)
        w, m, n = shared.world, shared.shard_rows, shared.n
        self.remote_sums = remote_sums  # the GEMMs write a peer's partial sums straight into its heap
        self.partials = shared.heap.alloc((w, m, n), shared.dtype)  # rank s's sums of our rows land in [s]
        # ... and ours of rank d's rows, before the copy (none where the GEMM writes them to the peer)
        self.staged = None if remote_sums else shared.heap.alloc((w, m, n), shared.dtype)
        self.out = shared.heap.alloc((m, n), shared.dtype)
        self._library = KernelLibrary(shared.backend, shared.heap.device.arch)
        self._sum = self._library.kernel("sum_slots_" + ("bf16" if shared.dtype.name == "bfloat16" else "f16"))
        self._sum_pack = self._sum.pack()
        self._sum_blocks = SUM_BLOCKS_PER_SM * shared.heap.device.multiprocessors

    def check(self, inputs) -> None:
        sh = self.shared
        rows = lead_rows(inputs[0], "a", sh.world, sh.shard_rows * sh.world, "")
        if rows % sh.world:
            raise ValueError(f"a has {rows} rows: matmul_reduce_scatter needs a multiple of the {sh.world} ranks")

    def prepare(self, take, s, a, b, out, gemm) -> Prepared:
        sh = self.shared
        w, r, n, item = sh.world, sh.rank, sh.n, sh.dtype.itemsize
        m, k = int(a.shape[0]) // w, int(a.shape[1])
        a_ptr = take("a", a, (w * m, k))
        b_ptr = take("b", b, (k, n))
        b_given = sh.arrays.given(b, b_ptr, (k, n))  # (what gemm= gets)
        out, out_ptr = sh.arrays.output(take, "out", out, self.out, (m, n), a, s)
        row_c = n * item
        slot = sh.shard_rows * row_c
        sig, copies, cuts = sh.signals, sh.copies, cut_rows(m, sh.pieces)
        onto_peers = w == 2 and gemm is None and len(cuts) > 1

        def partial(s, first: int, count: int, c_ptr: int, addend: int | None = None) -> None:
            """[count, n] at c_ptr = rows first.. of a, times b (plus the [count, n] at `addend`)."""
            rows = a_ptr + first * k * item
            if gemm is None:
                sh.vendor().matmul(s, rows, b_ptr, c_ptr, count, n, k, lda=k, ldb=n, ldc=n, dtype=sh.dtype,
                                   addend=addend)
            else:
                gemm(sh.arrays.rows(a, first, count, a_ptr, k, b), b_given, sh.arrays.ours(c_ptr, (count, n), b),
                     sh.backend.stream_handle(s))

        def send(s, d: int, awaited: list) -> None:
            """Our partial sums of rank d's rows, piece by piece, into its slot [r]."""
            freed = "word that it reduced our matmul_reduce_scatter sums"
            for j, ((kind, _), (first, count)) in enumerate(zip(self.piece_words, cuts)):
                theirs = sh.heap.translate(self.partials.ptr + r * slot + first * row_c, d)
                if self.remote_sums:  # (the GEMM's own stores cross the link: no staging, no copy)
                    if j == 0:
                        sig.wait(d, self.FREED, s, freed)
                        awaited.append((d, self.FREED, 0, freed))
                    partial(s, d * m + first, count, theirs)
                    sig.raise_on(d, kind, s, count=m)
                    continue
                staged = self.staged.ptr + d * slot + first * row_c
                partial(s, d * m + first, count, staged)
                copy = copies.to[d][j]
                copies.follow(copy, s)
                if j == 0:
                    copies.after_free_slot(d, self.FREED, freed, awaited)
                sh.backend.copy_device(theirs, staged, count * row_c, copy)
                sig.raise_on(d, kind, copy, count=m)

        def add_onto_peer(s, awaited: list) -> None:
            """Two ranks: out = our own GEMM of each piece plus the peer's partial sums of it, read from their
            slot as each piece comes in."""
            peer = 1 - r
            for (kind, what), (first, count) in zip(self.piece_words, cuts):
                sig.wait(peer, kind, s, what, count=m)
                awaited.append((peer, kind, m, what))
                partial(s, r * m + first, count, out_ptr + first * row_c,
                        addend=self.partials.ptr + peer * slot + first * row_c)

        def add_slots(s, awaited: list) -> None:
            """out = the sum of the W slots, ours computed now into slot [r]."""
            partial(s, r * m, m, self.partials.ptr + r * slot)
            for i in range(1, w):
                src = (r - i) % w
                for kind, what in self.piece_words[:len(cuts)]:
                    sig.wait(src, kind, s, what, count=m)
                    awaited.append((src, kind, m, what))
            self._sum_pack.set_scalars(self.partials.ptr, out_ptr, m * n, sh.shard_rows * n, w)
            self._sum.launch(self._sum_pack, self._sum_blocks, SUM_THREADS, s)

        def queue(s) -> list:
            awaited = []
            try:
                if gemm is None and w > 1:  # (the kernels of the GEMMs queued behind waits, loaded now, into
                    # out: the call writes every row of it after)
                    # (the peer's slot read while the peer may write it: the scratch's values are never used)
                    shapes = [(count, None) for _, count in cuts] + (
                        [(count, self.partials.ptr + (1 - r) * slot) for _, count in cuts] if onto_peers else
                        [(m, None)])
                    sh.vendor().prime(s, [(a_ptr, b_ptr, rows, n, k, k, n, n, sh.dtype, addend)
                                          for rows, addend in dict.fromkeys(shapes)], out_ptr)
                for i in range(1, w):  # the sums for rank r + 1 first: it waits for ours first
                    send(s, (r + i) % w, awaited)
                (add_onto_peer if onto_peers else add_slots)(s, awaited)
                for i in range(1, w):
                    sig.raise_on((r - i) % w, self.FREED, s)
            finally:
                copies.join(s)
            return awaited
        key = None if gemm is not None else (self.name, m, k, a_ptr, b_ptr, out_ptr)
        return Prepared(out, m, key, queue, ((out_ptr, m * n * item),))

    def close(self) -> None:
        super().close()
        self._library.close()
