"""The benchmark's tables, created (or reused) in a subprocess so the driver never opens Lance.

    python -m jobs.bench.tables OUT ROWS BIG_ROWS FRAGMENTS RESULT.json WIDE_ROWS WIDE_BYTES \
        PACK_DOCS

A count of 0 leaves that table out.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from .configs import (
    DIM,
    SPLITS,
)
from .packing import PACK_LEN, PACK_MEAN_LEN, PACK_TABLE, PACK_VOCAB
from .wide import ensure_wide_table


def ensure_table(db: Path, name: str, rows: int, fragments: int,
                 tokens: bool = False) -> dict[str, Any]:
    """Create the table unless an identical one (same rows, dim, fragments) is there; with
    ``tokens`` the packing case's token table (``rows`` documents) and its exact
    ``blocks_per_epoch``."""
    import lancedb

    marker = db / f"{name}.bench.json"
    want: dict[str, Any] = {"rows": rows, "dim": DIM, "fragments": fragments}
    if tokens:
        want = {"rows": rows, "fragments": fragments, "mean_len": PACK_MEAN_LEN,
                "vocab": PACK_VOCAB, "block_len": PACK_LEN}
    conn = lancedb.connect(str(db))
    if marker.exists() and name in conn.table_names():
        got = json.loads(marker.read_text())
        table = conn.open_table(name)
        if {k: got.get(k) for k in want} == want and got.get("version") == table.version \
                and table.count_rows() == rows:
            print(f"reusing table {name!r}: {rows:,} rows, version {table.version}", flush=True)
            return got | {"uri": table.to_lance().uri, "created_s": 0.0}
    from lance_ray.testing.tables import blocks_per_epoch, create_table, synthetic_batch, token_rows

    t = time.perf_counter()
    table = create_table(str(db), name, rows=rows, dim=DIM, fragments=fragments,
                         batch=token_rows(PACK_MEAN_LEN, PACK_VOCAB) if tokens
                         else synthetic_batch)
    took = time.perf_counter() - t
    info = want | {"version": table.version}
    if tokens:
        info["blocks_per_epoch"] = blocks_per_epoch(table.to_lance().uri, PACK_LEN, SPLITS)
    marker.write_text(json.dumps(info))
    print(f"created table {name!r}: {rows:,} rows, {fragments} fragments in {took:.1f}s",
          flush=True)
    return info | {"uri": table.to_lance().uri, "created_s": took}



def main(argv: list[str]) -> None:
    """Write ``{"small", "big", "wide", "tokens": info or None}`` of the ensured tables to
    RESULT (a table of 0 rows is not made)."""
    db, rows, big_rows, fragments, result, wide_rows, wide_bytes, pack_docs = argv
    tables = {"small": ensure_table(Path(db), "bench", int(rows), int(fragments))
              if int(rows) else None,
              "big": ensure_table(Path(db), "bench_big", int(big_rows), int(fragments))
              if int(big_rows) else None,
              "wide": ensure_wide_table(Path(db), "wide", int(wide_rows), int(wide_bytes))
              if int(wide_rows) else None,
              "tokens": ensure_table(Path(db), PACK_TABLE, int(pack_docs), int(fragments),
                                     tokens=True) if int(pack_docs) else None}
    Path(result).write_text(json.dumps(tables))


if __name__ == "__main__":
    main(sys.argv[1:])
