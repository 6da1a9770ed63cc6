"""Plot a training run from its sample logs: one segment per attempt (a start of the worker
group), with its world size, the checkpoints it committed, and what ended it.

    python -m jobs.plot_run --storage-path runs/demo/storage --name demo-run [-o run.png]

Top: the global step over time. A restart goes back to the step of the checkpoint it
resumed from, so each attempt is its own line; an attempt that ends early marks its
end (x: a failure; >: a resize, when the next attempt has more workers). Middle: throughput of each
attempt, smoothed over ``--window`` steps within the attempt (never across a restart, so
checkpoint waits and restarts do not show as one-step spikes). Bottom: the slowest rank's
data wait per step; each attempt's first batch (view start-up) is in the legend instead.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lance_ray import storage
from lance_ray.proof.audit import AttemptLog, read_attempt_logs


def smoothed_rate(a: AttemptLog, window: int) -> tuple[list[float], list[float]]:
    """``(times, samples/s)`` over the last ``window`` steps, within one attempt."""
    times, rates = [], []
    for i in range(1, len(a.steps)):
        lo = max(0, i - window)
        span = a.steps[i].t - a.steps[lo].t
        if span > 0:
            times.append(a.steps[i].t)
            rates.append(sum(s.samples for s in a.steps[lo + 1 : i + 1]) / span)
    return times, rates


def transition(prev: AttemptLog, a: AttemptLog) -> str:
    """Why ``a`` started: more workers than before is a resize, anything else a restart."""
    return "resize" if a.attempt.world_size > prev.attempt.world_size else "restart"


def label(i: int, a: AttemptLog) -> str:
    first = a.steps[0].wait_s if a.steps else 0.0
    return (f"attempt {i}: {a.attempt.world_size} workers from step "
            f"{a.attempt.resumed_from_step}; view {a.attempt.view_s:.1f}s + first read "
            f"{first:.1f}s")


def plot(run_dir: str | Path, out: Path, window: int = 10) -> Path:
    """Draw the run in ``run_dir`` into ``out`` (PNG)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    attempts = [a for a in read_attempt_logs(storage.join(run_dir, "samples")) if a.steps]
    if not attempts:
        raise SystemExit(f"{run_dir} has no logged steps")
    t0 = attempts[0].attempt.started
    final_step = max(a.steps[-1].step for a in attempts)
    fig, (steps_ax, rate_ax, wait_ax) = plt.subplots(
        3, 1, sharex=True, figsize=(10, 8), gridspec_kw={"height_ratios": [3, 2, 1.3]})
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, a in enumerate(attempts):
        c = colours[i % len(colours)]
        ts = [s.t - t0 for s in a.steps]
        steps_ax.plot(ts, [s.step for s in a.steps], color=c, label=label(i, a))
        by_step = {s.step: s.t for s in a.steps}
        ck = [(t - t0, s) for s, t in a.checkpoints if s in by_step]
        if ck:
            steps_ax.scatter(*zip(*ck), marker="D", s=18, color=c, zorder=3)
        if i + 1 < len(attempts) and a.steps[-1].step < final_step:
            resized = transition(a, attempts[i + 1]) == "resize"
            steps_ax.scatter([ts[-1]], [a.steps[-1].step], marker=">" if resized else "x",
                             s=60, color="green" if resized else "red", zorder=4)
        if i:
            kind = transition(attempts[i - 1], a)
            for ax in (steps_ax, rate_ax, wait_ax):
                # Shaded: no step was trained (the group was down or starting).
                ax.axvspan(attempts[i - 1].steps[-1].t - t0, ts[0], color="grey", alpha=0.1)
                ax.axvline(a.attempt.started - t0, color="green" if kind == "resize"
                           else "red", ls="--", lw=0.8, alpha=0.6)
            steps_ax.annotate(f"{kind} -> {a.attempt.world_size}w",
                              (a.attempt.started - t0, a.attempt.resumed_from_step),
                              textcoords="offset points", xytext=(3, 6), fontsize=8)
        rt, rates = smoothed_rate(a, window)
        rate_ax.plot([t - t0 for t in rt], rates, color=c)
        wait_ax.plot(ts[1:], [s.wait_s * 1000 for s in a.steps[1:]], color=c, lw=0.8)
    steps_ax.scatter([], [], marker="D", s=18, color="grey", label="checkpoint committed")
    steps_ax.scatter([], [], marker="x", s=60, color="red", label="attempt ended: failure")
    steps_ax.scatter([], [], marker=">", s=60, color="green", label="attempt ended: resize")
    steps_ax.set_ylabel("global step")
    steps_ax.legend(fontsize=7, loc="upper left")
    steps_ax.set_title(f"run {storage.basename(run_dir)}: {len(attempts)} attempt(s), final step "
                       f"{final_step} (dashed: restart red, resize green; shaded: down)")
    rate_ax.set_ylabel(f"samples/s\n({window}-step mean)")
    rate_ax.set_ylim(bottom=0)
    wait_ax.set_ylabel("data wait\nper step (ms)")
    wait_ax.set_xlabel("seconds since the first attempt started")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--storage-path", default="runs/demo/storage")
    p.add_argument("--name", default="demo-run")
    p.add_argument("--window", type=int, default=10, help="steps in the throughput mean")
    p.add_argument("-o", "--out", default=None)
    args = p.parse_args()
    run_dir = storage.join(storage.absolute(args.storage_path), args.name)
    if args.out is None and storage.is_remote(run_dir):
        p.error("the run is on an object store: give a local -o/--out for the PNG")
    out = Path(args.out) if args.out else Path(run_dir) / "run_summary.png"
    print(f"wrote {plot(run_dir, out, args.window)}")


if __name__ == "__main__":
    main()
