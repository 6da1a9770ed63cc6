"""``plan``: the split plan a dataset with these arguments would read."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from ..topology import valid_world_sizes
from .text import (
    EXIT_OK,
    emit_json,
    print_fields,
)


def _clump_stats(table: Any, plan: Any, rows: int, clump_size: int,
                 filter: str | None) -> dict[str, Any]:
    """How the plan cuts the filtered rows into clumps.

    lancedb's builder forms clumps of ``clump_size`` consecutive rows (in row-id order,
    after the filter), shuffles the clumps and deals them out to splits; a clump may be
    cut where one split ends and the next begins. ``runs`` counts the contiguous pieces of
    clumps in the plan.
    """
    import numpy as np

    scan = table.open_lance().to_table(columns=[], with_row_id=True, filter=filter)
    ordered = np.sort(scan["_rowid"].to_numpy())
    clump_of = np.searchsorted(ordered, plan.row_ids) // clump_size  # (splits, split_len)
    runs = int((np.diff(clump_of, axis=1) != 0).sum()) + int(clump_of.shape[0])
    clumps = math.ceil(rows / clump_size)
    planned = int(plan.row_ids.size)
    return {
        "clump_size": clump_size,
        "clumps": clumps,
        "rows_per_clump": clump_size,
        "last_clump_rows": rows - (clumps - 1) * clump_size,
        "clumps_in_plan": int(np.unique(clump_of).size),
        "runs_in_plan": runs,
        "mean_rows_per_run": planned / runs if runs else 0.0,
        "clumps_per_split": runs / plan.spec.num_splits,
    }


def _no_dataset_hint(uri: str) -> str:
    """A hint naming the tables of a LanceDB database directory given instead of a table."""
    path = Path(uri)
    if path.is_dir():
        tables = sorted(p.name for p in path.glob("*.lance") if p.is_dir())
        if tables:
            return f" (it looks like a LanceDB database; tables: {', '.join(tables)})"
    return ""


def describe_plan(
    table: str,
    *,
    num_splits: int,
    shuffle: bool = True,
    shuffle_seed: int = 0,
    epoch: int = 0,
    shuffle_clump_size: int | None = None,
    filter: str | None = None,
    table_version: int | None = None,
    plan: str = "lancedb",
) -> dict[str, Any]:
    """Build the plan a ``StreamingDataset`` with these arguments would read, and describe it.

    Raises ``ValueError`` for invalid arguments, a missing table or version, or a bad filter.
    """
    from ..plan.resolve import resolve_plan
    from ..plan.sources import plan_for

    try:
        resolved = resolve_plan(table, num_splits=num_splits, shuffle=shuffle,
                                shuffle_seed=shuffle_seed, epoch=epoch,
                                shuffle_clump_size=shuffle_clump_size, filter=filter, plan=plan,
                                table_version=table_version)
    except ValueError as e:
        raise ValueError(f"{e}{_no_dataset_hint(table)}") from e
    ref, spec, rows = resolved.table, resolved.spec, resolved.rows
    seed = spec.shuffle_seed
    built = plan_for(ref, spec, rows)
    out: dict[str, Any] = {
        "plan": plan,
        "table": ref.uri,
        "table_version": ref.version,
        "filter": filter,
        "rows": rows,
        "num_splits": num_splits,
        "split_len": built.split_len,
        "epoch_rows": built.split_len * num_splits,
        "dropped_rows": built.dropped_rows,
        "shuffle": shuffle,
        "shuffle_seed": seed,
        "epoch": epoch,
        "shuffle_clump_size": shuffle_clump_size,
        "valid_world_sizes": valid_world_sizes(num_splits),
        "plan_fingerprint": built.fingerprint,
        "clumps": None,
    }
    if shuffle_clump_size is not None and shuffle and built.row_ids is not None:
        out["clumps"] = _clump_stats(ref, built, rows, shuffle_clump_size, filter)
    return out


def print_plan(p: dict[str, Any]) -> None:
    """Print ``describe_plan``'s result for a human."""
    order = (f"shuffled, seed {p['shuffle_seed']}, epoch {p['epoch']}" if p["shuffle"]
             else f"sequential (no shuffle), epoch {p['epoch']}")
    fields: list[tuple[str, object]] = [
        ("table", f"{p['table']} (version {p['table_version']})"),
        ("filter", "none" if p["filter"] is None else repr(p["filter"])),
        ("rows", f"{p['rows']} after filter"),
        ("num_splits", p["num_splits"]),
        ("split_len", f"{p['split_len']} (epoch rows {p['epoch_rows']})"),
        ("dropped tail", f"{p['dropped_rows']} rows per epoch (rows mod num_splits)"),
        ("order", order),
        ("plan mode", p["plan"]),
        ("world sizes", ", ".join(map(str, p["valid_world_sizes"]))),
        ("fingerprint", p["plan_fingerprint"]),
    ]
    c = p["clumps"]
    if c is not None:
        last = (f", last one {c['last_clump_rows']}" if c["last_clump_rows"] != c["clump_size"]
                else "")
        fields += [
            ("clumps", f"{c['clumps']} of {c['rows_per_clump']} rows{last}"),
            ("clump runs", f"{c['runs_in_plan']} contiguous runs in the plan, "
             f"{c['clumps_per_split']:.1f} per split, {c['mean_rows_per_run']:.1f} rows per run "
             "(clumps are cut at split boundaries)"),
        ]
    elif p["shuffle_clump_size"] is not None and not p["shuffle"]:
        fields.append(("clumps", "clump size has no effect without shuffle"))
    elif p["shuffle_clump_size"] is not None:  # the index plan keeps no list of row ids
        fields.append(("clumps", f"of {p['shuffle_clump_size']} rows (run statistics are "
                       "given for plan='lancedb' only)"))
    print_fields(fields)


def cmd_plan(args: argparse.Namespace) -> int:
    """``plan TABLE --num-splits N ...``."""
    p = describe_plan(args.table, num_splits=args.num_splits, shuffle=not args.no_shuffle,
                      shuffle_seed=args.shuffle_seed, epoch=args.epoch,
                      shuffle_clump_size=args.clump_size, filter=args.filter,
                      table_version=args.table_version, plan=args.plan)
    if args.json:
        emit_json(p)
    else:
        print_plan(p)
    return EXIT_OK

