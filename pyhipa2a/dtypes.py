"""The element types pyhipa2a moves: NumPy dtypes, with bfloat16 from ml_dtypes."""
from __future__ import annotations

import numpy as np

SUPPORTED = ("float16", "bfloat16")


def bfloat16():
    try:
        import ml_dtypes
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("bfloat16 needs the ml_dtypes package: pip install ml_dtypes") from e
    return np.dtype(ml_dtypes.bfloat16)


def resolve(dtype) -> np.dtype:
    """A NumPy dtype for "float16", "bfloat16", np.float16, ml_dtypes.bfloat16, ..."""
    if isinstance(dtype, str) and dtype.lower() in ("bfloat16", "bf16"):
        return bfloat16()
    if isinstance(dtype, str) and dtype.lower() in ("fp16", "half"):
        return np.dtype(np.float16)
    return np.dtype(dtype)


def check_supported(dtype, what: str) -> np.dtype:
    d = resolve(dtype)
    if d.name not in SUPPORTED:
        raise TypeError(f"{what} must be one of {', '.join(SUPPORTED)}, not {d.name}")
    return d
