"""Command-line interface: inspect checkpoints, preview plans, watch a coordinator, merge states.

Run ``lance-ray-streaming --help`` (or ``python -m lance_ray --help``). Every command takes
``--json`` for machine-readable output. Errors caused by the input (a missing file, invalid
JSON, an invalid or unmergeable state, a bad table URI or filter) are reported as one line
on stderr with exit code 2; an unexpected internal error exits with 1 (``--traceback``
shows it in full).

Heavy dependencies (Lance, Ray, matplotlib) are imported only by the commands that need
them.

One module per command (``inspect_state``, ``plan``, ``status``, ``merge``), the text helpers
they share (``text``) and the parser (``main``).
"""

from __future__ import annotations

from .inspect_state import PNG_MAGIC, plot_state, print_state_summary, summarize_state
from .main import build_parser, main
from .merge import cmd_merge
from .plan import describe_plan, print_plan
from .status import fetch_status, print_status
from .text import CliError, read_state_file

__all__ = [
    "PNG_MAGIC", "CliError", "build_parser", "cmd_merge", "describe_plan", "fetch_status",
    "main", "plot_state", "print_plan", "print_state_summary", "print_status",
    "read_state_file", "summarize_state",
]
