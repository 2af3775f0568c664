"""A captured sequence of calls, replayed with one launch (CUDA graph, HIP graph, or the host's list)."""
from __future__ import annotations

import weakref

from .errors import A2AError


class Graph:
    """What `AllToAll.capture()` returns: `launch()` replays the step on its capture stream in one driver call."""

    def __init__(self, backend, handle, stream, keepalive: list, before_launch=lambda: None, after_launch=lambda: None):
        self.backend, self.stream = backend, stream
        # The owner's hooks: raise reported errors and queue behind its last call before; note the launch after.
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
