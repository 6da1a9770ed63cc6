"""Argument checks the jobs share: an argparse ``type=`` for sizes, and the check of a run's
world sizes, splits and global batch that every training job makes before it starts Ray."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse ``type=``: an integer > 0 (argparse names the option in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    """argparse ``type=``: an integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or a positive integer, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """argparse ``type=``: a finite number >= 0 (seconds)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be 0 or a positive number, got {text}")
    return value


def check_run_sizes(workers: int | tuple[int, int], num_splits: int,
                    global_batch: int | None, *,
                    workers_from: str = "--workers") -> None:
    """Exit with a message naming the options unless ``workers`` (an int, or ``(min, max)``
    for an elastic run: ``--min-workers``, ``--workers``), ``num_splits`` and
    ``global_batch`` (None: not checked) are positive, min <= max, every world size in the
    range divides ``num_splits`` and ``global_batch`` is a multiple of it
    (``lt.check_world_sizes``).
    ``workers_from`` names where the world sizes come from, for a job without --workers."""
    lo, hi = (workers, workers) if isinstance(workers, int) else workers
    for flag, value in (("--min-workers" if lo != hi else workers_from, lo), (workers_from, hi),
                        ("--num-splits", num_splits), ("--global-batch", global_batch)):
        if value is not None and value <= 0:
            raise SystemExit(f"{flag} must be a positive integer, got {value}")
    if lo > hi:
        raise SystemExit(f"--min-workers ({lo}) is more than --workers ({hi}): an elastic run "
                         "takes world sizes from --min-workers up to --workers")
    import lance_ray.train as lt  # here: make_table needs no torch or Ray Train

    try:
        lt.check_world_sizes(workers, num_splits, global_batch)
    except ValueError as e:
        raise SystemExit(f"{workers_from}/--num-splits/--global-batch: {e}") from None
