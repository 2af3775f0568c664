"""pyhipa2a: torch-free MoE expert-parallel all-to-all (dispatch / combine) and tensor parallelism's collective
matmuls over a symmetric GPU heap."""
from . import hierarchy, intranode  # noqa: F401  (AllToAll's two implementations register themselves)
from .api import AllToAll
from .array import DeviceArray
from .buffers import DispatchResult
from .collective import CollectiveMatmul
from .errors import (A2ADeviceError, A2AError, A2ATimeoutError, AllocationMismatchError, CodeObjectNotFound,
                     ConfigMismatchError, RuntimeFailure)
from .graph import Graph
from .heap import SymmetricHeap
from .runtime import BACKENDS, get_backend

__all__ = ["AllToAll", "CollectiveMatmul", "DispatchResult", "DeviceArray", "Graph", "SymmetricHeap", "get_backend",
           "BACKENDS", "A2AError", "A2ATimeoutError", "A2ADeviceError", "AllocationMismatchError",
           "ConfigMismatchError", "CodeObjectNotFound", "RuntimeFailure"]
__version__ = "0.1.0"
