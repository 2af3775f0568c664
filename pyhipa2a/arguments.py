"""Checks that every face of the library (AllToAll, CollectiveMatmul, the heap) applies to its parameters and to the
PYHIPA2A_* variables: a value of the wrong kind, or out of range, raises a TypeError or ValueError naming it,
where a coercion (int(2.7) == 2, bool("no") is True) would have taken it."""
from __future__ import annotations

import math
import numbers
import os

import numpy as np


def is_int(value) -> bool:
    """Whether `value` is an int, Python's or NumPy's (a bool is not one here)."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def checked_int(name: str, value, least: int | None = None) -> int:
    """`value` as an int, at least `least` where given."""
    if not is_int(value):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if least is not None and value < least:
        raise ValueError(f"{name} must be >= {least}; got {value}")
    return int(value)


def checked_bool(name: str, value) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool, not {type(value).__name__}")
    return bool(value)


def checked_timeout(value) -> float:
    """Seconds a wait for a peer may take: a finite number above 0 (NaN or infinity would wait for ever)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"timeout must be a number of seconds, not {type(value).__name__}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"timeout must be a finite number of seconds above 0; got {value!r}")
    return float(value)


def env_int(name: str, default: int | None = None) -> int | None:
    """Environment variable `name` as an int (`default` when unset or empty)."""
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} must be an integer") from None


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """Environment variable `name`, one of `choices` (the first when unset or empty), or ValueError."""
    choice = os.environ.get(name) or choices[0]
    if choice not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {choice!r}")
    return choice
