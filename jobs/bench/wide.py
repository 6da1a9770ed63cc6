"""The wide-row table: ``id``, ``label`` and ``payload`` (``width`` random bytes per row).

    python -m jobs.bench.wide DB ROWS WIDTH   (made once, reused while rows and width match)

Random bytes do not compress, so a row costs ``width`` bytes on disk and in memory, as an
image or an encoded sample would. Written 1,000 rows at a time (the writer never holds
more than a few MB), in 4 fragments.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

FRAGMENTS = 4
WRITE_ROWS = 1000


def wide_batch(lo: int, hi: int, width: int) -> pa.RecordBatch:
    """Rows ``lo .. hi-1``; every value is a pure function of the row id."""
    ids = np.arange(lo, hi, dtype=np.int64)
    data = np.random.default_rng([1, lo]).integers(0, 256, (hi - lo) * width, dtype=np.uint8)
    offsets = pa.array(np.arange(0, (hi - lo + 1) * width, width, dtype=np.int32))
    payload = pa.BinaryArray.from_buffers(pa.binary(), hi - lo,
                                          [None, offsets.buffers()[1], pa.py_buffer(data)])
    return pa.RecordBatch.from_arrays([pa.array(ids), pa.array(ids % 10), payload],
                                      names=["id", "label", "payload"])


def _batches(lo: int, hi: int, width: int) -> Iterator[pa.RecordBatch]:
    for a in range(lo, hi, WRITE_ROWS):
        yield wide_batch(a, min(a + WRITE_ROWS, hi), width)


def ensure_wide_table(db: Path, name: str, rows: int, width: int) -> dict[str, Any]:
    """Create the table unless one with the same rows and width is there."""
    import lancedb

    marker = db / f"{name}.bench.json"
    want = {"rows": rows, "width": width, "fragments": FRAGMENTS}
    conn = lancedb.connect(str(db))
    names = conn.list_tables().tables
    if marker.exists() and name in names:
        got = json.loads(marker.read_text())
        found = conn.open_table(name)
        if {k: got.get(k) for k in want} == want and got.get("version") == found.version:
            print(f"reusing table {name!r}: {rows:,} rows of {width:,} bytes", flush=True)
            return got | {"uri": found.to_lance().uri, "created_s": 0.0}
    if name in names:
        conn.drop_table(name)
    started = time.perf_counter()
    schema = wide_batch(0, 1, width).schema
    bounds = np.linspace(0, rows, FRAGMENTS + 1).astype(int)
    table = None
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        data = pa.RecordBatchReader.from_batches(schema, _batches(lo, hi, width))
        if table is None:
            table = conn.create_table(name, data)
        else:
            table.add(data)
    assert table is not None
    took = time.perf_counter() - started
    info = want | {"version": table.version}
    marker.write_text(json.dumps(info))
    print(f"created table {name!r}: {rows:,} rows of {width:,} bytes in {took:.0f}s", flush=True)
    return info | {"uri": table.to_lance().uri, "created_s": took}


if __name__ == "__main__":
    ensure_wide_table(Path(sys.argv[1]), "wide", int(sys.argv[2]), int(sys.argv[3]))
