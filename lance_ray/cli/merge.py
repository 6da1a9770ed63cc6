"""``merge``: per-rank states of one step into one state."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ..state.format import EXTRA_KEY
from ..state.jsonio import save_state
from ..state.merge import merge_state_dicts
from ..state.mixture import MIX_KEY, is_mixture
from .text import (
    EXIT_OK,
    CliError,
    emit_json,
    one_line,
    read_state_file,
)


def cmd_merge(args: argparse.Namespace) -> int:
    """``merge STATE... [-o OUT]``."""
    states = [read_state_file(p, any_mode=True) for p in args.states]
    try:
        merged = merge_state_dicts(states)
    except (ValueError, TypeError) as e:
        raise CliError(f"cannot merge {len(states)} state(s): {one_line(e)}") from e
    if args.output is None:
        print(json.dumps(merged, sort_keys=True, indent=None if args.json else 2))
        return EXIT_OK
    try:
        save_state(args.output, merged)
    except OSError as e:  # the message would name the temporary file written first
        raise CliError(f"cannot write {args.output!r}: {e.strerror or e}") from e
    report = {"output": args.output, "inputs": list(args.states), **_summary(merged)}
    if args.json:
        emit_json(report)
    else:
        print(f"merged {len(states)} states (epoch {report['epoch']}, global step "
              f"{report['global_step']}, {report['total_consumed']} samples consumed over "
              f"{report['num_splits']} splits) into {args.output}")
    return EXIT_OK



def _summary(state: dict[str, Any]) -> dict[str, Any]:
    """Epoch, global step, samples consumed and splits of a merged state of any mode (a
    mixture's: summed over its sources)."""
    if is_mixture(state):
        mix = state[MIX_KEY]
        parts = [_summary(source) for source in state["sources"]]
        return {"epoch": mix["epoch"], "global_step": mix["global_step"],
                "total_consumed": sum(p["total_consumed"] for p in parts),
                "num_splits": mix["num_splits"]}  # every source's, the mixture's
    extra = state.get(EXTRA_KEY) or {}
    return {"epoch": state["epoch"], "num_splits": state["num_splits"],
            "global_step": extra.get("global_step"),
            "total_consumed": sum(state["samples_consumed_per_split"])}
