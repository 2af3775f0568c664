"""Find, load and launch the ahead-of-time device code. Signatures are ctypes types mirroring kernels_hip/'s structs
(same field order and alignment): a launch site builds its arguments once, a launch rewrites what changes."""
from __future__ import annotations

import ctypes
import os
import weakref
from pathlib import Path

from .errors import CodeObjectNotFound

CODE_DIR = Path(__file__).resolve().parent / "_code"
u64, u32, i32, f32 = ctypes.c_uint64, ctypes.c_uint32, ctypes.c_int32, ctypes.c_float


class HeapView(ctypes.Structure):
    _fields_ = [("bases", u64), ("rank", i32), ("world", i32)]

    @classmethod
    def of(cls, heap) -> "HeapView":
        return cls(heap.bases_ptr, heap.rank, heap.world)


class HeapCheckArgs(ctypes.Structure):
    _fields_ = [("heap", HeapView), ("off_slots", u64), ("off_flags", u64), ("off_counter", u64), ("off_status", u64),
                ("off_result", u64), ("words", u32), ("epoch", u32), ("timeout_ns", u64)]


class Divisor(ctypes.Structure):
    """n / d on the device as a multiply and a shift (kernels_hip/exchange.h: quot, rem)."""
    _fields_ = [("mul", u64), ("d", u32), ("shift", u32)]


def divisor(d: int) -> Divisor:
    """With 2^s >= d and mul = ceil(2^(32 + s) / d), ((n * mul) >> 32) >> s == n // d for all n < 2^31: it overshoots
    n / d by under 1 / d, short of the next integer, and n * mul < 2^64. Needs 1 <= d < 2^31."""
    if not 1 <= d < 2**31:
        raise ValueError(f"divisor {d} out of range [1, 2^31)")
    shift = (d - 1).bit_length()
    return Divisor(-(-(1 << (32 + shift)) // d), d, shift)


def timeout_ns(seconds: float) -> int:
    """A timeout in ns, at most 2^62: kernels add it to a clock twice (deadline, poisoner's bound), without wrapping."""
    return int(min(seconds * 1e9, 2.0 ** 62))


class ClockSyncArgs(ctypes.Structure):
    _fields_ = [("heap", HeapView), ("off_box", u64), ("off_stamps", u64), ("off_from0", u64), ("off_done", u64),
                ("off_verdict", u64), ("host_offset", u64), ("rounds", u32), ("epoch", u32), ("timeout_ns", u64)]


class A2AArgs(ctypes.Structure):
    _fields_ = [("heap", HeapView), ("local_base", u64), ("off_tok_hdr", u64), ("off_tok_count", u64),
                ("off_expert_counts", u64), ("off_w_in", u64), ("off_stage_flag", u64), ("off_contrib_flag", u64),
                ("off_stage", u64), ("off_x_stage", u64), ("off_contrib", u64), ("off_push_tok", u64),
                ("off_push_contrib", u64), ("off_recv_x", u64), ("off_recv_meta", u64), ("off_recv_scales", u64),
                ("off_num_tokens", u64), ("off_rows", u64), ("off_slot_of", u64), ("off_layout", u64),
                ("off_expert_totals", u64), ("off_row_starts", u64), ("off_offsets", u64), ("off_group_landed", u64),
                ("off_group_ready", u64), ("off_part_verdict", u64), ("off_work_items", u64), ("off_epoch", u64),
                ("off_status", u64), ("off_done", u64), ("host_status", u64), ("host_offsets", u64), ("prof", u64),
                ("num_experts", i32), ("local_experts", i32), ("top_k", i32), ("max_tokens", i32), ("hidden", i32),
                ("x_row_bytes", u32), ("y_row_bytes", u32), ("seg_elems", u32), ("nseg", u32), ("push_max_tokens", u32),
                ("push_row_words", u32), ("narrow_partials", u32), ("trap_on_timeout", u32), ("token_bytes", u32),
                ("scale_cols", u32), ("x_format", u32), ("fp8_fnuz", u32), ("push_token_words", u32),
                ("x_seg_elems", u32), ("x_nseg", u32), ("route_chunk", u32), ("void_slots", u32),
                ("region_tokens", u32), ("gpu_fence_publish", u32), ("by_source", u32), ("row_align", u32),
                ("recv_rows", u32), ("post_min_tokens", u32), ("combine_send_percent", u32), ("pad", u32),
                ("timeout_ns", u64), ("div_k", Divisor), ("div_L", Divisor), ("div_E", Divisor),
                ("div_x_nseg", Divisor), ("div_chunk", Divisor), ("div_chunks", Divisor), ("div_W", Divisor),
                ("div_peers", Divisor), ("div_nseg", Divisor)]


ROUTE_CHUNK_SLOTS = 512  # about this many slots per dispatch routing block keep blocks short
MAX_ROUTE_CHUNKS = 8  # chunks per call at most, keeping short the per-chunk count tables receivers add up


def route_chunk(top_k: int, max_tokens: int) -> int:
    """Tokens a block routes; a call of max_tokens tokens has at most MAX_ROUTE_CHUNKS chunks."""
    return max(1, ROUTE_CHUNK_SLOTS // top_k, -(-max_tokens // MAX_ROUTE_CHUNKS))


def route_chunks(top_k: int, max_tokens: int) -> int:
    return -(-max_tokens // route_chunk(top_k, max_tokens))


X_COPY, X_FP8, X_QUANTIZE_F16, X_QUANTIZE_BF16 = range(4)  # A2AArgs.x_format: how dispatch makes expert_x (A2A_X_*)
DISPATCH_KERNELS = {X_COPY: "a2a_dispatch", X_FP8: "a2a_dispatch_fp8", X_QUANTIZE_F16: "a2a_dispatch_quantize_f16",
                    X_QUANTIZE_BF16: "a2a_dispatch_quantize_bf16"}


class DispatchCall(ctypes.Structure):
    _fields_ = [("x", u64), ("indices", u64), ("x_scales", u64), ("weights", u64), ("num_tokens", i32), ("groups", u32),
                # check_pairing: 1 where the dispatch before may never have been combined (a JAX program's)
                ("ticket", u32), ("check_pairing", u32),
                # where the outputs land: our own buffers (name_own_outputs), or pyhipa2a.jax's XLA buffers
                ("expert_x", u64), ("expert_meta", u64), ("expert_scales", u64), ("expert_num_tokens", u64),
                ("expert_layout", u64), ("expert_offsets", u64)]


# DispatchCall's outputs and the A2AArgs offsets of our own buffers for them
OWN_OUTPUTS = {"expert_x": "off_recv_x", "expert_meta": "off_recv_meta", "expert_scales": "off_recv_scales",
               "expert_num_tokens": "off_num_tokens", "expert_layout": "off_layout", "expert_offsets": "off_offsets"}


def name_own_outputs(call: DispatchCall, args: A2AArgs) -> None:
    """Point `call`'s outputs at this rank's own buffers (the kernel writes where the call says, so the host
    names ours once, in the packs it launches from; pyhipa2a.jax patches XLA's over them at each call)."""
    for field, offset in OWN_OUTPUTS.items():
        setattr(call, field, args.local_base + getattr(args, offset))


class CombineCall(ctypes.Structure):
    _fields_ = [("expert_y", u64), ("weights", u64), ("out", u64), ("num_tokens", i32), ("expert_scale", f32),
                ("phase", u32), ("groups", u32)]


# CombineCall.phase: the whole combine (0), or after dispatch(groups=G) one of its parts: g + 1 sends the
# contributions of the tokens whose last group here is g, REDUCE_ONLY reduces (kernels_hip/exchange.h).
WHOLE_COMBINE, REDUCE_ONLY = 0, 0xFFFFFFFF
MAX_GROUPS, GROUP_STRIPES = 32, 32  # dispatch(groups=) at most; A2A_MAX_GROUPS, A2A_GROUP_STRIPES


class HierArgs(ctypes.Structure):  # kernels_hip/hier.hip: the steps of a multi-node call around the node's exchange
    _fields_ = [("x", u64), ("indices", u64), ("weights", u64), ("x_scales", u64), ("regions_x", u64),
                ("regions_scales", u64), ("records", u64), ("local_indices", u64), ("local_weights", u64),
                ("sequence", u64), ("status", u64), ("mirror", u64), ("node", i32), ("nodes", i32),
                ("ranks_per_node", i32), ("place", i32), ("tokens", i32), ("max_tokens", i32), ("top_k", i32),
                ("num_experts", i32), ("node_experts", i32), ("x_row_bytes", u32), ("scale_bytes", u32),
                ("record_bytes", u32), ("whole", u32), ("pad", u32)]


class HierSumArgs(ctypes.Structure):
    _fields_ = [("own", u64), ("partials", u64), ("seals", u64), ("out", u64), ("sequence", u64), ("status", u64),
                ("mirror", u64), ("node", i32), ("nodes", i32), ("ranks_per_node", i32), ("place", i32),
                ("tokens", i32), ("max_tokens", i32), ("hidden", i32), ("pad", i32)]


SIGNATURES = {  # kernel name -> (code object, argument types)
    "heap_check": ("heap_check", (HeapCheckArgs,)),
    # the exchange's kernels, each with its twin of calls in groups (kernels_hip/dispatch.hip, combine.hip)
    **{name + twin: ("dispatch", (A2AArgs, DispatchCall)) for twin in ("", "_placed")
       for name in DISPATCH_KERNELS.values()},
    **{name + twin: ("combine", (A2AArgs, CombineCall)) for twin in ("", "_phased")
       for name in ("a2a_combine_f16", "a2a_combine_bf16", "a2a_combine_small_f16", "a2a_combine_small_bf16")},
    **{name: ("hier", (HierArgs,)) for name in ("hier_stage", "hier_localize", "hier_seal")},
    # a kernel of each 16-bit output type
    **{name + out16: signature for out16 in ("_f16", "_bf16") for name, signature in (
        ("expert_scale", ("expert", (u64, u64, u64, u64, u64, u32, u32, u32, u32, u32, f32))),
        ("expert_dequantize", ("expert", (u64, u64, u64, u64, u64, u64, u32, u32, u32, u32, u32, f32, u32))),
        ("hier_sum", ("hier", (HierSumArgs,))),
        ("sum_slots", ("reduce", (u64, u64, u64, u64, u32))))},
    "copy_bytes": ("copy", (u64, u64, u64)),
    "clock_probe": ("clock", (u64,)),
    "clock_sync": ("clock", (ClockSyncArgs,)),
    "nothing": ("copy", ()),
}


def field_addresses(struct: ctypes.Structure, names) -> dict:
    """name -> the host address of that field of `struct` (where a plan's stand-ins write an array's pointer)."""
    return {name: ctypes.addressof(struct) + getattr(type(struct), name).offset for name in names}


class ArgPack:
    """One launch site's arguments: ctypes objects plus the void* array pointing at them."""

    def __init__(self, argtypes):
        self.arguments = tuple(t() for t in argtypes)
        self.kernel_params = (ctypes.c_void_p * len(argtypes))(*(ctypes.addressof(a) for a in self.arguments))
        self.sites = {}  # what a backend keeps per (kernel, geometry) launched from here (CUDA: a one-node graph)

    def copy_from(self, other: "ArgPack") -> None:
        for mine, theirs in zip(self.arguments, other.arguments, strict=True):
            ctypes.memmove(ctypes.addressof(mine), ctypes.addressof(theirs), ctypes.sizeof(theirs))

    def __getitem__(self, i):
        return self.arguments[i]

    def set_scalars(self, *values) -> None:
        for arg, value in zip(self.arguments, values, strict=True):
            arg.value = value


class Kernel:
    def __init__(self, backend, function, name: str, argtypes):
        self.backend, self.function, self.name, self.argtypes = backend, function, name, argtypes
        self.packs = weakref.WeakSet()  # the packs made here, released when the library closes

    def pack(self) -> ArgPack:
        pack = ArgPack(self.argtypes)
        self.packs.add(pack)
        return pack

    def launch(self, pack: ArgPack, grid: int, block: int, stream=None) -> None:
        self.backend.launch(self.function, grid, block, stream, pack)

    def prepare(self, pack: ArgPack, grid: int, block: int) -> None:
        """Make now what the first launch from `pack` on this geometry would (Backend.prepare_launch)."""
        self.backend.prepare_launch(self.function, grid, block, pack)

    def repeater(self, pack: ArgPack, into: ArgPack, grid: int, block: int):
        """launch() with `pack`'s current arguments as a runtime Launcher, the arguments kept in `into` (written only
        here: drop its old repeater)."""
        into.copy_from(pack)
        return self.backend.launcher(self.function, grid, block, into)


def available_code_objects(code_dir: Path, module: str, variant: str = "") -> dict[str, Path]:
    """arch -> path for every built code object of `module` (e.g. {"gfx942": ..., "sm_90": ...})."""
    found = {}
    for path in code_dir.glob(f"{module}{variant}.*"):
        arch = path.name[len(module + variant) + 1:].rsplit(".", 1)[0]
        if "." not in arch:
            found[arch] = path
    return found


def select_code_object(arch: str, available: dict[str, Path], module: str) -> Path:
    """Exact match on AMD; on NVIDIA the newest sm_XY <= the device's (its PTX covers newer GPUs)."""
    if arch in available:
        return available[arch]
    if arch.startswith("sm_"):
        mine = int(arch[3:])
        older = [int(a[3:]) for a in available if a.startswith("sm_") and int(a[3:]) <= mine]
        if older:
            return available[f"sm_{max(older)}"]
    names = ", ".join(sorted(available)) or "none (run `python -m pyhipa2a.build`)"
    raise CodeObjectNotFound(f"no code object of '{module}' for device architecture {arch}; available: {names}")


# Modules shared by a context's libraries for its life (CUDA 13 leaked ~80 KB per load/unload, stress.py --churn),
# keyed by owner (Backend.module_owner), path and file identity, so a rebuilt code object loads afresh.
_SHARED_MODULES: dict[tuple, object] = {}


class KernelLibrary:
    """Loads code objects on first use and hands out `Kernel`s by name."""

    def __init__(self, backend, arch: str, code_dir: Path | None = None, variant: str = ""):
        self.backend, self.arch, self.variant = backend, arch, variant
        self.code_dir = Path(code_dir or os.environ.get("PYHIPA2A_CODE_DIR") or CODE_DIR)
        self._modules: dict[str, object] = {}
        self._own: list = []  # modules this library loaded for itself (no owner to share them with)
        self._kernels: dict[str, Kernel] = {}

    def _load(self, name: str):
        """The context's shared module `name`, or this library's own where there is no owner (the host backend)."""
        if self.backend.code_suffix is None:
            return self._own_module(name.encode())
        path = select_code_object(self.arch, available_code_objects(self.code_dir, name, self.variant), name)
        owner = self.backend.module_owner()
        if owner is None:
            return self._own_module(path.read_bytes())
        stat = path.stat()
        key = (owner, str(path.resolve()), stat.st_size, stat.st_mtime_ns)
        if key not in _SHARED_MODULES:
            _SHARED_MODULES[key] = self.backend.module_load(path.read_bytes())
        return _SHARED_MODULES[key]

    def _own_module(self, image: bytes):
        module = self.backend.module_load(image)
        self._own.append(module)
        return module

    def kernel(self, name: str) -> Kernel:
        if name not in self._kernels:
            module_name, argtypes = SIGNATURES[name]
            if module_name not in self._modules:
                self._modules[module_name] = self._load(module_name)
            function = self.backend.module_function(self._modules[module_name], name)
            self._kernels[name] = Kernel(self.backend, function, name, argtypes)
        return self._kernels[name]

    def close(self) -> None:
        """Unloads the modules this library loaded for itself; shared ones stay for the next library."""
        for kernel in self._kernels.values():
            for pack in list(kernel.packs):
                pack.sites.clear()  # (a CUDA launch site's graph holds the kernel: gone before its module)
        for module in self._own:
            self.backend.module_unload(module)
        self._own.clear()
        self._modules.clear()
        self._kernels.clear()
