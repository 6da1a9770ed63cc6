"""What every command shares: input errors, state files, plain-text tables and JSON."""

from __future__ import annotations

import argparse
import json
import os
import re
from collections.abc import Sequence
from typing import Any

from ..state import format as st
from ..state.mixture import is_mixture
from ..state.packed import check_state
from ..storage import read_json

PROG = "lance-ray-streaming"
EXIT_OK, EXIT_INTERNAL, EXIT_INPUT = 0, 1, 2


class CliError(Exception):
    """An error caused by the command's input: reported as one line, exit code 2."""


_RUST_LOCATION = re.compile(r",?\s*\S+\.rs:\d+:\d+")


def one_line(message: object) -> str:
    """``message`` on one line: whitespace runs collapsed, Rust source locations dropped."""
    return " ".join(_RUST_LOCATION.sub("", str(message)).split())


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are a :class:`CliError` (one line, exit 2)."""

    def error(self, message: str) -> Any:  # argparse declares NoReturn
        raise CliError(f"{self.prog}: error: {message} (see --help)")


# --------------------------------------------------------------------------- helpers


def read_state_file(path: str | os.PathLike[str], *, any_mode: bool = False) -> dict[str, Any]:
    """Read and validate the checkpoint state at ``path``; a :class:`CliError` names the file.

    ``any_mode``: accept packed and mixture states too (what ``save_state`` writes);
    otherwise only a plain ``StreamingDataset`` state, and the others are refused by name."""
    name = os.fspath(path)
    try:
        state = read_json(path)
    except OSError as e:
        raise CliError(f"cannot read {name!r}: {e.strerror or e}") from e
    except (ValueError, UnicodeDecodeError) as e:  # read_json's message names the file
        raise CliError(one_line(e)) from e
    if not any_mode and is_mixture(state):
        raise CliError(f"{name!r} is a MixtureDataset state: this command reads a "
                       "StreamingDataset's state; load it with MixtureDataset.load_state_dict, "
                       "or pass one of its 'sources' states")
    try:
        (check_state if any_mode else st.parse_state)(state)
    except (ValueError, TypeError) as e:
        raise CliError(f"{name!r} is not a valid checkpoint state: {one_line(e)}") from e
    return state


def ranges(indices: Sequence[int], limit: int = 0) -> str:
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


def percent(part: int, whole: int | None) -> str:
    return "" if not whole else f"{100.0 * part / whole:.1f}%"


def print_fields(fields: Sequence[tuple[str, object]]) -> None:
    width = max(len(k) for k, _ in fields)
    for key, value in fields:
        print(f"{key:<{width}}  {value}")


def print_table(header: Sequence[str], rows: Sequence[Sequence[object]],
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


def emit_json(obj: Any) -> None:
    print(json.dumps(obj, sort_keys=True))

