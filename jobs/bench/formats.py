"""How figures are printed: rates, ratios, seconds and configuration labels."""

from __future__ import annotations

from typing import Any

W = 50  # width of the configuration column


def label_of(r: dict[str, Any]) -> str:
    """The configuration's label, with the DataLoader start method when it had to change."""
    method = r.get("start_method") or ""
    return r["config"]["label"] + (" [forkserver]" if method.startswith("forkserver") else "")


def fmt_rate(x: float | None) -> str:
    if not x:
        return "-"
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k"


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"
