"""Probes for PyTorch, CuPy and JAX arrays, whose protocols cost tens of us a call: pyhipa2a.inputs describes an
array through its protocol once, then asks the probe only what can have changed. A probe has:
- `key(obj)`: pointer, shape, strides, element type; a description stands while its recorded key does;
- `stream(obj)`: the producer's current stream as the CUDA array interface spells it (1: legacy default), or
  None; `current_stream(obj, device)` / `current_stream_here(device)`: the library's current stream there;
- `view(obj)`: (key, device, compact) where the protocol would describe obj as it is, else None; with
  `element_types` (type object -> NumPy dtype its protocol named), a new array needs no protocol;
- `hold(obj)`: what keeps a viewed array's memory ours beside it (JAX: an export, so it is not donated);
- `lasting_views`: whether the library's view of one of our arrays (`export(array)`), made once, can be
  ordered after every later call (pyhipa2a.outputs), through `current_stream_here(device)`: the stream the
  library reads it on, or None where it names none;
- `immutable`: whether the library's arrays never change once made (JAX): one is refused where a call writes.
That is what the protocols wait for: PyTorch's and CuPy's current stream; a JAX array never changes once
written. A probe that disagrees with the protocol or raises is dropped for its type; PyTorch subclasses get
none; nothing is imported here.
"""
from __future__ import annotations

import sys


class _StreamedProbe:
    """PyTorch's and CuPy's: an array, referenced, keeps its memory; the library reads it on its current stream."""
    hold = None
    lasting_views = True
    immutable = False

    def __init__(self, library):
        self.element_types: dict = {}
        self._library = library

    def export(self, a):
        return self._library.from_dlpack(a)


class TorchProbe(_StreamedProbe):
    def __init__(self, torch):
        super().__init__(torch)
        # In C, unlike torch.cuda.current_stream(); a build without it (one without CUDA, say) names no stream.
        self._current = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._strided = torch.strided
        self._viewable = hasattr(torch.Tensor, "is_neg")  # (PyTorch >= 1.10; else the protocols describe)

    @staticmethod
    def key(t) -> tuple:
        return t.data_ptr(), t.shape, t.stride(), t.dtype

    def view(self, t):
        # Left to the protocols: what they refuse, or export unlike its memory (negated/conjugated views).
        if (not self._viewable or not t.is_cuda or t.requires_grad or t.layout is not self._strided or t.is_nested
                or t.is_neg() or t.is_conj()):
            return None
        return self.key(t), t.get_device(), t.is_contiguous()

    def stream(self, t) -> int:
        return self.current_stream_here(t.get_device())

    def current_stream(self, t, device: int) -> int | None:
        return self.current_stream_here(device) if t.is_cuda and t.get_device() == device else None

    def current_stream_here(self, device: int) -> int:
        if self._current is None:  # (then every GPU tensor is exported at every use, its export naming the stream)
            raise AttributeError("this PyTorch build names no current CUDA stream")
        return self._current(device) or 1  # 0: the default stream, which is the legacy one


class CupyProbe(_StreamedProbe):
    def __init__(self, cupy):
        super().__init__(cupy)
        self._current, self._device = cupy.cuda.get_current_stream, cupy.cuda.runtime.getDevice

    @staticmethod
    def key(a) -> tuple:
        return a.data.ptr, a.shape, a.strides, a.dtype

    def view(self, a):
        return self.key(a), a.device.id, a.flags.c_contiguous

    def stream(self, a) -> int:
        # As CuPy's interface names it: the current device's current stream, 1 for the null one.
        return self._current().ptr or 1

    def current_stream(self, a, device: int) -> int | None:
        return self.current_stream_here(device) if a.device.id == device else None

    def current_stream_here(self, device: int) -> int | None:
        return self.stream(None) if self._device() == device else None


class JaxProbe:
    lasting_views = False  # JAX orders its reads of an outside array once, at its import
    immutable = True

    def __init__(self, jax):
        self.element_types: dict = {}
        # Memos by value: layout -> plain row-major?; sharding -> its one GPU's index, or -1 (a.device: 0.5 us).
        self._row_major: dict = {}
        self._device_of: dict = {}

    @staticmethod
    def key(a) -> tuple:
        # No strides: the view reads the layout. unsafe_buffer_pointer raises for a deleted (e.g. donated)
        # array, whose memory may hold another by now, and for one over several devices.
        return a.unsafe_buffer_pointer(), a.shape, None, a.dtype

    def view(self, a):
        # Only a finished, plainly row-major array in one GPU's memory: a pending write needs the export to order
        # it (JAX names no stream). is_deleted first: is_ready and layout on a deleted array crash the process.
        try:
            if a.is_deleted() or not a.is_ready():
                return None
            # (a private name: JAX's public a.format costs 2.4 us a call, its layout object 0.3)
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
        """Its DLPack export, under which JAX will not donate the buffer (raises if its computation failed)."""
        return a.__dlpack__()

    @staticmethod
    def _is_row_major(a) -> bool:
        """Through the public format (about 2.4 us; hence the memo)."""
        public = a.format.layout
        return (tuple(public.major_to_minor) == tuple(range(len(a.shape))) and not public.tiling
                and not public.sub_byte_element_size_in_bits)

    @staticmethod
    def _gpu_of(a, sharding) -> int:
        """The GPU index a's export would name, or -1 where it names no GPU's own memory (CPU, pinned host)."""
        if len(sharding.device_set) != 1:
            return -1
        kind, index = a.__dlpack_device__()
        return index if kind in _GPU_MEMORY else -1

    # stream(a), current_stream(a, device), current_stream_here(device): JAX names no stream.
    stream = current_stream = current_stream_here = staticmethod(lambda *_: None)


_GPU_MEMORY = (2, 10)  # DLPack's kDLCUDA, kDLROCM


def foreign_stream_handle(stream) -> int | None:
    """The runtime handle of a foreign stream=: an int, CuPy's `.ptr` or PyTorch's `.cuda_stream`; else None."""
    for handle in (stream, getattr(stream, "ptr", None), getattr(stream, "cuda_stream", None)):
        if isinstance(handle, int) and not isinstance(handle, bool):
            return handle
    return None


def _remember(memo: dict, key, value):
    """memo[key] = value, returned; emptied past 64 entries, for builds whose objects are not shared."""
    if len(memo) > 64:
        memo.clear()
    memo[key] = value
    return value


# Top module of an array type -> (the library's module, whether obj is one of its arrays, the probe).
_KNOWN = {"torch": ("torch", lambda torch, obj: type(obj) is torch.Tensor or type(obj) is torch.nn.Parameter,
                    TorchProbe),
          # (a subclass of CuPy's ndarray keeps its memory and stream attributes: no wrapper type there)
          "cupy": ("cupy", lambda cupy, obj: isinstance(obj, cupy.ndarray), CupyProbe),
          "jaxlib": ("jax", lambda jax, obj: isinstance(obj, jax.Array), JaxProbe)}
_by_type: dict[type, object] = {}  # every type asked about: its probe, or None
_disowned: set = set()  # types whose probe answered otherwise than their protocol, or raised


def probe_for(obj):
    """The probe for obj's type, or None (a type no probe knows, or one a probe failed for)."""
    return None if type(obj) in _disowned else stream_source(obj)


def stream_source(obj):
    """The probe that knows the current stream of obj's library, or None; unlike probe_for, also for a
    disowned type (AllToAll(stream="current") follows the library whatever one odd array did)."""
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
    except AttributeError:  # a build without what the probe reads
        probe = None
    _by_type[kind] = probe
    return probe


def disown(obj) -> None:
    """obj's probe disagreed with the protocol or raised: describe its type through the protocol from now on."""
    _disowned.add(type(obj))
