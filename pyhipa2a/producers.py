"""Quick answers from the producers users pass most: PyTorch, CuPy and JAX.

The protocols describe an array fully, but they cost what the producer's own Python costs: PyTorch
builds a stream object, an event and a capsule for every `__dlpack__(stream=s)` (about 45 us a tensor),
JAX about as much, CuPy a new dict for every `__cuda_array_interface__`. So the boundary
(pyhipa2a.inputs) describes an array through its protocol once and, where a probe here knows its
producer, asks later only what can have changed:
- `key(obj)`: pointer, shape, strides and element type, from the object's own attributes; a
  description stands while the key is the one recorded with it;
- `stream(obj)`: the stream the producer queues its writes on now, spelled as the CUDA array interface
  spells it (1: the legacy default stream), which the call's stream waits for; None: nothing to wait for;
- `current_stream(obj, device)`: the library's current stream on our device (AllToAll(stream=
  "current")), None where obj is not on that device; `current_stream_here(device)` the same for an array
  known to live there;
- `view(obj)`: (key, device, compact) of an array its protocol would describe as it is (PyTorch: a plain
  strided CUDA tensor, no gradient, no negated or conjugated view; JAX: a finished, plainly row-major
  array in one GPU's memory), None otherwise; with `element_types` (the library's type object -> the
  NumPy dtype its protocol named, learned when the protocol described an array of that type as the view
  saw it) a new array of a known type is described without its protocol;
- `hold(obj)`: what keeps a viewed array's memory ours while a call may read it, beside the array (JAX:
  its plain export, under which JAX does not donate the buffer).
That is what the protocols do: PyTorch's `__dlpack__(stream=s)` makes `s` wait for its current stream;
CuPy's interface names its current stream; a JAX array never changes once written, and its first export
made the stream of its first use wait for that write. A probe whose answers differ from the protocol's
when an array is first described, or that raises, is not used for its type again; PyTorch's subclasses
get none. No producer is imported here: a probe exists only for a library the caller has imported.
"""
from __future__ import annotations

import sys


class TorchProbe:
    hold = None  # (the tensor, referenced, keeps its memory)

    def __init__(self, torch):
        # The raw handle of the current stream, in C (torch.cuda.current_stream() costs microseconds
        # of Python); a build without it gets no probe (AttributeError here).
        self._current = torch._C._cuda_getCurrentRawStream
        self._strided = torch.strided
        self._viewable = hasattr(torch.Tensor, "is_neg")  # (PyTorch 1.10 on: else no view, the protocols describe)
        self.element_types: dict = {}

    @staticmethod
    def key(t) -> tuple:
        return t.data_ptr(), t.shape, t.stride(), t.dtype

    def view(self, t):
        # What PyTorch's protocols refuse to export, or export otherwise than its memory reads (a
        # negated or conjugated view holds the values before the negation), is left to them.
        if (not self._viewable or not t.is_cuda or t.requires_grad or t.layout is not self._strided or t.is_nested
                or t.is_neg() or t.is_conj()):
            return None
        return self.key(t), t.get_device(), t.is_contiguous()

    def stream(self, t) -> int:
        return self.current_stream_here(t.get_device())

    def current_stream(self, t, device: int) -> int | None:
        return self.current_stream_here(device) if t.is_cuda and t.get_device() == device else None

    def current_stream_here(self, device: int) -> int:
        return self._current(device) or 1  # 0: the default stream, which is the legacy one


class CupyProbe:
    hold = None  # (the array, referenced, keeps its memory)

    def __init__(self, cupy):
        self._current, self._device = cupy.cuda.get_current_stream, cupy.cuda.runtime.getDevice
        self.element_types: dict = {}

    @staticmethod
    def key(a) -> tuple:
        return a.data.ptr, a.shape, a.strides, a.dtype

    def view(self, a):
        return self.key(a), a.device.id, a.flags.c_contiguous

    def stream(self, a) -> int:
        # As CuPy's interface names it: the current stream of the current device, 1 for the null one.
        return self._current().ptr or 1

    def current_stream(self, a, device: int) -> int | None:
        return self.current_stream_here(device) if a.device.id == device else None

    def current_stream_here(self, device: int) -> int | None:
        return self.stream(None) if self._device() == device else None


class JaxProbe:
    def __init__(self, jax):
        self.element_types: dict = {}
        # What a new array's view asks once for each value of the objects that describe it (they compare
        # by value: a layout, a sharding): a layout -> whether it is plain row-major; a sharding -> the
        # GPU it names where that is one GPU's own memory (-1 otherwise: a CPU, pinned host memory,
        # several devices). (a.device alone costs about 0.5 us a call.)
        self._row_major: dict = {}
        self._device_of: dict = {}

    @staticmethod
    def key(a) -> tuple:
        # (No strides: a JAX array has a layout instead, which the view reads.) unsafe_buffer_pointer
        # raises for a deleted array, a donated one say, whose memory may hold another array by now, and
        # for an array over several devices.
        return a.unsafe_buffer_pointer(), a.shape, None, a.dtype

    def view(self, a):
        # Only an array whose producer has finished (is_ready, asked without waiting): one whose write
        # may still be queued goes through its export, which makes our stream wait for it on the device
        # (JAX names no stream to wait for). Nor one of another layout than plain row-major (which the
        # protocol may still find compact: a column-major row, say), nor one outside a GPU's own memory.
        # A build without these attributes gets no view. (is_deleted first: jaxlib's is_ready and layout
        # dereference a deleted array's buffer, and the process dies.)
        try:
            if a.is_deleted() or not a.is_ready():
                return None
            layout, sharding = a._pjrt_layout, a.sharding
            row_major = self._row_major.get(layout)
            if row_major is None:
                row_major = _remember(self._row_major, layout, self._is_row_major(a))
            device = self._device_of.get(sharding)
            if device is None:
                device = _remember(self._device_of, sharding, self._gpu_of(a, sharding))
        except AttributeError:
            return None
        return (self.key(a), device, True) if row_major and device >= 0 else None

    @staticmethod
    def hold(a):
        """What keeps a viewed array's buffer ours while a call may read it: its DLPack export (no stream:
        the array is finished, nothing waits), an external reference under which JAX will not donate the
        buffer to another computation, as it would the buffer of an array merely referenced. It raises
        where the array's computation failed, as its export for the protocol would."""
        return a.__dlpack__()

    @staticmethod
    def _is_row_major(a) -> bool:
        """Through the public format (about 2.4 us; the layout object 0.3)."""
        public = a.format.layout
        return (tuple(public.major_to_minor) == tuple(range(len(a.shape))) and not public.tiling
                and not public.sub_byte_element_size_in_bits)

    @staticmethod
    def _gpu_of(a, sharding) -> int:
        """The GPU index that a's export would name (a of `sharding`), or -1 where it would name no GPU's
        own memory (a CPU array, pinned host memory: every CPU device is device 0 of its kind too)."""
        if len(sharding.device_set) != 1:
            return -1
        kind, index = a.__dlpack_device__()
        return index if kind in _GPU_MEMORY else -1

    @staticmethod
    def stream(a) -> None:
        return None

    @staticmethod
    def current_stream(a, device: int) -> None:
        return None  # JAX names no stream

    @staticmethod
    def current_stream_here(device: int) -> None:
        return None


_GPU_MEMORY = (2, 10)  # DLPack's kDLCUDA, kDLROCM


def foreign_stream_handle(stream) -> int | None:
    """The runtime handle a call's stream= names where it is not one of our backend's stream objects: an
    int as it is, a CuPy stream's `.ptr`, a PyTorch stream's `.cuda_stream`; None for anything else."""
    for handle in (stream, getattr(stream, "ptr", None), getattr(stream, "cuda_stream", None)):  # (CuPy's, PyTorch's)
        if isinstance(handle, int) and not isinstance(handle, bool):
            return handle
    return None


def _remember(memo: dict, key, value):
    """memo[key] = value, returned; a memo over 64 entries is emptied first (a build whose objects are
    not shared between arrays must not grow it without bound)."""
    if len(memo) > 64:
        memo.clear()
    memo[key] = value
    return value


# The top module of a producer's array type -> (the library's module, whether obj is one of its own
# arrays, the probe).
_KNOWN = {"torch": ("torch", lambda torch, obj: type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter,
                    TorchProbe),
          # (a subclass of CuPy's ndarray keeps its memory and stream attributes: no wrapper type there)
          "cupy": ("cupy", lambda cupy, obj: isinstance(obj, cupy.ndarray), CupyProbe),
          "jaxlib": ("jax", lambda jax, obj: isinstance(obj, jax.Array), JaxProbe)}
_by_type: dict[type, object] = {}  # every type asked about: its probe, or None
_disowned: set = set()  # types whose probe answered otherwise than their protocol, or raised


def view_here(probe, obj, device: int):
    """The key of obj as `probe` views it where that view shows it on `device` and compact (what a new
    array must be for its view alone to describe it); None otherwise, or where the view raises."""
    try:
        seen = probe.view(obj)
    except Exception:
        return None
    if seen is None:
        return None
    key, where, compact = seen
    return key if where == device and compact else None


def probe_for(obj):
    """The probe for obj's type, or None (a type no probe knows, or one a probe failed for)."""
    kind = type(obj)
    return None if kind in _disowned else stream_source(obj)


def stream_source(obj):
    """The probe that knows the current stream of obj's library, or None. Unlike probe_for, a probe
    disowned for its descriptions still answers this (AllToAll(stream="current") follows the library
    whatever one odd array of it did)."""
    kind = type(obj)
    try:
        return _by_type[kind]
    except KeyError:
        pass
    probe = None
    known = _KNOWN.get(kind.__module__.partition(".")[0])
    module = sys.modules.get(known[0]) if known else None
    try:
        if module is not None and known[1](module, obj):
            probe = known[2](module)
    except AttributeError:  # a build or version without what the probe reads
        probe = None
    _by_type[kind] = probe
    return probe


def disown(obj) -> None:
    """The probe for obj's type answered otherwise than the protocol, or raised: the type's arrays are
    described through their protocol from now on."""
    _disowned.add(type(obj))
