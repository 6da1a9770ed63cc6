"""The benchmark's tables, created (or reused) in a subprocess so the driver never opens Lance.

    python -m jobs.bench.tables OUT ROWS BIG_ROWS FRAGMENTS RESULT.json WIDE_ROWS WIDE_BYTES
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from .configs import (
    DIM,
)
from .wide import ensure_wide_table


def ensure_table(db: Path, name: str, rows: int, fragments: int) -> dict[str, Any]:
    """Create the table unless an identical one (same rows, dim, fragments) is there."""
    import lancedb

    marker = db / f"{name}.bench.json"
    want = {"rows": rows, "dim": DIM, "fragments": fragments}
    conn = lancedb.connect(str(db))
    if marker.exists() and name in conn.table_names():
        got = json.loads(marker.read_text())
        table = conn.open_table(name)
        if {k: got.get(k) for k in want} == want and got.get("version") == table.version \
                and table.count_rows() == rows:
            print(f"reusing table {name!r}: {rows:,} rows, dim {DIM}, version {table.version}",
                  flush=True)
            return got | {"uri": table.to_lance().uri, "created_s": 0.0}
    from jobs.make_table import create_table

    t = time.perf_counter()
    table = create_table(str(db), name, rows=rows, dim=DIM, fragments=fragments)
    took = time.perf_counter() - t
    info = want | {"version": table.version}
    marker.write_text(json.dumps(info))
    print(f"created table {name!r}: {rows:,} rows, dim {DIM}, {fragments} fragments in "
          f"{took:.1f}s", flush=True)
    return info | {"uri": table.to_lance().uri, "created_s": took}



def main(argv: list[str]) -> None:
    """Write ``{"small": info, "big": info or None, "wide": info or None}`` of the ensured
    tables to RESULT."""
    db, rows, big_rows, fragments, result, wide_rows, wide_bytes = argv
    tables = {"small": ensure_table(Path(db), "bench", int(rows), int(fragments)),
              "big": ensure_table(Path(db), "bench_big", int(big_rows), int(fragments))
              if int(big_rows) else None,
              "wide": ensure_wide_table(Path(db), "wide", int(wide_rows), int(wide_bytes))
              if int(wide_rows) else None}
    Path(result).write_text(json.dumps(tables))


if __name__ == "__main__":
    main(sys.argv[1:])
