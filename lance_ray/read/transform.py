"""User transforms, run where the reads run; what to do with rows whose transform fails is
decided where the samples are consumed.

Where the reads run (a Ray task, a read thread, a DataLoader worker) a failure is only
recorded: :class:`Failed` for one row (the batch is retried row by row first, so
transforms must be deterministic), :class:`BatchFailed` for a batch under ``"raise"`` or a
broken one-item-per-row contract. The consumer then applies the policy
(:meth:`TransformPolicy.resolve`), so the user's exception keeps its type and message
through Ray and a callable handler runs in the consumer's process.

Policies: ``"raise"``; ``"skip"``, ``"warn"`` or ``callable(exc) -> bool`` (True skips) drop a
failed row from its split as ``lancedb.streaming`` does (the split's next row takes its
place; see ``survivors``); ``"keep_slot"`` leaves it out of its batch but counts its slot,
so every rank yields the same number of steps (:class:`Skipped`); ``"fill"`` delivers
``fill_value`` in its place.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import pickle
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from .items import ItemColumns, as_columns

logger = logging.getLogger(__name__)

Transform = Callable[[pa.RecordBatch], Sequence[Any]]
ErrorPolicy = str | Callable[[Exception], bool]
POLICIES = ("raise", "skip", "warn", "fill", "keep_slot")
TRANSFORM_READ_ROWS = 1024


class Skipped:
    """Stands in for a sample left out under ``"keep_slot"`` (its slot still counts)."""

    __slots__ = ("error",)

    def __init__(self, error: str):
        self.error = error

    def __repr__(self) -> str:
        return f"Skipped({self.error!r})"


class Failed:
    """A row whose transform raised ``error``; the consumer applies the policy."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


class BatchFailed(Failed):
    """The transform of a whole read failed and must be raised when the read is due."""


def _rebuilt(kind: type[BaseException], args: tuple[Any, ...],
             state: dict[str, Any]) -> BaseException:
    error = kind.__new__(kind)
    error.args = args
    error.__dict__.update(state)
    return error


class _ByParts:
    """An exception that does not pickle as it is (its ``__init__`` takes other arguments
    than its ``args``), sent as its type, args and attributes and rebuilt as that type
    across the process boundary, so a handler's ``isinstance`` still holds."""

    def __init__(self, error: BaseException):
        self.parts = (type(error), error.args, dict(getattr(error, "__dict__", {})))

    def __reduce__(self) -> tuple[Any, ...]:
        return _rebuilt, self.parts


def portable(error: BaseException) -> Any:
    """``error`` if it survives pickling (to cross a process), else the same exception sent
    by its parts, else a RuntimeError carrying its type and message."""
    pickler: Any = pickle
    with contextlib.suppress(ImportError):  # what Ray itself pickles with, when it is there
        from ray import cloudpickle as pickler
    for sent in (error, _ByParts(error)):
        with contextlib.suppress(Exception):
            pickler.loads(pickler.dumps(sent))
            return sent
    out = RuntimeError(f"{type(error).__qualname__}: {error}")
    out.add_note("lance_ray: the transform's exception cannot be pickled, so it was "
                 "re-raised as this RuntimeError")
    return out


def portable_items(items: list[Any]) -> list[Any]:
    """``items`` ready to cross a process: failures carry picklable exceptions."""
    return [type(x)(portable(x.error)) if isinstance(x, Failed) else x for x in items]


def check_policy(on_error: object) -> None:
    if on_error not in POLICIES and not callable(on_error):
        raise ValueError(
            f"on_transform_error must be one of {POLICIES} or a callable(exception) -> bool "
            f"(True skips the row), got {on_error!r}"
        )


class BrokenContract(Exception):
    """The transform's output breaks the one-item-per-row contract (never skipped)."""


def _run(transform: Transform, batch: pa.RecordBatch) -> list[Any]:
    """The transform's items for ``batch``. Its own exceptions propagate, also those raised
    while its output is iterated (a generator's); a broken contract raises
    :class:`BrokenContract`, whose cause is the error to report."""
    out = transform(batch)
    if isinstance(out, (pa.RecordBatch, pa.Table)):
        # A ValueError, as lancedb.streaming raises (it counts the columns as items).
        raise BrokenContract() from ValueError(
            f"transform returned a {type(out).__name__} of {out.num_rows} rows for a batch of "
            f"{batch.num_rows} rows; a transform must return a sequence with one item per "
            "row (e.g. batch.to_pylist())")
    if not isinstance(out, Iterable):
        raise BrokenContract() from TypeError(
            f"transform must return a sequence with one item per row, got {type(out).__name__}")
    items = list(out)
    if len(items) != batch.num_rows:
        raise BrokenContract() from _count_error(len(items), batch.num_rows)
    return items


def _count_error(items: int, rows: int) -> ValueError:
    return ValueError(
        f"transform returned {items} items for a batch of {rows} rows; a transform "
        "must return exactly one item per input row (one output row per input row): "
        "filter rows with the `filter` argument, or raise in the transform and use "
        "on_transform_error='skip'"
    )


@dataclass(frozen=True)
class TransformPolicy:
    """A picklable transform plus what to do when it raises."""

    transform: Transform
    on_error: ErrorPolicy = "raise"
    fill_value: Any = None

    @property
    def drops_rows(self) -> bool:
        """True when a failed row leaves its split (the reference's skip semantics)."""
        return self.on_error in ("skip", "warn") or callable(self.on_error)

    def __call__(self, batch: pa.RecordBatch) -> list[Any]:
        """One item per row, failures recorded (never raised): runs where reads run."""
        try:
            try:
                return _run(self.transform, batch)
            except BrokenContract:
                raise  # never skipped
            except Exception:
                if self.on_error == "raise":
                    raise
                return [self._one(batch.slice(i, 1)) for i in range(batch.num_rows)]
        except BrokenContract as e:
            return [BatchFailed(e.__cause__ or e)] + [None] * (batch.num_rows - 1)
        except Exception as e:
            return [BatchFailed(e)] + [None] * (batch.num_rows - 1)

    def read_rows(self, read_batch_size: int) -> int:
        """Most rows per read that this transform runs on.

        A transformed read is one unit of work for a core (a read thread, a loader
        worker's read): at most ``TRANSFORM_READ_ROWS`` rows, so every core has one to the
        end of a short epoch and the first batch waits for one small unit; a take's fixed
        cost is small next to a transform's per-row cost. (A Ray task's fixed cost is not:
        the Ray reader joins consecutive reads into tasks by their measured cost,
        ``RayDataReader.tasks``.)
        """
        return min(read_batch_size, TRANSFORM_READ_ROWS)

    def columns(self, batch: pa.RecordBatch) -> tuple[ItemColumns | list[Any], str]:
        """The items of ``batch`` as columns when they have a tensor form, else as a list
        and why not (see :mod:`~lance_ray.read.items`); failures recorded, never raised."""
        items = self(batch)
        return as_columns(items, failed=any(isinstance(x, Failed) for x in items))

    def _one(self, row: pa.RecordBatch) -> Any:
        try:
            return _run(self.transform, row)[0]
        except BrokenContract:
            raise
        except Exception as e:
            return Failed(e)

    def resolve(self, items: list[Any], where: Callable[[int, int], str]) -> list[Any]:
        """Apply the policy to one read's items, in the consumer's process.

        Raises the transform's own exception (with a note from ``where(start, stop)``, the
        rows it came from) under ``"raise"``, for a broken contract, or when a callable
        handler returns False. Failed rows become ``fill_value``, :class:`Skipped`
        (``"keep_slot"``) or stay :class:`Failed` (dropped later by the interleaver).
        """
        if items and isinstance(items[0], BatchFailed):
            raise _noted(items[0].error, where(0, len(items)))
        failed = [i for i, x in enumerate(items) if isinstance(x, Failed)]
        if not failed:
            return items
        if callable(self.on_error):
            for i in failed:
                error = items[i].error
                if not self.on_error(error):  # type: ignore[operator]
                    raise _noted(error, where(i, i + 1))
        if self.on_error == "warn":
            logger.warning("Skipped %d of %d rows whose transform failed (first error: %r)",
                           len(failed), len(items), items[failed[0]].error)
        out = list(items)
        for i in failed:
            if self.on_error == "fill":  # a copy each: the consumer may change it in place
                out[i] = copy.deepcopy(self.fill_value)
            elif self.on_error == "keep_slot":
                out[i] = Skipped(repr(items[i].error))
        return out


def _noted(error: BaseException, note: str) -> BaseException:
    if note not in getattr(error, "__notes__", ()):
        error.add_note(note)
    return error


def make_policy(transform: Transform | None, on_error: ErrorPolicy, fill_value: Any
                ) -> TransformPolicy | None:
    """Validate the transform arguments of a view."""
    check_policy(on_error)
    if transform is None:
        if on_error != "raise":
            raise ValueError("on_transform_error needs a transform: without one nothing can fail")
        return None
    if not callable(transform):
        raise TypeError(f"transform must be callable, got {type(transform).__name__}")
    return TransformPolicy(transform, on_error, fill_value)


def delivered(items: list[Any]) -> tuple[list[Any], int]:
    """The items to hand to the consumer, and how many were skipped."""
    kept = [x for x in items if not isinstance(x, Skipped)]
    return kept, len(items) - len(kept)
