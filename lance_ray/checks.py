"""Small argument checks shared by every public entry point, each raising an error that names
the argument and what it must be."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, ParamSpec, TypeGuard, TypeVar

import numpy as np

P = ParamSpec("P")
R = TypeVar("R")


def python_scalars(value: Any) -> Any:
    """``value`` with numpy's scalars as Python's (``np.int64(4)`` is ``4``), inside dicts,
    lists and tuples too. Configs and counters are often computed with numpy, and what
    reaches a checkpoint must stay plain JSON."""
    if isinstance(value, np.generic):
        return value.item()
    if type(value) is dict:
        return {python_scalars(k): python_scalars(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(python_scalars(v) for v in value)
    return value


def numpy_scalars_accepted(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn`` taking numpy's scalars wherever it takes Python's, as ``lancedb.streaming``
    does (each argument passes through :func:`python_scalars`)."""
    @functools.wraps(fn)
    def plain(*args: P.args, **kwargs: P.kwargs) -> R:
        return fn(*(python_scalars(a) for a in args),  # type: ignore[arg-type]
                  **{k: python_scalars(v) for k, v in kwargs.items()})  # type: ignore[arg-type]
    return plain


def is_int(value: object) -> TypeGuard[int]:
    """An int that is not a bool (``True`` is an int to Python, never a count to us)."""
    return isinstance(value, int) and not isinstance(value, bool)


def positive_int(name: str, value: object, *, allow_none: bool = False) -> None:
    """Raise a ValueError naming ``name`` unless ``value`` is a positive int (not a bool)."""
    if value is None and allow_none:
        return
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def non_negative_int(name: str, value: object) -> int:
    """``value``, if it is an int >= 0 (not a bool); else a ValueError naming ``name``."""
    if not is_int(value) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    return value


def positive_or_default(name: str, value: object) -> None:
    """Raise unless ``value`` is None (the default) or a positive int, in the words of
    ``lancedb.streaming``'s own checks."""
    if value is not None and (not is_int(value) or value <= 0):
        raise ValueError(f"{name} must be greater than 0 (or None for the default), "
                         f"got {value!r}")
