"""Plot a training run's throughput and data wait over time from its sample logs.

    python jobs/plot_run.py --storage-path runs/demo/storage --name demo-run [-o run.png]
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from lance_ray import storage
from lance_ray.audit import timeline


def plot(run_dir: str | Path, out: Path, window: int = 5, gap_s: float = 5.0) -> Path:
    """Rows/s (over ``window`` steps) and the slowest rank's data wait, per logged step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = timeline(storage.join(run_dir, "samples"))
    t0 = points[0][0]
    times = [t - t0 for t, _, _ in points]
    rates = []
    for i in range(len(points)):
        lo = max(0, i - window)
        span = points[i][0] - points[lo][0]
        rates.append(sum(n for _, n, _ in points[lo + 1 : i + 1]) / span if span > 0 else 0.0)
    waits = [w * 1000 for _, _, w in points]
    # Break the lines where the run was down (restarts, resizes) instead of bridging them.
    for i in reversed(range(1, len(times))):
        if times[i] - times[i - 1] > gap_s:
            for series in (times, rates, waits):
                series.insert(i, math.nan)
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(8, 5))
    top.plot(times, rates, marker=".")
    top.set_ylabel("samples/s (all ranks)")
    bottom.plot(times, waits, color="tab:red", marker=".")
    bottom.set_ylabel("data wait per step (ms)")
    bottom.set_xlabel("seconds since the first logged step (gaps: restarts and resizes)")
    top.set_title(f"run {storage.basename(run_dir)}: {len(points)} logged steps")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--storage-path", default="runs/demo/storage")
    p.add_argument("--name", default="demo-run")
    p.add_argument("-o", "--out", default=None)
    args = p.parse_args()
    run_dir = storage.join(storage.absolute(args.storage_path), args.name)
    if args.out is None and storage.is_remote(run_dir):
        p.error("the run is on an object store: give a local -o/--out for the PNG")
    out = Path(args.out) if args.out else Path(run_dir) / "run_summary.png"
    print(f"wrote {plot(run_dir, out)}")


if __name__ == "__main__":
    main()
