"""Exact, consumer-side counters of one view, periodic progress logs, and Ray metrics.

Everything here is updated by the consuming thread only, when a batch is handed over, so
the counters are exact (no racy increments from reader threads).
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass, field
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class ViewStats:
    """What one view has delivered since it was created."""

    rows: int = 0  # sample slots delivered (skipped samples included)
    batches: int = 0
    bytes: int = 0  # Arrow bytes delivered (0 for transformed items)
    rows_skipped: int = 0  # samples whose transform failed and that were left out
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


class Meter:
    """Records each delivered batch: counters, a log line every ``every_s``, Ray metrics."""

    def __init__(self, stats: ViewStats, rank: int, every_s: float = 30.0):
        self.stats, self.rank, self.every_s = stats, rank, every_s
        self._next_log = time.monotonic() + every_s
        self._metrics: _RayMetrics | None = None

    def record(self, rows: int, nbytes: int, skipped: int, wait_s: float, *, batches: int,
               epoch: int, position: int, total: int) -> None:
        s = self.stats
        s.rows += rows
        s.batches += batches
        s.bytes += nbytes
        s.rows_skipped += skipped
        s.wait_s += wait_s
        s.last_wait_s = wait_s
        if self._metrics is None:
            self._metrics = _RayMetrics.create()
        if self._metrics is not None:
            self._metrics.record(self.rank, rows, wait_s, s.rows_per_s)
        now = time.monotonic()
        if total and now >= self._next_log:
            self._next_log = now + self.every_s
            logger.info("rank %d epoch %d: %d/%d samples (%.1f%%), %.0f rows/s, waited %.1fs "
                        "for data, %d skipped", self.rank, epoch, position, total,
                        100.0 * position / max(total, 1), s.rows_per_s, s.wait_s,
                        s.rows_skipped)


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
        try:
            import ray

            return cls() if ray.is_initialized() else None
        except Exception:  # metrics are best-effort; never break training for them
            logger.debug("Ray metrics unavailable", exc_info=True)
            return None

    def record(self, rank: int, rows: int, wait_s: float, rate: float) -> None:
        tags = {"rank": str(rank)}
        if rows > 0:  # Ray counters refuse increments of 0
            self.rows.inc(rows, tags=tags)
        self.wait.observe(wait_s, tags=tags)
        self.rate.set(rate, tags=tags)
