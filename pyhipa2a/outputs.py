"""Outputs in the caller's library (AllToAll(outputs="inputs"), the default).

A call whose first PyTorch or CuPy input names that library hands out that library's arrays; NumPy, JAX
and our own arrays get DeviceArray (outputs="ours" always does). Each is a view of our buffer, made once
through the library's DLPack import and handed out again at every call (a cached slice for a token
count), so handing one out costs nothing: the library reads it on its current stream, which each call
orders after its own on the device (nothing where they are one; the host waits where the library names
none). JAX orders its reads of an outside array once, at its import (about 90 us an array on an H200),
so a view made once would not be ordered again: JAX's arrays come from pyhipa2a.jax instead.
"""
from __future__ import annotations

from . import producers
from .array import DeviceArray
from .buffers import OutputViews


class LibraryViews(OutputViews):
    """One stream's OutputViews as one library's arrays, exported once (OutputViews' DispatchResult of each
    token count), and y's rows of each count, sliced when first asked for."""

    def __init__(self, probe, views: OutputViews, behind: dict):
        # (OutputViews' lists, filled from exports rather than made: no super().__init__)
        self._behind = behind  # id(view) -> (the view, our DeviceArray under it): Outputs.ours_behind

        def export(a):
            # (imported as naming no stream: every call orders the library's stream itself, and an import
            # made while a capture records must not order a stream outside it)
            view = probe.export(DeviceArray(a.backend, a.ptr, a.shape, a.dtype, owner=a.owner, device_id=a.device_id,
                                            health=a.health))
            behind[id(view)] = (view, a)  # (the view too: its id stays its own while it is referenced here)
            return view
        self.arrays = tuple(export(a) for a in views.arrays)
        self.extras = tuple(None if a is None else export(a) for a in views.extras)
        self._y = export(views.y_rows[-1])
        self._ours_y = views.y_rows
        self.y_rows: list = [None] * len(views.y_rows)
        self.results = [None] * len(views.y_rows)

    def y(self, tokens: int):
        rows = self.y_rows[tokens]
        if rows is None:
            rows = self.y_rows[tokens] = self._y[:tokens]  # (a slice: the library's own view, no import)
            self._behind[id(rows)] = (rows, self._ours_y[tokens])
        return rows


class Outputs:
    """Which library a call's outputs go to, its views of them, and what orders its reader after the call."""

    def __init__(self, choice: str, streams, make_views):
        self._follow_inputs = choice == "inputs"
        self._streams, self._make_views = streams, make_views
        self._ours: dict = {}     # OutputViews by id(stream): the views hold their stream, so no id is reused
        self._theirs: dict = {}   # LibraryViews by (id(stream), probe)
        self._behind: dict = {}   # id(a view handed out) -> (the view, our DeviceArray under it)
        self._orderers: dict = {}  # f() by (id(stream), probe)

    def ours(self, stream) -> OutputViews:
        views = self._ours.get(id(stream))
        if views is None:
            views = self._ours[id(stream)] = self._make_views(stream)
        return views

    def library_of(self, inputs):
        """The probe of the first input whose library we hand arrays back to, or None (DeviceArray). A step
        capture() records on the object's own stream hands out ours: its replays run there, and only our
        arrays tell their readers so."""
        streams = self._streams
        if self._follow_inputs and (streams.capturing is None or streams.follow_library or streams.joined):
            for obj in inputs:
                probe = producers.stream_source(obj)
                if probe is not None:
                    return probe if probe.lasting_views else None
        return None

    def views(self, stream, probe):
        """The views a call on `stream` hands out: DeviceArray (probe None) or `probe`'s library's."""
        if probe is None:
            return self.ours(stream)
        key = (id(stream), probe)
        views = self._theirs.get(key)
        if views is None:
            views = self._theirs[key] = LibraryViews(probe, self.ours(stream), self._behind)
        return views

    def ours_behind(self, obj, lead):
        """Our DeviceArray under `obj` where it is a view we handed out and the call runs on its library's
        current stream (`lead` says the call's stream was chosen so): the library wrote it, if at all, on
        that stream, so the call takes our array as it is, with nothing to ask the library. Else obj."""
        if type(lead) is tuple:
            found = self._behind.get(id(obj))
            if found is not None and found[0] is obj and producers.stream_source(obj) is lead[0]:
                return found[1]
        return obj

    def orderer(self, stream, probe):
        """f() that queues the library's reads after the call on `stream` (None: nothing to order: our own
        arrays name their stream, the host backend runs calls at once, a capture orders its own replays)."""
        streams = self._streams
        if probe is None or streams.library_device is None or streams.capturing is not None:
            return None
        key = (id(stream), probe)
        order = self._orderers.get(key)
        if order is None:
            order = self._orderers[key] = _reader_after(streams, probe, stream)
        return order


def _reader_after(streams, probe, stream):
    device, backend = streams.library_device, streams.backend

    def order() -> None:
        handle = probe.current_stream_here(device)
        if handle is None:
            backend.stream_synchronize(stream)
        else:
            backend.stream_wait_stream(streams.named(handle), stream)
    return order
