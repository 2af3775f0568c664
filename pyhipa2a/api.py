"""AllToAll: expert-parallel dispatch and combine.

    with AllToAll(comm, num_experts=E, experts_per_token=k, hidden_dim=H, max_num_tokens=M) as a2a:
        d = a2a.dispatch(x, indices)        # x [T, H], indices [T, k] int32
        expert_y = experts(d.expert_x, d.expert_num_tokens)
        y = a2a.combine(expert_y, weights)  # weights [T, k] float32 -> y [T, H]

`AllToAll(comm, ...)` is one of two implementations, by how the ranks of `comm` lie: within one node
(pyhipa2a.intranode) or across nodes (pyhipa2a.hierarchy); both call along pyhipa2a.calls. Outputs are
views of the library's buffers, valid until the next dispatch (expert_*) or combine (y, unless out=).
"""
from __future__ import annotations

import inspect
import weakref

from .array import DeviceArray
from .bootstrap import agreed, bounded_barrier, mpi, node_layout
from .buffers import DispatchResult
from .calls import Calls
from .config import Config
from .errors import A2AError, RuntimeFailure
from .graph import Graph
from .internode import asked_engine


# AllToAll's parameters past its own: the configuration's, and the engine between nodes (the implementations')
PARAMETERS = frozenset(inspect.signature(Config.of).parameters) - {"world"} | {"engine"}


def _checked_parameters(comm, params: dict) -> None:
    """What a rank can check of its parameters alone (each refused with TypeError or ValueError naming it)."""
    unknown = sorted(set(params) - PARAMETERS - {"backend", "device"})
    if unknown:  # (named as AllToAll's)
        raise TypeError(f"AllToAll() got unexpected keyword arguments {unknown}; its parameters: README.md")
    Config.of(comm.Get_size(), **{name: value for name, value in params.items() if name in PARAMETERS - {"engine"}})
    asked_engine(params.get("engine"))  # (and PYHIPA2A_INTERNODE's; the backend and device: the heap's agreement)


class AllToAll(Calls):
    """Dispatch and combine over the ranks of an MPI communicator (see the module's doc). Every rank makes
    the same calls in the same order, each dispatch combined before the next."""

    _implementations: dict = {}  # across nodes (bool) -> the subclass that implements it

    def __init_subclass__(cls, *, across_nodes: bool, **kwargs):
        super().__init_subclass__(**kwargs)
        cls._implementations[across_nodes] = cls  # (the base class's dict, shared)

    def __new__(cls, comm=None, *, ranks_per_node: int | None = None, **params):
        """Ranks on several nodes (real, or `ranks_per_node` / PYHIPA2A_RANKS_PER_NODE) go across nodes."""
        if comm is not None and not hasattr(comm, "Get_rank"):
            raise TypeError(f"comm must be an mpi4py communicator (or None: COMM_WORLD), not {type(comm).__name__}")
        comm = mpi().COMM_WORLD if comm is None else comm
        # (before anything collective: a rank that refuses its parameters tells the others, who raise too)
        agreed(comm, "AllToAll()", lambda: _checked_parameters(comm, params))
        layout = node_layout(comm, ranks_per_node)
        if cls is AllToAll:
            cls = cls._implementations[layout.nodes > 1]
        obj = super().__new__(cls)
        obj.layout = layout  # how the ranks lie on nodes (bootstrap.NodeLayout)
        return obj

    def __init__(self, comm=None, *, ranks_per_node: int | None = None, backend=None, device: int | None = None,
                 **params):
        config, exchange, health, self.rank = self._open(comm, self.layout, backend, device, params)
        try:
            super().__init__(config, exchange, health)
            self.world = config.world
            self._graphs = weakref.WeakSet()  # closed by close() at the latest
            self._x_buffer = None  # x_buffer(), made at its first call
            bounded_barrier(self.heap.comm, config.timeout, "AllToAll setup")
        except BaseException:
            self._close_parts(broken=True)
            raise

    def _open(self, comm, layout, backend, device, params: dict) -> tuple:
        """(the settled Config, NodeExchange, Health of its status words, rank); closes what it made on failure."""
        raise NotImplementedError

    def _close_parts(self, broken: bool) -> None:
        """Close every part; `broken`: a peer may be gone, so a barrier it never reaches is no news."""
        raise NotImplementedError

    @property
    def closed(self) -> bool:
        """Whether close() ran: the object's memory, its outputs' included, is freed."""
        return self.heap.closed

    @property
    def clock_sync(self):
        """The last clock_offset_ns()'s ClockSync: this rank's clock against rank 0's."""
        return self._exchange.clocks.last

    def x_buffer(self):
        """x's place in the symmetric heap, a [max_num_tokens, H] in_dtype device array, made once. Within a node,
        a dispatch whose x is its first T rows (`x_buffer().rows(T)`, or the same rows through DLPack) and moves
        16-bit rows is pulled by the peers from where it lies: no copy of its tokens into the stage (NumPy x is
        copied there, and gains the same). Write it only after the combine of the dispatch before it (in stream
        order): until then peers may still be reading it."""
        self._refuse_if_closed()
        if self._x_buffer is None:
            a, c = self._exchange.buffers["x_stage"], self.config
            self._x_buffer = DeviceArray(self.backend, a.ptr, (c.max_tokens, c.hidden), a.dtype, owner=self.heap,
                                         stream=self.stream)
        return self._x_buffer

    # -- the fake expert ------------------------------------------------------------
    def expert_y_buffer(self):
        """A device buffer shaped like expert_y [L, W*M, H] (out_dtype), made once, freed by close()."""
        self._refuse_if_closed()
        return self._exchange.expert.expert_y_buffer(self.stream)

    def fake_expert(self, result, out=None, *, stream=None):
        """gpu-mode's stand-in for the grouped GEMM: expert_y = expert_x * (1 + rank), received rows only
        (fp8 rows times their block scales first), of the dispatch awaiting its combine: `result`, its result, is
        checked to be a dispatch's, but the rows read are always the pending dispatch's."""
        self._refuse_if_closed()
        if not isinstance(result, DispatchResult):
            raise TypeError(f"fake_expert(result): result must be a dispatch()'s result, not {type(result).__name__}")
        if self._state.pending is None:
            raise A2AError("fake_expert() needs a dispatch awaiting its combine (its rows are the ones it reads)")
        c, streams, expert = self.config, self._streams, self._exchange.expert
        if not c.scale_cols and c.dispatch_dtype != c.out_dtype:
            raise TypeError("fake_expert needs in_dtype == out_dtype (or fp8 dispatch)")
        self.backend.activate()
        s, _ = streams.enter(stream, (out,), self.JOINS_CAPTURES)
        try:
            if out is None and expert.buffer is None and streams.capturing is not None:
                raise A2AError("fake_expert() without out= inside a capture needs expert_y_buffer() called before "
                               "the capture (memory cannot be allocated while capturing)")
            streams.follow(s)
            if out is None:
                self.expert_y_buffer()
                out = expert.expert_y_on(s, self._health)
            else:
                self._take("fake_expert out", out, (*c.rows_shape, c.hidden), c.out_dtype, s, [])
            expert.launch(out.ptr, s)
            streams.queued(s)
            streams.keep((out,))
            return out
        finally:
            streams.leave()

    # -- groups (dispatch(groups=G): pyhipa2a.groups) ---------------------------------
    def wait_group(self, group: int, stream=None) -> None:
        """Work queued on `stream` from now on (None: the stream of this object's calls) waits, on the device,
        until group `group`'s rows of the pending dispatch(groups=G) are in expert_x."""
        self._groups.wait(group, *self._group_stream(stream))

    def group_done(self, group: int, stream=None) -> None:
        """After the work queued on `stream` so far (None: the stream of this object's calls), group `group`'s
        rows of expert_y are written: combine may send them. Every group, once, in any order, before combine."""
        self._groups.done(group, *self._group_stream(stream))

    def group_rows(self, group: int) -> range:
        """row_layout="contiguous": the rows of expert_x that group `group` of the pending dispatch(groups=G) fills
        (each expert's rounded up to row_align), once the dispatch has counted them, before they land: the host
        waits for that (bounded), so a GEMM of the group can be launched on these rows right after wait_group."""
        self._usable()
        return self._groups.rows(group, self._streams.capturing is not None)

    def group_experts(self, group: int) -> range:
        """The local experts of group `group` of the pending dispatch(groups=G): l with l * G // L == group (their
        rows: expert_offsets[first] .. expert_offsets[last + 1] with row_layout="contiguous")."""
        return self._groups.experts(group)

    def _group_stream(self, stream) -> tuple:
        """(the stream a group's wait or done goes to, why it cannot take it or None): inside capture() a stream
        the capture records (its own, or one forked from it), outside a stream nobody captures."""
        self._usable()
        streams = self._streams
        s = self.stream_for() if stream is None else streams.given(stream)
        recorded = streams.captured_elsewhere(s)  # (inside capture(): forked into it; outside: another library's)
        if streams.capturing is not None and s is not streams.capturing and not recorded:
            return s, ("inside capture(), the stream must be the capture's or one forked from it (work on another "
                       "would run now, not at each launch)")
        if streams.capturing is None and recorded:
            return s, "its stream is being captured by another library (record the step with capture())"
        return s, None

    # -- graphs ---------------------------------------------------------------------
    def capture(self, step, *, stream=None) -> Graph:
        """Record `step()` (this object's calls and your work on the same stream, every dispatch combined)
        as one graph; each `Graph.launch()` is a new call reading the same inputs and writing the same
        outputs (fill the inputs in place). Every rank captures and launches the same sequence."""
        if not callable(step):
            raise TypeError(f"capture(step): step must be a function of no arguments, not {type(step).__name__}")
        self._usable()
        state, streams = self._state, self._streams
        if streams.capturing is not None:
            raise A2AError("capture() is already recording")
        if state.pending is not None:
            raise A2AError("capture() needs the last dispatch to be combined first")
        self._check_capturable()
        s = streams.given(stream)
        streams.follow(s)  # the graph's first launch is queued behind the calls before the capture
        streams.begin(s)
        try:
            step()
            if state.pending is not None:
                raise A2AError("the captured step left a dispatch without its combine")
        except BaseException:
            state.pending = state.sent = None  # nothing captured ran: the object is as it was before
            self._groups.recorded(kept=False)
            streams.end(keep=False)
            raise
        graph, kept = streams.end(keep=True)
        replay_on = streams.replay_target(s)
        groups, grouped = self._groups, self._groups.recorded(kept=True)

        def enter(stream):
            self._usable()
            if streams.capturing is not None:  # (a replay is not a call the capture could record)
                raise A2AError("Graph.launch() inside capture(): record the step's calls themselves")
            if state.pending is not None:
                # (the graph's dispatch would take the epoch the pending combine has not handed on)
                raise A2AError("a graph cannot launch while a dispatch() awaits its combine()")
            target = replay_on() if stream is None else streams.given(stream)
            streams.follow(target)
            return target

        def leave(stream):
            streams.queued(stream)
            if grouped is not None:
                groups.replayed(stream, grouped)
        graph = Graph(self.backend, graph, kept, enter, leave)
        self._graphs.add(graph)
        streams.queued(s)
        return graph

    def _check_capturable(self) -> None:
        """Raise where this object's calls cannot be captured."""

    def synchronize(self, stream=None) -> None:
        """Wait for this rank's calls (on `stream`, else the last call's); raise what the kernels reported."""
        self._refuse_if_closed()  # (its status words are freed memory now)
        streams = self._streams
        if streams.capturing is not None:
            raise A2AError("synchronize() inside capture(): nothing captured has run yet")
        try:
            waited = self._wait_for_calls(stream)
        except (RuntimeFailure, A2AError) as e:
            # (a kernel that trapped, on_timeout="trap", or a wait the host gave up on, pyhipa2a.groups, said why
            # in the status words first)
            self._raise_reported(cause=e)
            raise
        streams.synchronized(waited)
        self._raise_reported()

    def _wait_for_calls(self, stream=None):
        """The host waits for `stream`, else for every call so far (bounded, across nodes too); the stream."""
        self.backend.activate()
        waited = self._streams.given(stream) if stream is not None else self._streams.latest()
        self._health.settle(waited)
        self.backend.stream_synchronize(waited)
        return waited

    # -- profiling --------------------------------------------------------------
    def profile_events(self):
        """(events, dropped) recorded since the last read (profile=True only); waits for the calls."""
        self._refuse_if_closed()
        profile = self._exchange.buffers.profile
        if profile is None:
            raise A2AError("profile_events() needs AllToAll(..., profile=True)")
        self._wait_for_calls()
        events, dropped = profile.read(self.stream)
        profile.reset(self.stream)
        return events, dropped

    def clock_offset_ns(self) -> int:
        """Host monotonic clock minus this device's clock, in ns, to line up timelines across ranks
        (pyhipa2a.clock). Collective; its failures leave calls unaffected."""
        self._usable()
        if self._streams.capturing is not None:
            raise A2AError("clock_offset_ns() cannot run while capture() records")
        self._wait_for_calls()
        return self._exchange.clocks.offset_ns()

    # -- teardown -----------------------------------------------------------------
    def close(self) -> None:
        """Idempotent; waits (bounded) for peers before unmapping the heap."""
        if self.heap.closed:
            return
        if self._streams.capturing is not None:
            raise A2AError("close() inside capture(): nothing captured has run yet")
        self._dispatch_plan = self._combine_plan = None  # (their launchers hold launch sites)
        self._dispatch_record = self._combine_record = None
        try:
            self._wait_for_calls()
        except Exception:
            pass
        for graph in list(self._graphs):  # (graphs that captured NCCL's work go before its communicator)
            graph.close()
        self._groups.close()
        self._close_parts(self._state.broken is not None or self._health.error() is not None)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
