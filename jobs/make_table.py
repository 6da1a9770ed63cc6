"""Create a synthetic LanceDB table for demos, tests and benchmarks.

    python jobs/make_table.py --db runs/demo/db --rows 20000 --dim 16

Columns: ``id`` (int64, 0..rows-1), ``label`` (int64), ``x`` (float32) and ``v``
(fixed-size list of ``dim`` float32). Written in ``--fragments`` appends so reads cross
fragments as they do on real tables.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa

logger = logging.getLogger("make_table")


def synthetic_batch(lo: int, hi: int, dim: int, seed: int = 0) -> pa.Table:
    """Rows ``lo .. hi-1``; every value is a pure function of the row id."""
    ids = np.arange(lo, hi, dtype=np.int64)
    rng = np.random.default_rng([seed, lo])
    vectors = rng.standard_normal((hi - lo, dim), dtype=np.float32)
    return pa.table({
        "id": ids,
        "label": ids % 10,
        "x": (ids % 1000).astype(np.float32) / 1000,
        "v": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), dim),
    })


def create_table(db_path: str, name: str = "demo", *, rows: int, dim: int = 16,
                 fragments: int = 4, overwrite: bool = True,
                 batch: Callable[[int, int, int], pa.Table] = synthetic_batch):
    """Create (or replace) table ``name`` in the LanceDB database at ``db_path``: rows
    ``batch(lo, hi, dim)`` written in ``fragments`` appends (the tests' tables pass their own
    ``batch``)."""
    import lancedb

    db = lancedb.connect(db_path)
    if overwrite and name in db.table_names():
        db.drop_table(name)
    bounds = np.linspace(0, rows, fragments + 1).astype(int)
    started = time.monotonic()
    table = None
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        data = batch(int(lo), int(hi), dim)
        table = db.create_table(name, data) if table is None else table
        if table.count_rows() < hi:
            table.add(data)
        logger.info("wrote rows %d..%d (%.0f rows/s)", lo, hi,
                    hi / max(time.monotonic() - started, 1e-9))
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="runs/demo/db", help="LanceDB database directory")
    parser.add_argument("--name", default="demo")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--fragments", type=int, default=4)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    table = create_table(args.db, args.name, rows=args.rows, dim=args.dim,
                         fragments=args.fragments)
    print(f"table {args.name!r} at {args.db}: {table.count_rows()} rows, version {table.version}")


if __name__ == "__main__":
    main()
