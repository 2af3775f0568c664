"""Dispatch and combine over ranks on several nodes: within a node the symmetric heap, between nodes
NCCL/RCCL (MPI on the host backend).

`AllToAll(comm, ...)` returns a HierarchicalAllToAll when `comm` spans nodes, or when
`ranks_per_node` (or PYHIPA2A_RANKS_PER_NODE) splits one machine into simulated nodes. Same
calls, same outputs, same oracle. Ranks lie node by node (rank = node * G + place, G ranks a node):
expert e lives on rank e // L as always, so node n holds experts [n * E/N, (n+1) * E/N).

A rank's counterparts are the ranks in its place on the other nodes. A call (kernels_hip/hier.hip):
  dispatch: our tokens go once to each counterpart as one region of max_num_tokens rows (rows,
    routing, weights, count, the call's sequence number); each rank then runs its node's AllToAll
    over all N regions, whose routing hier_localize made this node's (-1: another node's expert),
    so a token crosses to each other node once and the node's ranks share it over the heap;
    expert_meta names the token's true source rank (the node part's region_tokens).
  combine: the regions' records cross again (weights given to combine, and each rank's status),
    since counterparts may hand over their weights in different calls; the node's AllToAll sums
    each region's rows over this node's experts (weighted, fp32, rounded once to out_dtype: one
    rounding per node, as narrow_partials rounds per rank), taking every region's weights there;
    each region's sums go home with the sender's status; hier_sum adds a token's sums from every
    node, and reports a node whose sums never came or whose rank had failed.
Regions move whole, so no call needs a host round trip and a step can be captured as a graph
(NCCL's calls are capturable). Bytes between a pair of nodes per call: M rows each way, not T.
"""
from __future__ import annotations

import os
import weakref
from dataclasses import dataclass

import numpy as np

from .a2a import MAX_TOP_K, AllToAll
from .calls import DispatchResult, OutputViews, checked_combine_weights, checked_dispatch, take_input, weights_input
from .array import DeviceArray
from .bootstrap import _mpi
from .errors import A2AError, ConfigMismatchError, Health, STATUS_CAPACITY, STATUS_TIMEOUT, status_error
from .inputs import Boundary
from .internode import Transfer, make_engine
from .kernels import X_FP8
from .runtime import Backend, get_backend, select_device

NODE_WAITS = (6, 7, 8)  # status `what` of waits between nodes: their peer is already a world rank


@dataclass(frozen=True)
class NodeLayout:
    nodes: int
    ranks_per_node: int
    node: int         # this rank's node
    place: int        # this rank's place in its node
    local_rank: int   # this rank among the ranks of its machine (picks its GPU)


def node_layout(comm=None, ranks_per_node: int | None = None) -> NodeLayout:
    """How `comm`'s ranks group into nodes (collective): the machines they run on, or groups of
    `ranks_per_node` (else PYHIPA2A_RANKS_PER_NODE) consecutive ranks within them."""
    MPI = _mpi()
    comm = MPI.COMM_WORLD if comm is None else comm
    if ranks_per_node is None and os.environ.get("PYHIPA2A_RANKS_PER_NODE"):
        ranks_per_node = int(os.environ["PYHIPA2A_RANKS_PER_NODE"])
    rank, world = comm.Get_rank(), comm.Get_size()
    machine = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    local_rank, leader = machine.Get_rank(), machine.bcast(rank, root=0)
    machine.Free()
    leaders = comm.allgather(leader)
    asked = comm.allgather(ranks_per_node)
    if len(set(asked)) > 1:
        raise ConfigMismatchError(f"ranks disagree on ranks_per_node: {asked} (rank by rank)")
    if ranks_per_node is None:
        sizes = {lead: leaders.count(lead) for lead in leaders}
        if len(set(sizes.values())) > 1:
            raise ConfigMismatchError(f"the machines hold different numbers of ranks ({sorted(sizes.values())}); "
                                      "every node must hold as many")
        G = sizes[leader]
    else:
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, (int, np.integer)) or ranks_per_node < 1:
            raise ValueError(f"ranks_per_node must be a positive integer, not {ranks_per_node!r}")
        G = int(ranks_per_node)
        if world % G:
            raise ValueError(f"ranks_per_node={G} does not divide the {world} ranks into equal nodes")
    groups = [leaders[n * G:(n + 1) * G] for n in range(world // G)]
    if any(len(set(g)) > 1 for g in groups):
        raise ValueError(f"nodes of {G} consecutive ranks must each lie on one machine (ranks by machine: "
                         f"{leaders}); place the ranks machine by machine")
    return NodeLayout(world // G, G, rank // G, rank % G, local_rank)


class NodesHealth(Health):
    """The node part's status words, read with world ranks, and a watch on the exchange between
    nodes before any host read waits for the stream (NCCL's waits have no bound of their own)."""

    def __init__(self, host_status, rank: int, layout: NodeLayout, engine):
        super().__init__(host_status, rank)
        self.layout, self.engine = layout, engine

    def error(self):
        if not self.host_status[0]:
            return None
        words = self.host_status.copy()
        node_part_peer = words[0] == STATUS_CAPACITY or (words[0] == STATUS_TIMEOUT and words[2] not in NODE_WAITS)
        if node_part_peer:  # the node part names a rank of our node by its place; the others are world ranks
            words[1] += self.layout.node * self.layout.ranks_per_node
        return status_error(words, self.rank, self.context)

    def settle(self, stream) -> None:
        self.engine.settle(stream)


def _align(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


class HierarchicalAllToAll:
    """AllToAll's calls for a communicator that spans nodes (see the module's doc)."""

    def __init__(self, comm, layout: NodeLayout, *, num_experts: int, experts_per_token: int, hidden_dim: int,
                 max_num_tokens: int, timeout: float = 10.0, backend=None, device: int | None = None,
                 engine: str | None = None, **node_config):
        MPI = _mpi()
        comm = MPI.COMM_WORLD if comm is None else comm
        self.comm, self.layout, self.rank, self.world = comm, layout, comm.Get_rank(), comm.Get_size()
        N = layout.nodes
        self.num_experts, self.top_k = int(num_experts), int(experts_per_token)
        self.hidden, self.max_tokens, self.timeout = int(hidden_dim), int(max_num_tokens), float(timeout)
        if self.num_experts % self.world:
            raise ValueError(f"num_experts={self.num_experts} must be divisible by the number of ranks ({self.world})")
        if not 1 <= self.top_k <= min(self.num_experts, MAX_TOP_K):  # the node part checks only its own experts
            raise ValueError(f"experts_per_token={self.top_k} must be between 1 and num_experts and <= {MAX_TOP_K}")
        self.local_experts, self.capacity = self.num_experts // self.world, self.world * self.max_tokens
        self.node_experts = self.num_experts // N
        self.row_layout = "packed"  # (the node part refuses row_layout="by_source": AllToAll)
        backend = backend if isinstance(backend, Backend) else get_backend(backend)
        if device is None:  # by the rank's place on its machine, not in its (maybe simulated) node
            device = select_device(backend, layout.local_rank)
        # Ranks of other (simulated) nodes may drive the same GPU: the grid is shared among all of them.
        machine = comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        devices = machine.allgather(device)
        # Which GPU, for the engine's default: the machine (named by its first rank, as MPI groups
        # ranks that share memory, whatever the host names say) and the device index.
        self._placement = (machine.bcast(self.rank, root=0), device)
        machine.Free()
        self.node_comm = comm.Split(color=layout.node, key=self.rank)
        self.column_comm = comm.Split(color=layout.place, key=layout.node)  # its rank is the node's number
        try:
            self.node = AllToAll(self.node_comm, num_experts=self.node_experts, experts_per_token=self.top_k,
                                 hidden_dim=self.hidden, max_num_tokens=N * self.max_tokens, timeout=timeout,
                                 backend=backend, device=device, _region_tokens=self.max_tokens,
                                 _ranks_on_device=devices.count(device), **node_config)
        except BaseException:
            self._free_comms()
            raise
        try:
            self._setup(engine)
        except BaseException:
            if getattr(self, "engine", None) is not None:
                self.engine.close()
            if getattr(self, "_free", None) is not None:
                self._free()
            self.node.close()
            self._free_comms()
            raise

    def _setup(self, engine: str | None) -> None:
        node, N, M, k, H = self.node, self.layout.nodes, self.max_tokens, self.top_k, self.hidden
        self.backend, self.stream, self.heap = node.backend, node.stream, node.heap
        for name in ("in_dtype", "dispatch_dtype", "out_dtype", "scale_cols", "narrow_partials", "x_format",
                     "push_max_tokens", "push_tokens", "gpu_fence_publish", "block_threads", "blocks",
                     "lib", "profiling", "small_combine_tokens"):
            setattr(self, name, getattr(node, name))
        node._set_fake_expert_scale(float(1 + self.rank))  # gpu-mode's factor is 1 + the world rank
        self.engine = make_engine(engine or os.environ.get("PYHIPA2A_INTERNODE") or None, self.backend,
                                  self.column_comm, self.timeout, self.column_comm.allgather(self._placement))
        self.health = NodesHealth(node.host_status, self.rank, self.layout, self.engine)

        # One allocation of our own (the exchange's buffers are not symmetric: only the engine reads them).
        row_bytes, out_row = H * self.in_dtype.itemsize, H * self.out_dtype.itemsize
        scale_bytes = 4 * self.scale_cols if self.x_format == X_FP8 else 0
        self.record_bytes = _align(8 * M * k + 8, 16)
        parts = [("sequence", 16), ("seals", 16 * N), ("records", N * self.record_bytes),
                 ("regions_x", N * M * row_bytes), ("regions_scales", N * M * scale_bytes),
                 ("local_indices", 4 * N * M * k), ("local_weights", 4 * N * M * k),
                 ("sums", N * M * out_row), ("partials", N * M * out_row), ("y", M * out_row)]
        total = sum(_align(n) for _, n in parts)
        base = self.backend.malloc_ipc(total)  # zero-filled: no region carries a sequence number yet
        self._free = weakref.finalize(self, self.backend.free, base)
        self.ptr, at = {}, base
        for name, n in parts:
            self.ptr[name], at = at, at + _align(n)
        self.row_bytes, self.out_row, self.scale_bytes = row_bytes, out_row, scale_bytes

        def own(name, shape, dtype):
            return DeviceArray(self.backend, self.ptr[name], shape, dtype, owner=self, stream=self.stream)
        self._regions_x = own("regions_x", (N * M, H), self.in_dtype)
        self._regions_scales = own("regions_scales", (N * M, self.scale_cols), np.float32) if scale_bytes else None
        self._local_indices = own("local_indices", (N * M, k), np.int32)
        self._local_weights = own("local_weights", (N * M, k), np.float32)
        self._sums = own("sums", (N * M, H), self.out_dtype)
        # The node part's buffers, where y is ours (scripts and tests poison them by name), and what the
        # exchange between nodes fills (tests poison it too; the sequence number is the protocol's own).
        self.buf = {**node.buf, "y": own("y", (M, H), self.out_dtype)}
        self.exchange_buffers = [own(name, (n,), np.uint8) for name, n in parts if n and name not in ("sequence", "y")]

        lib = node.lib
        self._stage, self._localize = lib.kernel("hier_stage"), lib.kernel("hier_localize")
        self._sum = lib.kernel("hier_sum_bf16" if self.out_dtype.name == "bfloat16" else "hier_sum_f16")
        self._hier_pack, self._sum_pack = self._stage.pack(), self._sum.pack()
        a = self._hier_pack[0]
        a.regions_x, a.records, a.sequence = self.ptr["regions_x"], self.ptr["records"], self.ptr["sequence"]
        a.regions_scales = self.ptr["regions_scales"] if scale_bytes else 0
        a.local_indices, a.local_weights = self.ptr["local_indices"], self.ptr["local_weights"]
        a.status, a.mirror = node.buf["status"].ptr, node._host_status_device
        a.node, a.nodes, a.ranks_per_node, a.place = self.layout.node, N, self.layout.ranks_per_node, self.layout.place
        a.max_tokens, a.top_k, a.num_experts, a.node_experts = M, k, self.num_experts, self.node_experts
        a.x_row_bytes, a.scale_bytes, a.record_bytes = row_bytes, scale_bytes, self.record_bytes
        b = self._sum_pack[0]
        b.own = self.ptr["sums"] + self.layout.node * M * out_row  # our own region's sums stay here
        b.partials, b.seals = self.ptr["partials"], self.ptr["seals"]
        b.sequence, b.status, b.mirror = self.ptr["sequence"], node.buf["status"].ptr, node._host_status_device
        b.node, b.nodes, b.ranks_per_node, b.place = self.layout.node, N, self.layout.ranks_per_node, self.layout.place
        b.max_tokens, b.hidden = M, H
        # Every launch's site, made now (_launch: one geometry for every call).
        for kernel, pack in ((self._stage, self._hier_pack), (self._localize, self._hier_pack),
                             (self._sum, self._sum_pack)):
            kernel.prepare(pack, self.blocks, self.block_threads)

        # What crosses between nodes: to and from each other node's rank in our place.
        me, others = self.layout.node, [n for n in range(N) if n != self.layout.node]
        def region(name, nbytes):  # our part of buffer `name` out, theirs in, `nbytes` a part
            return [Transfer(m, self.ptr[name] + me * nbytes, self.ptr[name] + m * nbytes, nbytes) for m in others]
        self._records_out = region("records", self.record_bytes)
        self._tokens_out = region("regions_x", M * row_bytes) + self._records_out
        if scale_bytes:
            self._tokens_out += region("regions_scales", M * scale_bytes)
        self._sums_out = [Transfer(m, self.ptr["sums"] + m * M * out_row, self.ptr["partials"] + m * M * out_row,
                                   M * out_row) for m in others]
        self._sums_out += [Transfer(m, self.ptr["sequence"], self.ptr["seals"] + 16 * m, 16) for m in others]

        self._boundary = Boundary(self.backend, self.heap.device.index, node._order, node.producer_order)
        self._pending: DispatchResult | None = None
        self._pending_weights = None
        self._views: dict = {}

    # -- calls ------------------------------------------------------------------
    def _usable(self) -> None:
        error = self.health.error()
        if error is not None:
            raise error
        self.node._usable()

    def _launch(self, kernel, pack, stream) -> None:
        # One geometry for every call: the node-to-node kernels loop over their items, so the object's grid
        # serves any token count, and the launch site made with the object (_setup; on CUDA a one-node
        # graph with device memory of its own) serves every call. A grid fitted to each call's items made
        # a site, and took memory, at each new token count.
        kernel.launch(pack, self.blocks, self.block_threads, stream)

    def stream_for(self, *inputs):
        """As AllToAll.stream_for (the node part's calls run there)."""
        return self.node.stream_for(*inputs)

    def _call_stream(self, stream, inputs):
        """The stream a call runs on (the node part's); refused while another library captures it."""
        s = self.node._stream(stream, inputs)
        if self.node._capturing is None and self.node._captured_elsewhere(s):
            raise A2AError("a call between nodes cannot be recorded into another library's capture (its exchange "
                           "between nodes is watched from the host): record it with capture()")
        return s

    def _input(self, obj, name, shape, dtype, stage, stream, align: int = 1):
        return take_input(self._boundary, self.node, obj, name, shape, dtype, stage, stream, align)

    def _keep(self, *objects) -> None:
        """Inputs stay referenced until the next call (the device may still read them); a capture keeps
        them for the graph's lifetime, as AllToAll's do."""
        if self.node._capturing is not None:
            self.node._captured_refs.extend(objects)
        else:
            self._keepalive = objects

    def _settle_before_host_copy(self, stream, *inputs) -> None:
        """A NumPy input is copied with the host waiting for `stream`, where an exchange between nodes
        may still wait for a peer without bound (NCCL): watch it first."""
        if any(isinstance(i, np.ndarray) for i in inputs):
            self.health.settle(stream)

    def dispatch(self, x, indices, *, weights=None, x_scales=None, stream=None) -> DispatchResult:
        """As AllToAll.dispatch; the tokens cross to each other node once (the module's doc). The
        weights, given here, cross with them; the node part takes every region's in combine, since
        each rank picks where it gives them."""
        self._usable()
        T = checked_dispatch(self, x, indices, weights, x_scales)
        s = self._call_stream(stream, (x, indices))
        self.node._follow(s)
        self._settle_before_host_copy(s, x, indices, weights, x_scales)
        a = self._hier_pack[0]
        a.x, keep_x = self._input(x, "x", (T, self.hidden), self.in_dtype, "x_stage", s)
        a.indices, keep_i = self._input(indices, "indices", (T, self.top_k), np.int32, "indices_stage", s)
        a.x_scales, keep_s = (self._input(x_scales, "x_scales", (T, self.scale_cols), np.float32, "x_scales_stage", s,
                                          align=4)
                              if x_scales is not None else (0, None))
        a.weights, keep_w = weights_input(self, weights, T, s) if weights is not None else (0, None)
        a.tokens, a.whole = T, 1
        self._launch(self._stage, self._hier_pack, s)
        self.engine.exchange(self._tokens_out, s)
        self._launch(self._localize, self._hier_pack, s)
        self._keep(keep_x, keep_i, keep_s, keep_w)
        self.node._dispatch(self._regions_x, self._local_indices, None, self._regions_scales, s)
        self._pending, self._pending_weights = self._outputs(s).dispatch_result(T), weights
        return self._pending

    def combine(self, expert_y, weights=None, *, out=None, stream=None, expert_scale: float = 1.0) -> DeviceArray:
        """As AllToAll.combine; each node's sums of a token come home once (the module's doc).

        Every combine swaps the regions' records again (routing, weights, this rank's status) whether
        the weights came here or to dispatch: counterparts may have chosen differently, and both must
        move the same bytes in the same order."""
        self._usable()
        sent = checked_combine_weights(self, weights)
        T = self._pending.num_tokens
        s = self._call_stream(stream, (expert_y, weights, out))
        self.node._follow(s)
        self._settle_before_host_copy(s, expert_y, weights)
        if out is not None:
            if isinstance(out, np.ndarray):
                raise TypeError("out must be a device array; a NumPy result comes from combine(...).numpy()")
            out_ptr, keep_o = self._input(out, "out", (T, self.hidden), self.out_dtype, None, s)
        else:
            out = self._outputs(s).y_rows[T]
            out_ptr, keep_o = out.ptr, None
        a = self._hier_pack[0]
        a.weights, keep_w = (0, None) if sent is not None else weights_input(self, weights, T, s)
        # Every check of the node part's combine before anything is launched: bad input leaves peers untouched.
        node_call = self.node._copy_host_expert_y(
            self.node._prepare_combine(expert_y, self._local_weights, self._sums, s, expert_scale))
        a.tokens, a.whole = T, 0
        self._launch(self._stage, self._hier_pack, s)
        self.engine.exchange(self._records_out, s)
        self._launch(self._localize, self._hier_pack, s)
        self.node._launch_combine(node_call)
        self.engine.exchange(self._sums_out, s)
        b = self._sum_pack[0]
        b.out, b.tokens = out_ptr, T
        self._launch(self._sum, self._sum_pack, s)
        self._keep(keep_o, keep_w, out)
        self._pending = self._pending_weights = None
        return out

    def exchange_between_nodes(self, stream=None) -> None:
        """The bytes a call moves between nodes (dispatch's regions, then combine's records and sums),
        moved alone by the same engine, with no kernel of ours: the bare exchange that benchmarks set a
        call beside. Collective, as a call is, and ordered as one; between calls (it overwrites the
        exchanged regions, which the next call writes anew)."""
        self._usable()
        if self._pending is not None:
            raise A2AError("exchange_between_nodes() between a dispatch and its combine would overwrite "
                           "the call's regions")
        s = self.node._stream(stream)
        self.node._follow(s)
        for transfers in (self._tokens_out, self._records_out, self._sums_out):
            self.engine.exchange(transfers, s)
        self.node._queued(s)

    def _outputs(self, stream) -> OutputViews:
        """Views of the node part's outputs and of our y, naming `stream`, with this object's health
        (made once per stream; the views hold their stream, so no id is reused)."""
        views = self._views.get(id(stream))
        if views is None:
            def view(ptr, shape, dtype):
                return DeviceArray(self.backend, ptr, shape, dtype, owner=self, stream=stream, health=self.health)
            L, cap, H, b = self.local_experts, self.capacity, self.hidden, self.node.buf
            views = self._views[id(stream)] = OutputViews(
                view(b["num_tokens"].ptr, (L,), np.int32), view(b["recv_x"].ptr, (L, cap, H), self.dispatch_dtype),
                view(b["recv_meta"].ptr, (L, cap, 3), np.int32),
                view(b["recv_scales"].ptr, (L, cap, self.scale_cols), np.float32) if self.scale_cols else None,
                view(self.ptr["y"], (self.max_tokens, H), self.out_dtype))
        return views

    # -- the rest, as AllToAll -------------------------------------------------
    def expert_y_buffer(self) -> DeviceArray:
        return self.node.expert_y_buffer()

    def fake_expert(self, result: DispatchResult, out: DeviceArray | None = None, *, stream=None) -> DeviceArray:
        """As AllToAll.fake_expert; its output carries this object's health (its reads are watched)."""
        y = self.node.fake_expert(result, out, stream=stream)
        return y if y.health is not None else DeviceArray(self.backend, y.ptr, y.shape, y.dtype, owner=y.owner,
                                                          stream=y.stream, health=self.health)

    def capture(self, step, *, stream=None):
        """As AllToAll.capture (the engine between nodes must be capturable: NCCL, or MPI on the host)."""
        if not self.engine.capturable:
            raise A2AError("capture() between nodes needs the NCCL engine: the MPI engine stages regions "
                           "through the host, which a graph cannot record")
        self._usable()
        try:
            # A launch checks this object's health: its errors name world ranks.
            return self.node.capture(step, stream=stream, _usable=self._usable)
        finally:
            self._pending = self._pending_weights = None

    def synchronize(self, stream=None) -> None:
        """As AllToAll.synchronize; an exchange between nodes that outlives the timeout is aborted and
        reported (A2ATimeoutError naming the rank that never came)."""
        if self.node._capturing is not None:
            raise A2AError("synchronize() inside capture(): nothing captured has run yet")
        self.backend.activate()
        waited = self.node._synchronized_stream(stream)
        self.health.settle(waited)
        try:
            self.node.synchronize(stream)
        except A2AError as e:
            error = self.health.error()
            if error is None:
                raise
            raise error from e
        self.health.check()

    def profile_events(self):
        self.health.settle(self.node._synchronized_stream(None))  # it waits for the stream
        return self.node.profile_events()

    def clock_offset_ns(self) -> int:
        """As AllToAll.clock_offset_ns, within this node (another node's host clock is its own)."""
        self.health.settle(self.node._synchronized_stream(None))
        offset = self.node.clock_offset_ns()
        self.clock_sync = self.node.clock_sync
        return offset

    def close(self) -> None:
        """Idempotent, as AllToAll.close."""
        if self.heap.closed:
            return
        try:
            try:
                self.health.settle(self.node._synchronized_stream(None))
            except Exception:
                pass
            for graph in list(self.node._graphs):  # graphs that captured NCCL's work go before its communicator
                graph.close()
            self.engine.close()
        finally:
            try:
                self.node.close()
            finally:
                self._free()
                self._free_comms()

    def _free_comms(self) -> None:
        for c in (self.node_comm, self.column_comm):
            c.Free()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
