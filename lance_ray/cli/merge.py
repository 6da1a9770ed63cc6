"""``merge``: per-rank states of one step into one state."""

from __future__ import annotations

import argparse
import json

from ..state.format import EXTRA_KEY
from ..state.jsonio import save_state
from ..state.merge import merge_state_dicts
from .text import (
    EXIT_OK,
    CliError,
    emit_json,
    one_line,
    read_state_file,
)


def cmd_merge(args: argparse.Namespace) -> int:
    """``merge STATE... [-o OUT]``."""
    states = [read_state_file(p) for p in args.states]
    try:
        merged = merge_state_dicts(states)
    except (ValueError, TypeError) as e:
        raise CliError(f"cannot merge {len(states)} state(s): {one_line(e)}") from e
    if args.output is None:
        print(json.dumps(merged, sort_keys=True, indent=None if args.json else 2))
        return EXIT_OK
    save_state(args.output, merged)
    extra = merged.get(EXTRA_KEY) or {}
    report = {"output": args.output, "inputs": list(args.states), "epoch": merged["epoch"],
              "num_splits": merged["num_splits"], "global_step": extra.get("global_step"),
              "total_consumed": sum(merged["samples_consumed_per_split"])}
    if args.json:
        emit_json(report)
    else:
        print(f"merged {len(states)} states (epoch {report['epoch']}, global step "
              f"{report['global_step']}, {report['total_consumed']} samples consumed over "
              f"{report['num_splits']} splits) into {args.output}")
    return EXIT_OK

