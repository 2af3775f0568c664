"""The element types pyhipa2a moves: NumPy dtypes, with bfloat16 and fp8 from ml_dtypes."""
from __future__ import annotations

import numpy as np

SUPPORTED = ("float16", "bfloat16")
# fp8 dispatch: e4m3 with a float32 scale per FP8_BLOCK elements; OCP e4m3fn on NVIDIA, e4m3fnuz on MI300X (gfx942).
FP8 = ("float8_e4m3fn", "float8_e4m3fnuz")
FP8_ANY = "float8_e4m3"  # whichever the device uses
FP8_BLOCK = 128
FP8_BY_ARCH = {"gfx942": "float8_e4m3fnuz", "host": None}  # None: either (the host twins emulate both)
# Element types NumPy lacks, by ml_dtypes name (DLPack can spell these; the CUDA array interface cannot).
ML_DTYPES = ("bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz")


def ml_dtype(name: str) -> np.dtype:
    try:
        import ml_dtypes
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(f"{name} needs the ml_dtypes package: pip install ml_dtypes") from e
    return np.dtype(getattr(ml_dtypes, name))


def bfloat16():
    return ml_dtype("bfloat16")


def resolve(dtype) -> np.dtype:
    """A NumPy dtype for "float16", "bfloat16", "float8_e4m3fn", np.float16, ml_dtypes.bfloat16, ..."""
    if isinstance(dtype, str):
        name = "bfloat16" if dtype.lower() == "bf16" else dtype.lower()
        if name in ML_DTYPES:
            return ml_dtype(name)
        if name in ("fp16", "half"):
            return np.dtype(np.float16)
    return np.dtype(dtype)


def check_supported(dtype, what: str) -> np.dtype:
    try:
        d = None if dtype is None else resolve(dtype)  # (np.dtype(None) is float64)
    except TypeError:  # (np.dtype(5): "Cannot interpret '5' as a data type")
        d = None
    if d is None:
        raise TypeError(f"{what} must be one of {', '.join(SUPPORTED)}, not {dtype!r}")
    if d.name not in SUPPORTED:
        raise TypeError(f"{what} must be one of {', '.join(SUPPORTED)}, not {d.name}")
    return d


def _fp8_request(dtype, what: str) -> str | None:
    """The fp8 name asked for ("float8_e4m3", or one of FP8), or None for a dtype that is no fp8."""
    if isinstance(dtype, str) and dtype.lower() == FP8_ANY:
        return FP8_ANY
    try:
        name = resolve(dtype).name
    except TypeError:
        return None
    if name.startswith("float8"):
        if name not in FP8:
            raise TypeError(f"{what}={name}: fp8 dispatch moves e4m3 ({FP8_ANY}, {', '.join(FP8)}), not {name}")
        return name
    return None


def plan_dtypes(in_dtype, dispatch_dtype, out_dtype) -> tuple[np.dtype, np.dtype, np.dtype, str | None]:
    """(dispatch() input, expert_x, combine() 16-bit output dtypes, fp8 name or None); fp8 is given (in_dtype) or
    quantized on the way (dispatch_dtype), and "float8_e4m3" means e4m3fn until fp8_for_arch decides."""
    in_fp8, dispatch_fp8 = _fp8_request(in_dtype, "in_dtype"), _fp8_request(dispatch_dtype, "dispatch_dtype")
    if in_fp8 and dispatch_dtype is not None and in_fp8 != dispatch_fp8:
        raise TypeError(f"in_dtype={in_fp8} is fp8 already: dispatch_dtype must be the same or None, "
                        f"not {dispatch_fp8 or dispatch_dtype!r}")
    fp8 = in_fp8 or dispatch_fp8
    provisional = resolve("float8_e4m3fn" if fp8 == FP8_ANY else fp8) if fp8 else None
    if in_fp8 and out_dtype is None:
        raise TypeError(f"in_dtype={in_fp8}: give out_dtype (float16 or bfloat16), the dtype of combine's "
                        "expert_y and output (combine stays 16-bit)")
    ins = provisional if in_fp8 else check_supported(in_dtype, "in_dtype")
    if fp8:
        moved = provisional
    else:
        moved = ins if dispatch_dtype is None else check_supported(dispatch_dtype, "dispatch_dtype")
        if moved != ins:
            raise TypeError(f"dispatch_dtype={moved.name} differs from in_dtype={ins.name}: dispatch converts "
                            "16-bit x only to fp8")
    out = check_supported(out_dtype if out_dtype is not None else ins, "out_dtype")
    return ins, moved, out, fp8


def fp8_for_arch(requested: str, arch: str) -> np.dtype:
    """The fp8 dtype used for `requested` on `arch`; a clear error where it has no fp8 or the other encoding."""
    if arch.startswith("sm_"):
        native = "float8_e4m3fn"
    elif arch in FP8_BY_ARCH:
        native = FP8_BY_ARCH[arch]
    else:
        raise TypeError(f"fp8 dispatch needs a device with fp8 (MI300X gfx942, NVIDIA sm_89 or newer); "
                        f"this one is {arch}, which has none: use in_dtype float16 or bfloat16")
    if requested == FP8_ANY:
        return resolve(native or "float8_e4m3fn")
    if native is not None and requested != native:
        raise TypeError(f"{requested} is not this device's fp8 ({arch} uses {native}); ask for {native} "
                        f"or {FP8_ANY}")
    return resolve(requested)
