"""``python -m jobs.bench.mixing``: a three-source mixture against one table of the same rows.

Both read ``--rows`` rows of the same shape (``id`` and a fixed-size list of ``--dim``
floats): one table, or three tables of 70/20/10 % of them mixed 7:2:1 (so the mixture's
epoch is the whole of every source). Runs alternate (one, mixture, one, mixture, ...) so
both see the same machine; the figures are medians. Writes ``<out>/mixing.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")

import lancedb
import numpy as np
import pyarrow as pa

import lance_ray

WEIGHTS = (7, 2, 1)


def make_table(db: Any, name: str, rows: int, dim: int) -> Any:
    rng = np.random.default_rng(len(name))
    v = rng.normal(size=(rows, dim)).astype(np.float32)
    return db.create_table(name, pa.table({
        "id": np.arange(rows, dtype=np.int64),
        "v": pa.FixedSizeListArray.from_arrays(pa.array(v.ravel()), dim)}))


def timed_epoch(make: Any, batch_size: int) -> tuple[float, float, int, float]:
    """(seconds to the first batch, including the view's construction; rows/s after it;
    rows; CPU seconds of this process, all its threads, for the whole epoch)."""
    cpu = time.process_time()
    started = time.perf_counter()
    ds = make()
    it = iter(ds.iter_batches(batch_size))
    rows = len(next(it)["id"])
    first = time.perf_counter() - started
    after = time.perf_counter()
    for batch in it:
        rows += len(batch["id"])
    rate = (rows - batch_size) / (time.perf_counter() - after)
    return first, rate, rows, time.process_time() - cpu


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=400_000)
    p.add_argument("--dim", type=int, default=32)
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--num-splits", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--reader", default="local")
    p.add_argument("--machine", default="2-core dev VM")
    p.add_argument("--out", default="docs/bench")
    args = p.parse_args(argv)
    root = tempfile.mkdtemp(prefix="bench-mixing-")
    db = lancedb.connect(root)
    one = make_table(db, "one", args.rows, args.dim)
    parts = [make_table(db, name, args.rows * w // sum(WEIGHTS), args.dim)
             for name, w in zip(("web", "code", "math"), WEIGHTS)]
    plan = {"num_splits": args.num_splits, "shuffle_seed": 0, "columns": ["id", "v"],
            "reader": args.reader}

    def single() -> Any:
        return lance_ray.StreamingDataset(one, **plan)

    def mixture() -> Any:
        return lance_ray.MixtureDataset(
            [lance_ray.Source(t, weight=w) for t, w in zip(parts, WEIGHTS)], **plan)

    rows = []
    for batch_size in args.batch_sizes:
        runs: dict[str, list[tuple[float, float, int, float]]] = {"one table": [],
                                                                   "mixture": []}
        for _ in range(args.repeats):
            runs["one table"].append(timed_epoch(single, batch_size))
            runs["mixture"].append(timed_epoch(mixture, batch_size))
        med = {k: (statistics.median(r[0] for r in v), statistics.median(r[1] for r in v),
                   v[0][2], statistics.median(r[3] for r in v)) for k, v in runs.items()}
        base = med["one table"]
        rows += [[case, batch_size, n, round(first, 3), round(rate), round(rate / base[1], 3),
                  round(first / base[0], 3), round(cpu * 1e5 / n, 4), round(cpu / base[3], 3)]
                 for case, (first, rate, n, cpu) in med.items()]
    result = {
        "name": "mixing",
        "title": "Weighted mixture of three tables (7:2:1) against one table of the same rows",
        "machine": args.machine,
        "command": "python -m jobs.bench.mixing",
        "date": datetime.date.today().isoformat(),
        "columns": ["case", "batch", "rows", "first batch s", "rows/s", "rows/s vs one table",
                    "first batch vs one table", "CPU s per 100k rows", "CPU vs one table"],
        "rows": rows,
        "notes": [
            f"{args.rows} rows of id + {args.dim} float32, "
            f"num_splits {args.num_splits}, reader={args.reader}; medians of "
            f"{args.repeats} alternating runs, side by side on one machine.",
            "On a shared machine wall-clock ratios swing both ways; the CPU columns (this "
            "process's CPU time, all threads, per epoch) are the steadier measure of the "
            "mixture's own cost.",
            "First batch includes building the views' plans: the mixture builds three, at "
            "once, and waits for the first read of each source.",
            "One table's batches are views of its reads; a mixture batch is one copy (each "
            "source's rows written to their steps' places), so its cost per batch is fixed "
            "and larger batches hide it.",
        ],
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "mixing.json").write_text(json.dumps(result, indent=1) + "\n")
    for row in rows:
        print(dict(zip(result["columns"], row)))
    return result


if __name__ == "__main__":
    main()
