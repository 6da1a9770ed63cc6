"""Command-line interface: inspect checkpoints, preview plans, watch a coordinator, merge states.

Run ``lance-ray-streaming --help`` (or ``python -m lance_ray --help``). Every command takes
``--json`` for machine-readable output. Errors caused by the input (a missing file, invalid
JSON, an invalid or unmergeable state, a bad table URI or filter) are reported as one line
on stderr with exit code 2; an unexpected internal error exits with 1 (``--traceback``
shows it in full).

Heavy dependencies (Lance, Ray, matplotlib) are imported only by the commands that need
them.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from . import state as st
from .plan import rank_splits, valid_world_sizes
from .plan_source import DEFAULT_NAMESPACE

PROG = "lance-ray-streaming"
EXIT_OK, EXIT_INTERNAL, EXIT_INPUT = 0, 1, 2
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
MAX_TABLE_ROWS = 32  # inspect's per-split table is grouped to at most this many rows
MAX_BARS = 512  # above this many splits, --png draws a step curve instead of bars


class CliError(Exception):
    """An error caused by the command's input: reported as one line, exit code 2."""


_RUST_LOCATION = re.compile(r",?\s*\S+\.rs:\d+:\d+")


def _one_line(message: object) -> str:
    """``message`` on one line: whitespace runs collapsed, Rust source locations dropped."""
    return " ".join(_RUST_LOCATION.sub("", str(message)).split())


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are a :class:`CliError` (one line, exit 2)."""

    def error(self, message: str) -> Any:  # argparse declares NoReturn
        raise CliError(f"{self.prog}: error: {message} (see --help)")


# --------------------------------------------------------------------------- helpers


def read_state_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read and validate the checkpoint state at ``path``; a :class:`CliError` names the file."""
    name = os.fspath(path)
    try:
        state = st.read_json(path)
    except OSError as e:
        raise CliError(f"cannot read {name!r}: {e.strerror or e}") from e
    except (ValueError, UnicodeDecodeError) as e:  # read_json's message names the file
        raise CliError(_one_line(e)) from e
    try:
        st.parse_state(state)
    except (ValueError, TypeError) as e:
        raise CliError(f"{name!r} is not a valid checkpoint state: {_one_line(e)}") from e
    return state


def _ranges(indices: Sequence[int], limit: int = 0) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``; cut to about ``limit`` characters when set."""
    parts: list[str] = []
    k = 0
    while k < len(indices):
        j = k
        while j + 1 < len(indices) and indices[j + 1] == indices[j] + 1:
            j += 1
        parts.append(str(indices[k]) if j == k else f"{indices[k]}-{indices[j]}")
        k = j + 1
    text = ", ".join(parts)
    if limit and len(text) > limit:
        kept: list[str] = []
        for part in parts:
            if len(", ".join([*kept, part])) > limit:
                break
            kept.append(part)
        text = ", ".join([*kept, "..."]) + f" ({len(indices)} splits)"
    return text


def _percent(part: int, whole: int | None) -> str:
    return "" if not whole else f"{100.0 * part / whole:.1f}%"


def _print_fields(fields: Sequence[tuple[str, object]]) -> None:
    width = max(len(k) for k, _ in fields)
    for key, value in fields:
        print(f"{key:<{width}}  {value}")


def _print_table(header: Sequence[str], rows: Sequence[Sequence[object]],
                 text_columns: int = 0) -> None:
    """Left-align the first column and the last ``text_columns``; right-align numbers."""
    cells = [[str(c) for c in header]] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for row in cells:
        out = []
        for i, cell in enumerate(row):
            left = i == 0 or i >= len(header) - text_columns
            out.append(cell.ljust(widths[i]) if left else cell.rjust(widths[i]))
        print("  ".join(out).rstrip())


def _emit_json(obj: Any) -> None:
    print(json.dumps(obj, sort_keys=True))


# --------------------------------------------------------------------------- inspect


def summarize_state(state: dict[str, Any]) -> dict[str, Any]:
    """Everything ``inspect`` reports about a checkpoint state, as plain JSON-able data.

    ``kind`` is ``"rank"`` (one rank's own state of a multi-rank run: exact on its owned
    splits only), ``"merged"`` (covers every split: a merged state or a 1-rank run's state)
    or ``"unknown"`` (a ``lancedb.streaming`` reference-format state, whose owners are not
    recorded). Raises ``ValueError``/``TypeError`` for an invalid state.
    """
    progress = st.parse_state(state)
    extra = state.get(st.EXTRA_KEY) or {}
    num_splits = state["num_splits"]
    split_len = extra.get("split_len")
    samples, positions = list(progress.samples), list(progress.positions)
    owned: list[int] | None = None
    if not extra:
        kind = "unknown"
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
                f"(exact on its splits {_ranges(s['owned_splits'])} only)")
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
        row: list[object] = [_ranges(splits, limit=40), samples[k], positions[k]]
        if split_len is not None:
            row += [split_len, _percent(samples[k], split_len)]
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
        _print_table(header, _split_rows(s, groups), text_columns)
        return
    groups = _split_groups(s, contiguous=False)
    if len(groups) <= MAX_TABLE_ROWS:
        _print_table(header, _split_rows(s, groups), text_columns)
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
        ("plan", "unknown" if fp is None else f"fingerprint {fp}, "
         + ("shuffled" if s["shuffle"] else "sequential")
         + (f", clump size {clump}" if clump is not None else "")
         + (f", filter {s['filter']!r}" if s["filter"] is not None else ", no filter")),
        ("split_len", "unknown" if s["split_len"] is None
         else f"{s['split_len']} (epoch rows {s['epoch_rows']})"),
        ("global_step", "unknown" if s["global_step"] is None else s["global_step"]),
    ]
    _print_fields(fields)
    print()
    _print_splits(s, show_all)
    print()
    total = s["total_consumed"]
    if s["kind"] == "rank":
        mine = s["owned_consumed"]
        consumed = f"{mine} by this rank"
        if s["split_len"] is not None:
            own_rows = s["split_len"] * len(s["owned_splits"])
            consumed += f" of its {own_rows} ({_percent(mine, own_rows)})"
        consumed += f"; {total} in all splits (a lower bound)"
    else:
        consumed = str(total) + (f" of {s['epoch_rows']} ({_percent(total, s['epoch_rows'])})"
                                 if s["epoch_rows"] else "")
    if s["epoch_finished"] and s["kind"] == "rank":
        consumed += "; this rank's splits are finished"
    elif s["epoch_finished"]:
        consumed += f"; epoch finished (resuming starts epoch {s['epoch'] + 1})"
    _print_fields([("total consumed", consumed), ("resume on", s["resume"])])


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
        _emit_json({"path": args.checkpoint, "png": args.png, **summary})
    else:
        print_state_summary(summary, args.checkpoint, show_all=args.all)
        if args.png:
            print(f"wrote {args.png}")
    return EXIT_OK


# --------------------------------------------------------------------------- plan


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
    from .plan import PlanSpec, check_plan_args
    from .plan_source import plan_for
    from .table import count_rows, resolve_table

    seed = check_plan_args(num_splits=num_splits, shuffle_seed=shuffle_seed, epoch=epoch,
                           shuffle_clump_size=shuffle_clump_size, filter=filter, plan=plan)
    try:
        ref = resolve_table(table, version=table_version)
    except ValueError as e:
        raise ValueError(f"{e}{_no_dataset_hint(table)}") from e
    rows = count_rows(ref, filter, num_splits)
    spec = PlanSpec(ref.version, num_splits, shuffle, seed, epoch, shuffle_clump_size, filter,
                    plan)
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
    elif p["shuffle_clump_size"] is not None:
        fields.append(("clumps", "clump size has no effect without shuffle"))
    _print_fields(fields)


def cmd_plan(args: argparse.Namespace) -> int:
    """``plan TABLE --num-splits N ...``."""
    p = describe_plan(args.table, num_splits=args.num_splits, shuffle=not args.no_shuffle,
                      shuffle_seed=args.shuffle_seed, epoch=args.epoch,
                      shuffle_clump_size=args.clump_size, filter=args.filter,
                      table_version=args.table_version, plan=args.plan)
    if args.json:
        _emit_json(p)
    else:
        print_plan(p)
    return EXIT_OK


# --------------------------------------------------------------------------- status


def _check_reachable(address: str, timeout: float = 3.0) -> None:
    """Fail fast (instead of Ray's minutes of retries) when ``host:port`` does not answer."""
    import socket

    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        return  # "auto", "local" or a form Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise CliError(f"cannot reach a Ray cluster at {address!r}: {e.strerror or e}; check "
                       "--address (the head node's GCS address, e.g. 10.0.0.1:6379)") from e


def fetch_status(name: str, namespace: str, address: str | None = None) -> dict[str, Any]:
    """The status of coordinator ``name``.

    Connects to Ray (``address`` or ``"auto"``) unless this process is connected already
    (then that connection is used), and disconnects again afterwards.
    """
    import ray
    from ray.exceptions import RayError

    from .coordinator import Coordinator

    if address:
        _check_reachable(address)
    connected_here = False
    if not ray.is_initialized():
        target = address or "auto"
        try:
            ray.init(address=target, logging_level=logging.WARNING, log_to_driver=False,
                     configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise CliError(f"cannot connect to a Ray cluster at {target!r}: {_one_line(e)}; "
                           "start one (ray start --head) or pass --address") from e
        connected_here = True
    try:
        try:
            coordinator = Coordinator.get(name, namespace)
        except ValueError as e:
            raise CliError(_one_line(e)) from e
        try:
            status = coordinator.status()
        except RayError as e:
            raise CliError(f"coordinator {name!r} did not answer: {_one_line(e)}") from e
    finally:
        if connected_here:
            ray.shutdown()
    return {"namespace": namespace, **status}


def print_status(s: dict[str, Any]) -> None:
    """Print ``fetch_status``'s result for a human."""
    rows_of = "?" if s.get("epoch_rows") is None else s["epoch_rows"]
    sealed = f"{s['sealed_rows']} / {rows_of}"
    if s.get("epoch_rows"):
        sealed += f" ({_percent(s['sealed_rows'], s['epoch_rows'])})"
    pending = s.get("pending_steps") or []
    _print_fields([
        ("coordinator", f"{s['name']} (namespace {s['namespace']})"),
        ("table_version", s.get("table_version")),
        ("epoch", s["epoch"]),
        ("world size", f"{s['world_size']} ({s['num_splits']} splits)"),
        ("sealed step", s["sealed_step"]),
        ("sealed rows", sealed),
        ("rows/s", f"{s['rows_per_s']:.1f}"),
        ("pending steps", ", ".join(map(str, pending)) if pending else "none"),
    ])
    ranks = s.get("ranks") or {}
    print()
    if ranks:
        _print_table(["rank", "step", "rows"],
                     [[r, v["step"], v["rows"]] for r, v in sorted(ranks.items(),
                                                                  key=lambda kv: int(kv[0]))])
    else:
        print("no rank has reported progress in this epoch yet")


def cmd_status(args: argparse.Namespace) -> int:
    """``status NAME [--namespace NS] [--address ADDR]``."""
    s = fetch_status(args.name, args.namespace, args.address)
    if args.json:
        _emit_json(s)
    else:
        print_status(s)
    return EXIT_OK


# --------------------------------------------------------------------------- merge


def cmd_merge(args: argparse.Namespace) -> int:
    """``merge STATE... [-o OUT]``."""
    states = [read_state_file(p) for p in args.states]
    try:
        merged = st.merge_state_dicts(states)
    except (ValueError, TypeError) as e:
        raise CliError(f"cannot merge {len(states)} state(s): {_one_line(e)}") from e
    if args.output is None:
        print(json.dumps(merged, sort_keys=True, indent=None if args.json else 2))
        return EXIT_OK
    st.save_state(args.output, merged)
    extra = merged.get(st.EXTRA_KEY) or {}
    report = {"output": args.output, "inputs": list(args.states), "epoch": merged["epoch"],
              "num_splits": merged["num_splits"], "global_step": extra.get("global_step"),
              "total_consumed": sum(merged["samples_consumed_per_split"])}
    if args.json:
        _emit_json(report)
    else:
        print(f"merged {len(states)} states (epoch {report['epoch']}, global step "
              f"{report['global_step']}, {report['total_consumed']} samples consumed over "
              f"{report['num_splits']} splits) into {args.output}")
    return EXIT_OK


# --------------------------------------------------------------------------- main


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    """The argument parser of the CLI."""
    common = _Parser(add_help=False)
    common.add_argument("--json", action="store_true", help="print machine-readable JSON")
    parser = _Parser(prog=prog, description="Inspect lance_ray checkpoints and plans, watch "
                     "a running coordinator, merge per-rank states.")
    parser.add_argument("--traceback", action="store_true",
                        help="show the full traceback of an unexpected error")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("inspect", parents=[common], help="describe a checkpoint state file",
                       description="Describe a checkpoint (a rank's, a merged or a "
                       "lancedb.streaming reference-format state).")
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="state JSON file")
    p.add_argument("--png", metavar="OUT.png", help="write a bar chart of per-split progress")
    p.add_argument("--all", action="store_true",
                   help="one table row per split (default: grouped, at most "
                   f"{MAX_TABLE_ROWS} rows)")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("plan", parents=[common], help="describe the split plan of a table",
                       description="Build the split plan a StreamingDataset with these "
                       "arguments would read, and describe it.")
    p.add_argument("table", metavar="TABLE", help="Lance dataset URI, e.g. db/demo.lance")
    p.add_argument("--num-splits", type=int, required=True, metavar="N")
    p.add_argument("--shuffle-seed", type=int, default=0, metavar="S")
    p.add_argument("--epoch", type=int, default=0, metavar="E")
    p.add_argument("--no-shuffle", action="store_true", help="sequential splits")
    p.add_argument("--clump-size", type=int, default=None, metavar="C",
                   help="shuffle_clump_size; also prints clump statistics")
    p.add_argument("--filter", default=None, metavar="SQL", help="SQL row filter")
    p.add_argument("--table-version", type=int, default=None, metavar="V",
                   help="table version (default: the current one)")
    p.add_argument("--plan", choices=("lancedb", "index"), default="lancedb",
                   help="plan mode (index: computed, for tables past lancedb's builder limit)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("status", parents=[common], help="progress of a running coordinator",
                       description="Connect to a running Ray cluster and print the progress "
                       "of a coordinator actor.")
    p.add_argument("name", metavar="NAME", help="coordinator name")
    p.add_argument("--namespace", default=DEFAULT_NAMESPACE,
                   help=f"Ray namespace (default {DEFAULT_NAMESPACE})")
    p.add_argument("--address", default=None, metavar="ADDR",
                   help="Ray cluster address (default: auto)")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("merge", parents=[common], help="merge per-rank state files into one",
                       description="Merge the states of every rank of one run, saved at one "
                       "global step, into one state that resumes on any valid world size.")
    p.add_argument("states", nargs="+", metavar="STATE", help="per-rank state JSON files")
    p.add_argument("-o", "--output", metavar="OUT",
                   help="write the merged state here (default: print it)")
    p.set_defaults(func=cmd_merge)
    return parser


def _configure_logging() -> None:
    """Library warnings (e.g. a legacy or reference-format state) go to stderr, briefly."""
    root = logging.getLogger()
    if not root.handlers:
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                            format=f"{PROG}: %(levelname)s: %(message)s")


def _fail(prog: str, message: object) -> int:
    print(f"{prog}: error: {_one_line(message)}", file=sys.stderr)
    return EXIT_INPUT


def main(argv: Sequence[str] | None = None, *, prog: str = PROG) -> int:
    """Run the CLI on ``argv`` (default ``sys.argv[1:]``); returns the exit code."""
    parser = build_parser(prog)
    try:
        args = parser.parse_args(argv)
    except CliError as e:
        print(_one_line(e), file=sys.stderr)
        return EXIT_INPUT
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else EXIT_OK
    _configure_logging()
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except CliError as e:
        return _fail(prog, e)
    except OSError as e:
        where = f" {e.filename!r}" if getattr(e, "filename", None) else ""
        return _fail(prog, f"{e.strerror or e}{':' + where if where else ''}")
    except (ValueError, TypeError) as e:
        return _fail(prog, e)
    except Exception as e:
        if args.traceback:
            raise
        print(f"{prog}: internal error: {type(e).__name__}: {_one_line(e)} (rerun with "
              "--traceback for details)", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
