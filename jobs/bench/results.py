"""Benchmark results in the shared JSON format that ``python -m jobs.bench.performance``
renders into docs/performance.md: one file per case group, ``<out>/<name>.json``::

    {"name", "title", "machine", "command", "date", "columns", "rows", "notes"}

``rows`` hold plain numbers (rates in rows/s or tokens/s, ratios as floats, seconds, MB) or
strings; the renderer formats them. The committed files are the run history (git log).
"""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path
from typing import Any

DEFAULT_OUT = "docs/bench"


def machine_name(given: str | None = None) -> str:
    """The machine a run is named by: ``given``, ``$LANCE_RAY_BENCH_MACHINE`` or the CPU
    count (``"2-core machine"``)."""
    return given or os.environ.get("LANCE_RAY_BENCH_MACHINE") or \
        f"{os.cpu_count()}-core machine"


def result(name: str, title: str, columns: list[str], rows: list[list[Any]], *,
           command: str, machine: str | None = None, notes: list[str] | None = None
           ) -> dict[str, Any]:
    """One result file's content, dated today (UTC)."""
    if any(len(r) != len(columns) for r in rows):
        raise ValueError(f"{name}: every row needs {len(columns)} cells ({columns})")
    return {"name": name, "title": title, "machine": machine_name(machine), "command": command,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
            "columns": columns, "rows": rows, "notes": notes or []}


def write(out: str | Path, results: list[dict[str, Any]]) -> list[Path]:
    """Write each result to ``out/<name>.json``; the paths written."""
    folder = Path(out)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for r in results:
        path = folder / f"{r['name']}.json"
        path.write_text(json.dumps(r, indent=1) + "\n")
        paths.append(path)
    return paths
