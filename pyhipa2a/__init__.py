"""pyhipa2a: torch-free MoE expert-parallel all-to-all (dispatch / combine) on one node of GPUs."""
from .a2a import AllToAll
from .calls import DispatchResult
from .array import DeviceArray
from .errors import (A2ADeviceError, A2AError, A2ATimeoutError, AllocationMismatchError, CodeObjectNotFound,
                     ConfigMismatchError, RuntimeFailure)
from .graph import Graph
from .heap import SymmetricHeap
from .runtime import BACKENDS, get_backend

__all__ = ["AllToAll", "DispatchResult", "DeviceArray", "Graph", "SymmetricHeap", "get_backend", "BACKENDS",
           "A2AError", "A2ATimeoutError", "A2ADeviceError", "AllocationMismatchError", "ConfigMismatchError",
           "CodeObjectNotFound", "RuntimeFailure"]
__version__ = "0.1.0"
