"""``inspect``: what a checkpoint state holds and where it can resume."""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from ..state import format as st
from ..topology import rank_splits, valid_world_sizes
from .text import (
    EXIT_OK,
    CliError,
    emit_json,
    percent,
    print_fields,
    print_table,
    ranges,
    read_state_file,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MAX_TABLE_ROWS = 32  # inspect's per-split table is grouped to at most this many rows
MAX_BARS = 512  # above this many splits, --png draws a step curve instead of bars


def summarize_state(state: dict[str, Any]) -> dict[str, Any]:
    """Everything ``inspect`` reports about a checkpoint state, as plain JSON-able data.

    ``kind`` is ``"rank"`` (one rank's own state of a multi-rank run: exact on its owned
    splits only), ``"lockstep"`` (a rank's state whose other splits follow from its own, the
    same on every rank: resumable anywhere), ``"merged"`` (covers every split: a merged state
    or a 1-rank run's state) or ``"unknown"`` (a ``lancedb.streaming`` reference-format state,
    whose owners are not recorded). Raises ``ValueError``/``TypeError`` for an invalid state.
    """
    progress = st.parse_state(state)
    extra = state.get(st.EXTRA_KEY) or {}
    num_splits = state["num_splits"]
    split_len = extra.get("split_len")
    samples, positions = list(progress.samples), list(progress.positions)
    owned: list[int] | None = None
    if not extra:
        kind = "unknown"
    elif progress.lockstep:
        kind = "lockstep"
    elif progress.rank is not None and not progress.is_complete:
        kind = "rank"
        owned = rank_splits(progress.rank, progress.world_size or 1, num_splits)
    else:
        kind = "merged"
    epoch_rows = split_len * num_splits if isinstance(split_len, int) else None
    total = sum(samples)
    sizes = valid_world_sizes(num_splits)
    sizes_text = ", ".join(map(str, sizes))
    if kind == "rank":
        resumable: list[int] = []
        note = (f"this is rank {progress.rank}'s own state of a {progress.world_size}-rank run: "
                f"only rank {progress.rank} of {progress.world_size} can resume from it as is; "
                f"merge the states of all {progress.world_size} ranks (saved at the same step) "
                f"first, then resume on any of: {sizes_text}")
    elif kind == "lockstep":
        resumable = sizes
        note = (f"any of: {sizes_text} (a rank's own state: the other ranks' splits follow "
                "from its own, as every rank delivered as many samples)")
    elif kind == "unknown":
        resumable = sizes
        note = (f"any of: {sizes_text} (reference-format state: if it is one rank's state of a "
                "multi-rank run, merge all ranks' states first)")
    else:
        resumable = sizes
        note = f"any of: {sizes_text}"
    finished: bool | None = None
    if isinstance(split_len, int):
        exact = owned if owned is not None else range(num_splits)
        finished = all(samples[k] >= split_len for k in exact)
    return {
        "format": "lance_ray" if extra else "lancedb.streaming",
        "format_version": extra.get("format_version"),
        "kind": kind,
        "rank": progress.rank,
        "world_size": progress.world_size,
        "owned_splits": owned,
        "epoch": state["epoch"],
        "shuffle_seed": state["shuffle_seed"],
        "num_splits": num_splits,
        "table_version": extra.get("table_version"),
        "plan_fingerprint": extra.get("plan_fingerprint"),
        "split_len": split_len,
        "shuffle": extra.get("shuffle"),
        "filter": extra.get("filter"),
        "shuffle_clump_size": extra.get("shuffle_clump_size"),
        "plan": extra.get("plan", "lancedb") if extra else None,
        "global_step": progress.global_step,
        "samples_consumed_per_split": samples,
        "positions_consumed_per_split": positions,
        "total_consumed": total,
        "owned_consumed": None if owned is None else sum(samples[k] for k in owned),
        "epoch_rows": epoch_rows,
        "fraction_consumed": (total / epoch_rows) if epoch_rows and kind != "rank" else None,
        "epoch_finished": finished,
        "resumable_world_sizes": resumable,
        "must_merge": kind == "rank",
        "resume": note,
    }


def _kind_text(s: dict[str, Any]) -> str:
    if s["kind"] == "rank":
        return (f"single rank: rank {s['rank']} of a {s['world_size']}-rank run "
                f"(exact on its splits {ranges(s['owned_splits'])} only)")
    if s["kind"] == "lockstep":
        return (f"lockstep: any rank's state of a {s['world_size']}-rank run (every rank "
                "writes this one); the other ranks' splits follow from its own")
    if s["kind"] == "merged":
        if s["world_size"] == 1:
            return "complete: the state of a 1-rank run (covers every split)"
        return f"merged: covers every split (saved by a {s['world_size']}-rank run)"
    return "unknown: lancedb.streaming reference format (no owner or step information)"


def _split_groups(s: dict[str, Any], *, contiguous: bool) -> list[list[int]]:
    """Splits grouped by identical (samples, positions, owned): runs of consecutive splits
    when ``contiguous``, else every split with that progress (ordered by progress)."""
    samples, positions = s["samples_consumed_per_split"], s["positions_consumed_per_split"]
    owned = set(s["owned_splits"] or ())

    def key(k: int) -> tuple[bool, int, int]:
        return k not in owned, samples[k], positions[k]

    groups: dict[Any, list[int]] = {}
    for k in range(len(samples)):
        last = groups.get(len(groups) - 1) if contiguous else None
        if contiguous:
            if last is not None and key(last[-1]) == key(k):
                last.append(k)
            else:
                groups[len(groups)] = [k]
        else:
            groups.setdefault(key(k), []).append(k)
    if contiguous:
        return list(groups.values())
    return [groups[g] for g in sorted(groups)]


def _split_rows(s: dict[str, Any], groups: list[list[int]]) -> list[list[object]]:
    """One table row per group of splits."""
    samples, positions = s["samples_consumed_per_split"], s["positions_consumed_per_split"]
    owned = set(s["owned_splits"] or ())
    split_len = s["split_len"]
    rows: list[list[object]] = []
    for splits in groups:
        k = splits[0]
        row: list[object] = [ranges(splits, limit=40), samples[k], positions[k]]
        if split_len is not None:
            row += [split_len, percent(samples[k], split_len)]
        if s["kind"] == "rank":
            row.append("this rank" if k in owned else "other rank (lower bound)")
        rows.append(row)
    return rows


def _print_splits(s: dict[str, Any], show_all: bool) -> None:
    """The per-split table: compact (grouped, at most MAX_TABLE_ROWS rows) unless ``show_all``."""
    header = ["splits", "samples", "positions"]
    if s["split_len"] is not None:
        header += ["split_len", "done"]
    if s["kind"] == "rank":
        header.append("progress of")
    text_columns = int(s["kind"] == "rank")
    groups = _split_groups(s, contiguous=True)
    if show_all or len(groups) <= MAX_TABLE_ROWS:
        print_table(header, _split_rows(s, groups), text_columns)
        return
    groups = _split_groups(s, contiguous=False)
    if len(groups) <= MAX_TABLE_ROWS:
        print_table(header, _split_rows(s, groups), text_columns)
    else:
        for name in ("samples", "positions"):
            values = sorted(s[f"{name}_consumed_per_split"])
            print(f"{name} per split: min {values[0]}, median {values[len(values) // 2]}, "
                  f"max {values[-1]}")
    print(f"({s['num_splits']} splits in {len(groups)} groups; --all prints every split)")


def print_state_summary(s: dict[str, Any], source: str, *, show_all: bool = False) -> None:
    """Print ``summarize_state``'s result for a human (``show_all``: one row per split)."""
    fp = s["plan_fingerprint"]
    clump = s["shuffle_clump_size"]
    fields: list[tuple[str, object]] = [
        ("checkpoint", source),
        ("format", s["format"] + (f" (format {s['format_version']})"
                                  if s["format_version"] is not None else "")),
        ("state", _kind_text(s)),
        ("epoch", s["epoch"]),
        ("shuffle_seed", s["shuffle_seed"]),
        ("num_splits", s["num_splits"]),
        ("table_version", "unknown" if s["table_version"] is None else s["table_version"]),
        ("plan", "unknown" if fp is None else f"plan={s['plan']!r}, fingerprint {fp}, "
         + ("shuffled" if s["shuffle"] else "sequential")
         + (f", clump size {clump}" if clump is not None else "")
         + (f", filter {s['filter']!r}" if s["filter"] is not None else ", no filter")),
        ("split_len", "unknown" if s["split_len"] is None
         else f"{s['split_len']} (epoch rows {s['epoch_rows']})"),
        ("global_step", "unknown" if s["global_step"] is None else s["global_step"]),
    ]
    print_fields(fields)
    print()
    _print_splits(s, show_all)
    print()
    total = s["total_consumed"]
    if s["kind"] == "rank":
        mine = s["owned_consumed"]
        consumed = f"{mine} by this rank"
        if s["split_len"] is not None:
            own_rows = s["split_len"] * len(s["owned_splits"])
            consumed += f" of its {own_rows} ({percent(mine, own_rows)})"
        consumed += f"; {total} in all splits (a lower bound)"
    else:
        consumed = str(total) + (f" of {s['epoch_rows']} ({percent(total, s['epoch_rows'])})"
                                 if s["epoch_rows"] else "")
    if s["epoch_finished"] and s["kind"] == "rank":
        consumed += "; this rank's splits are finished"
    elif s["epoch_finished"]:
        consumed += f"; epoch finished (resuming starts epoch {s['epoch'] + 1})"
    print_fields([("total consumed", consumed), ("resume on", s["resume"])])


def plot_state(s: dict[str, Any], out: str | os.PathLike[str], *, title: str = "") -> None:
    """Write a bar chart of samples consumed per split (``summarize_state``'s result) as PNG.

    ``title`` (e.g. the file name) is prefixed to the chart's title."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise CliError("--png needs matplotlib: pip install matplotlib") from e
    samples = s["samples_consumed_per_split"]
    n = len(samples)
    owned = set(s["owned_splits"] or range(n))
    fig, ax = plt.subplots(figsize=(min(4 + 0.25 * n, 16), 4.5))
    try:
        xs = list(range(n))
        handles: list[Any] | None
        if n <= MAX_BARS:
            colors = ["tab:blue" if k in owned else "lightgray" for k in xs]
            ax.bar(xs, samples, color=colors, width=0.8, label="samples consumed")
            if s["kind"] == "rank":
                from matplotlib.patches import Patch

                handles = [Patch(color="tab:blue", label=f"rank {s['rank']} (exact)"),
                           Patch(color="lightgray", label="other ranks (lower bound)")]
            else:
                handles = None
        else:
            ax.step(xs, samples, where="mid", color="tab:blue", label="samples consumed")
            handles = None
        if s["split_len"] is not None:
            line = ax.axhline(s["split_len"], color="tab:red", linestyle="--",
                              label=f"split_len = {s['split_len']}")
            if handles is not None:
                handles.append(line)
        ax.set_xlabel("split")
        ax.set_ylabel("samples consumed")
        step = "?" if s["global_step"] is None else s["global_step"]
        of = f" of {s['epoch_rows']}" if s["epoch_rows"] and s["kind"] != "rank" else ""
        ax.set_title(f"{title + ': ' if title else ''}epoch {s['epoch']}, step {step}, "
                     f"{s['total_consumed']}{of} consumed")
        ax.set_ylim(bottom=0, top=max([*samples, s["split_len"] or 0, 1]) * 1.08)
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3,
                  frameon=False)
        fig.tight_layout()
        fig.savefig(out, format="png")
    finally:
        plt.close(fig)


def cmd_inspect(args: argparse.Namespace) -> int:
    """``inspect CHECKPOINT [--png OUT]``."""
    state = read_state_file(args.checkpoint)
    summary = summarize_state(state)
    if args.png:
        plot_state(summary, args.png, title=Path(args.checkpoint).name)
    if args.json:
        emit_json({"path": args.checkpoint, "png": args.png, **summary})
    else:
        print_state_summary(summary, args.checkpoint, show_all=args.all)
        if args.png:
            print(f"wrote {args.png}")
    return EXIT_OK

