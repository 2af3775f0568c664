"""A captured sequence of calls, replayed with one launch (CUDA graph, HIP graph, or the host's list)."""
from __future__ import annotations

import weakref

from .errors import A2AError


class Graph:
    """What `AllToAll.capture()` returns: `launch()` replays the step in one driver call."""

    def __init__(self, backend, handle, keepalive: list, enter, leave):
        self.backend = backend
        # The owner's hooks: enter(stream=) raises reported errors and returns the stream the replay goes
        # to, queued behind the owner's last call; leave(that stream) notes the launch.
        self._handle, self._keepalive = handle, keepalive
        self._enter, self._leave = enter, leave
        self._destroy = weakref.finalize(self, backend.graph_destroy, handle)

    def launch(self, stream=None) -> None:
        """Queue one replay on `stream` (a handle, a CuPy or PyTorch stream), else on the stream an eager
        call of the step would take: with AllToAll(stream="current") the current stream of the library
        whose arrays the step took, otherwise the capture's. The replay runs on that stream, so it follows
        the work queued there before and the work queued there after follows it, with no host wait.
        Errors the kernels reported earlier are raised first."""
        if self._handle is None:
            raise A2AError("this graph is closed")
        s = self._enter(stream)
        self.backend.graph_launch(self._handle, s)
        self._leave(s)

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
