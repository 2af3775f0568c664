"""A captured sequence of calls, replayed with one launch (CUDA graph, HIP graph, or the host's list)."""
from __future__ import annotations

import weakref

from .errors import A2AError


class Graph:
    """What `AllToAll.capture()` returns: `launch()` replays the step on the stream it was captured on.

    One launch costs one driver call instead of one per kernel, and the
    kernels follow each other on the device without waiting for the host."""

    def __init__(self, backend, handle, stream, keepalive: list, before_launch=lambda: None,
                 after_launch=lambda: None):
        self.backend, self.stream = backend, stream
        # The owner's hooks around each launch: before, it raises errors the kernels reported and
        # queues the launch behind the owner's last call when that went to another stream; after,
        # it notes the launch as the owner's last call.
        self._handle, self._keepalive = handle, keepalive
        self._before_launch, self._after_launch = before_launch, after_launch
        self._destroy = weakref.finalize(self, backend.graph_destroy, handle)

    def launch(self) -> None:
        """Queue one replay; errors the kernels reported earlier are raised first."""
        if self._handle is None:
            raise A2AError("this graph is closed")
        self._before_launch()
        self.backend.graph_launch(self._handle, self.stream)
        self._after_launch()

    def close(self) -> None:
        """Idempotent; AllToAll.close() closes its graphs too."""
        if self._handle is not None:
            self._handle = None
            self._keepalive = []
            self._destroy()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
