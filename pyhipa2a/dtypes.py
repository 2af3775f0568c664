"""The element types pyhipa2a moves: NumPy dtypes, with bfloat16 from ml_dtypes."""
from __future__ import annotations

import numpy as np

SUPPORTED = ("float16", "bfloat16")


# Element types NumPy lacks, by their ml_dtypes names (DLPack can spell these; the CUDA array
# interface cannot).
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
    if isinstance(dtype, str) and dtype.lower() == "bf16":
        return bfloat16()
    if isinstance(dtype, str) and dtype.lower() in ML_DTYPES:
        return ml_dtype(dtype.lower())
    if isinstance(dtype, str) and dtype.lower() in ("fp16", "half"):
        return np.dtype(np.float16)
    return np.dtype(dtype)


def check_supported(dtype, what: str) -> np.dtype:
    d = resolve(dtype)
    if d.name not in SUPPORTED:
        raise TypeError(f"{what} must be one of {', '.join(SUPPORTED)}, not {d.name}")
    return d
