"""Exact, consumer-side counters of one view, periodic progress logs, and Ray metrics.

Everything here is updated by the consuming thread only, when a batch is handed over, so
the counters are exact (no racy increments from reader threads).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from ..read.requests import ReadCost

logger = logging.getLogger(__name__)


@dataclass
class ViewStats:
    """What one view has delivered since it was created."""

    rows: int = 0  # sample slots delivered (skipped samples included)
    batches: int = 0
    bytes: int = 0  # Arrow bytes read for the delivered samples, before any transform
    rows_skipped: int = 0  # samples whose transform failed and that were left out
    tokens_left_out: int = 0  # packed mode: tokens past a split's block budget (per epoch)
    fetch_s: float = 0.0  # read time of the delivered samples (summed over read threads)
    transform_s: float = 0.0  # transform (or Arrow conversion) time of the same
    wait_s: float = 0.0  # time the consumer waited for data
    last_wait_s: float = 0.0  # ... for the latest batch
    started: float = field(default_factory=time.monotonic)

    @property
    def rows_per_s(self) -> float:
        elapsed = time.monotonic() - self.started
        return self.rows / elapsed if elapsed > 0 else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        del out["started"]
        out["rows_per_s"] = self.rows_per_s
        return out


def progress_bar(done: int, total: int, width: int = 20) -> str:
    """A text bar (``[#####-----]``): plain characters survive any log capture."""
    filled = width * done // total if total > 0 else width
    return "[" + "#" * filled + "-" * (width - filled) + "]"


@dataclass
class Gauge:
    """Rows of the running iterator by stage, counted by the consumer's thread only.

    ``requested`` rows were handed to the reader (threads or Ray Data), ``received`` came
    back to the consumer, ``taken`` left the consumer's buffer (yielded, or dropped after a
    failed transform); ``delivered`` counts the samples yielded.
    """

    active: bool = False
    total: int = 0
    requested: int = 0
    received: int = 0
    taken: int = 0
    delivered: int = 0

    def start(self, total: int) -> None:
        self.active, self.total = True, total
        self.requested = self.received = self.taken = self.delivered = 0

    def stop(self) -> None:
        self.active = False


class Meter:
    """Records each delivery: exact counters at once; a log line every ``every_s`` and Ray
    metrics at most once a second (so recording one row at a time stays cheap)."""

    def __init__(self, stats: ViewStats, rank: int, every_s: float = 30.0):
        self.stats, self.rank, self.every_s = stats, rank, every_s
        self._next_log = time.monotonic() + every_s
        self._next_flush = 0.0
        self._unflushed_rows, self._unflushed_wait = 0, 0.0
        self._metrics: _RayMetrics | None = None

    def record(self, rows: int, cost: ReadCost, skipped: int, wait_s: float, *, batches: int,
               where: Callable[[], str]) -> None:
        """Count a delivery; ``where`` describes the position, for the periodic log line."""
        s = self.stats
        s.rows += rows
        s.batches += batches
        s.bytes += cost.nbytes
        s.fetch_s += cost.fetch_s
        s.transform_s += cost.transform_s
        s.rows_skipped += skipped
        s.wait_s += wait_s
        if batches:
            s.last_wait_s = wait_s
        self._unflushed_rows += rows
        self._unflushed_wait += wait_s
        now = time.monotonic()
        if now >= self._next_flush:
            self._next_flush = now + 1.0
            self._flush()
        if now >= self._next_log:
            self._next_log = now + self.every_s
            logger.info("rank %d %s: %.0f rows/s, waited %.1fs for data, %d skipped",
                        self.rank, where(), s.rows_per_s, s.wait_s, s.rows_skipped)

    def _flush(self) -> None:
        if self._metrics is None:
            self._metrics = _RayMetrics.create()
        if self._metrics is not None:
            self._metrics.record(self.rank, self._unflushed_rows, self._unflushed_wait,
                                 self.stats.rows_per_s)
        self._unflushed_rows, self._unflushed_wait = 0, 0.0


class _RayMetrics:
    """``ray.util.metrics`` for the dashboard; absent when Ray is not connected."""

    def __init__(self) -> None:
        from ray.util import metrics

        tags = ("rank",)
        self.rows = metrics.Counter("lance_ray_rows", "Samples delivered to the trainer",
                                    tag_keys=tags)
        self.wait = metrics.Histogram("lance_ray_data_wait_seconds",
                                      "Time the trainer waited for a batch",
                                      boundaries=[0.001, 0.01, 0.1, 1.0, 10.0], tag_keys=tags)
        self.rate = metrics.Gauge("lance_ray_rows_per_second", "Delivery rate", tag_keys=tags)

    @classmethod
    def create(cls) -> _RayMetrics | None:
        # Never import Ray here: not imported means not connected, and importing it would
        # cost a view without a cluster 1-3 s at its first batch.
        ray = sys.modules.get("ray")
        try:
            return cls() if ray is not None and ray.is_initialized() else None
        except Exception:  # metrics are best-effort; never break training for them
            logger.debug("Ray metrics unavailable", exc_info=True)
            return None

    def record(self, rank: int, rows: int, wait_s: float, rate: float) -> None:
        tags = {"rank": str(rank)}
        if rows > 0:  # Ray counters refuse increments of 0
            self.rows.inc(rows, tags=tags)
        self.wait.observe(wait_s, tags=tags)
        self.rate.set(rate, tags=tags)
