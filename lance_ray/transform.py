"""User transforms, run where the reads run, with a policy for rows whose transform fails.

The policy never changes how many sample slots a batch has: a failed row is either
replaced (``"fill"``) or marked :class:`Skipped` and left out of the delivered batch while
its slot still counts as consumed. So every rank yields the same number of steps whatever
fails where (synchronous DDP cannot hang), and checkpoints stay exact.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

logger = logging.getLogger(__name__)

Transform = Callable[[pa.RecordBatch], Sequence[Any]]
ErrorPolicy = str | Callable[[Exception], bool]
POLICIES = ("raise", "skip", "warn", "fill")


class Skipped:
    """Stands in for a sample whose transform failed under ``"skip"``/``"warn"``."""

    __slots__ = ("error",)

    def __init__(self, error: str):
        self.error = error

    def __repr__(self) -> str:
        return f"Skipped({self.error!r})"


def check_policy(on_error: object) -> None:
    if on_error not in POLICIES and not callable(on_error):
        raise ValueError(
            f"on_transform_error must be one of {POLICIES} or a callable(exception) -> bool "
            f"(True skips the row), got {on_error!r}"
        )


def _items(out: object, rows: int) -> list[Any]:
    try:
        items = list(out)  # type: ignore[call-overload]
    except TypeError as e:
        raise TypeError(
            f"transform must return a sequence with one item per row, got {type(out).__name__}"
        ) from e
    if len(items) != rows:
        raise ValueError(
            f"transform returned {len(items)} items for a batch of {rows} rows; a transform "
            "must return exactly one item per input row (filter rows with the `filter` "
            "argument instead of dropping them in the transform)"
        )
    return items


@dataclass(frozen=True)
class TransformPolicy:
    """A picklable transform plus what to do when it raises."""

    transform: Transform
    on_error: ErrorPolicy = "raise"
    fill_value: Any = None

    def __call__(self, batch: pa.RecordBatch) -> list[Any]:
        try:
            out = self.transform(batch)
        except Exception:
            if self.on_error == "raise":
                raise
            # Find the failing rows one at a time; transforms must therefore be deterministic.
            return [self._one(batch.slice(i, 1)) for i in range(batch.num_rows)]
        return _items(out, batch.num_rows)  # a broken contract is never skipped

    def _one(self, row: pa.RecordBatch) -> Any:
        try:
            out = self.transform(row)
        except Exception as e:
            if callable(self.on_error) and not self.on_error(e):
                raise
            if self.on_error == "warn":
                logger.warning("transform failed on a row, skipping it: %r", e)
            return self.fill_value if self.on_error == "fill" else Skipped(repr(e))
        return _items(out, 1)[0]


def delivered(items: list[Any]) -> tuple[list[Any], int]:
    """The items to hand to the consumer, and how many were skipped."""
    kept = [x for x in items if not isinstance(x, Skipped)]
    return kept, len(items) - len(kept)
