"""How each configuration reads an epoch, and one timed pass over it.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from .configs import (
    BATCH,
    CLUMP,
    SEED,
    SHUFFLES,
    SPLITS,
    TAKE_ROWS,
    Config,
)


@dataclass
class Pass:
    rows: int = 0
    batches: int = 0
    seconds: float = 0.0  # construction to last batch, state_dict() calls excluded
    construct_s: float = 0.0
    first_batch_s: float = 0.0  # construction (+ load_state_dict) to first batch
    first_rows: int = 0  # rows of the first batch
    complete: bool = True  # False when stopped early (row or time cap)
    id_sum: int | None = 0

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    @property
    def steady_rows_per_s(self) -> float:
        """Rows after the first batch over the time after it: throughput without start-up."""
        t = self.seconds - self.first_batch_s
        return (self.rows - self.first_rows) / t if t > 0 else 0.0


@dataclass
class Runner:
    """How to run one configuration: ``make(state)`` returns ``(holder, batch iterator)``."""

    make: Callable[[dict | None], tuple[Any, Iterator[Any]]]
    count: Callable[[Any], int]
    epoch_rows: int
    ids: Callable[[Any], int] | None = None
    state: Callable[[Any], dict] | None = None
    # Ray paths warm up on one whole epoch read to its end: stopping a Ray Data pipeline
    # early kills the workers running its tasks, and a smaller (filtered) table ran fewer
    # tasks than the timed epochs, which then started the other slots' workers themselves.
    warm_whole_epoch: bool = False


def close(it: Any) -> None:
    closer = getattr(it, "close", None) or getattr(it, "_shutdown_workers", None)
    if closer is not None:
        closer()


def timed_pass(runner: Runner, *, state: dict | None = None,
               capture: dict[int, float] | None = None, states: dict[float, dict] | None = None,
               max_rows: int | None = None, max_seconds: float | None = None,
               min_seconds: float = 0.0,
               make: Callable[[dict | None], tuple[Any, Iterator[Any]]] | None = None) -> Pass:
    """One pass: construct, iterate to the end of the epoch or a cap, maybe capture states.

    Stops early once ``max_rows`` rows were read and ``min_seconds`` passed since the first
    batch, or once ``max_seconds`` of the pass have passed.
    """
    gc.collect()
    p = Pass(id_sum=0 if runner.ids is not None else None)
    excluded = 0.0
    start = time.perf_counter()
    holder, it = (make or runner.make)(state)
    p.construct_s = time.perf_counter() - start
    try:
        for batch in it:
            now = time.perf_counter()
            n = runner.count(batch)
            if p.batches == 0:
                p.first_batch_s, p.first_rows = now - start, n
            p.rows += n
            p.batches += 1
            if p.id_sum is not None and runner.ids is not None:
                p.id_sum += runner.ids(batch)
            if capture and p.batches in capture and runner.state is not None:
                t = time.perf_counter()
                states[capture[p.batches]] = runner.state(holder)  # type: ignore[index]
                excluded += time.perf_counter() - t
            elapsed = now - start - excluded
            if (max_rows is not None and p.rows >= max_rows
                    and elapsed - p.first_batch_s >= min_seconds) or (
                    max_seconds is not None and elapsed > max_seconds):
                p.complete = p.rows >= runner.epoch_rows
                break
    finally:
        p.seconds = time.perf_counter() - start - excluded
        close(it)
    return p


def base_runner(spec: dict[str, Any], cfg: Config, mp_context: str | None = None) -> Runner:
    """How a configuration of the base group reads its epoch."""
    clump = SHUFFLES.get(cfg.shuffle)
    rows = spec["rows"]
    epoch_rows = rows - rows % SPLITS
    if cfg.kind == "limit":
        return limit_runner(spec["uri"], cfg.limit or "scan")
    if cfg.kind == "ray_data":
        import ray.data

        def make_ray(state: dict | None) -> tuple[Any, Iterator[Any]]:
            ds = ray.data.read_lance(spec["uri"])
            return ds, iter(ds.iter_torch_batches(batch_size=BATCH))

        return Runner(make_ray, lambda b: len(b["id"]), rows, ids=lambda b: int(b["id"].sum()),
                      warm_whole_epoch=True)

    import lancedb

    table = lancedb.connect(spec["db"]).open_table(spec["table_name"])
    if cfg.kind == "reference":
        from lancedb.streaming import StreamingDataset as Reference
        from torch.utils.data import DataLoader

        def make_ref(state: dict | None) -> tuple[Any, Iterator[Any]]:
            ds = Reference(table, num_splits=SPLITS, shuffle_seed=SEED, shuffle_clump_size=clump)
            if state is not None:
                ds.load_state_dict(state)
            return ds, iter(DataLoader(ds, batch_size=BATCH, num_workers=0))

        return Runner(make_ref, lambda b: len(b["id"]), epoch_rows,
                      ids=lambda b: int(b["id"].sum()), state=lambda ds: ds.state_dict())

    import lance_ray

    loader_kw = {} if mp_context is None else {"multiprocessing_context": mp_context}

    def make_lr(state: dict | None) -> tuple[Any, Iterator[Any]]:
        ds = lance_ray.StreamingDataset(table, num_splits=SPLITS, shuffle_seed=SEED,
                                        shuffle_clump_size=clump, reader=cfg.reader)
        if state is not None:
            ds.load_state_dict(state)
        if cfg.loader_workers is None:
            return ds, ds.iter_batches(BATCH)
        loader = lance_ray.StreamingDataLoader(ds, batch_size=BATCH,
                                               num_workers=cfg.loader_workers, **loader_kw)
        return loader, iter(loader)

    return Runner(make_lr, lambda b: len(b["id"]), epoch_rows, ids=lambda b: int(b["id"].sum()),
                  state=lambda holder: holder.state_dict(),
                  warm_whole_epoch=cfg.needs_ray)


def limit_runner(uri: str, which: str, columns: list[str] | None = None,
                 count: Callable[[Any], int] | None = None, epoch: int | None = None
                 ) -> Runner:
    """Lance's own read paths, no torch: the ceilings the loaders are compared with.

    ``columns``/``count``/``epoch``: what is read, how a read is counted (default: rows)
    and the epoch's count (default: the table's rows)."""
    import lance
    import numpy as np

    ds = lance.dataset(uri)
    n = ds.count_rows()
    count = count or (lambda b: b.num_rows)
    epoch = n if epoch is None else epoch
    if which == "scan":
        def make_scan(state: dict | None) -> tuple[Any, Iterator[Any]]:
            return ds, iter(ds.to_batches(columns=columns, batch_size=TAKE_ROWS))

        return Runner(make_scan, count, epoch)
    row_ids = ds.to_table(columns=[], with_row_id=True).column("_rowid").to_numpy()
    rng = np.random.default_rng(SEED)
    per_call = 4 * TAKE_ROWS if which == "take_random_big" else TAKE_ROWS
    if which.startswith("take_random"):
        order = row_ids[rng.permutation(n)]
    else:  # clumps of CLUMP consecutive rows, in random clump order
        clumps = [row_ids[lo:lo + CLUMP] for lo in range(0, n, CLUMP)]
        order = np.concatenate([clumps[i] for i in rng.permutation(len(clumps))])

    def takes() -> Iterator[Any]:
        for lo in range(0, n, per_call):
            yield ds._take_rows(np.sort(order[lo:lo + per_call]).tolist(), columns=columns)

    def make_take(state: dict | None) -> tuple[Any, Iterator[Any]]:
        return ds, takes()

    return Runner(make_take, count, epoch)

