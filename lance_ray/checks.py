"""Small argument checks shared by every public entry point, each raising an error that names
the argument and what it must be."""

from __future__ import annotations


def positive_int(name: str, value: object, *, allow_none: bool = False) -> None:
    """Raise a ValueError naming ``name`` unless ``value`` is a positive int (not a bool)."""
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
