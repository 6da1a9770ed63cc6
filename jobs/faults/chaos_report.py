"""Tables of ``jobs/faults/chaos.py --trainer``: what each trial proved, and how long recovery took.

Recovery is measured from the sample logs and the fault times: from the fault (or the node
joining, for a resize) to the first batch of the restarted group. The data path's own
share of it is that group's view construction (``Attempt.view_s``, rank 0) plus the wait
for its first batch (the slowest rank's); the rest is Ray's (failure detection, worker
group shutdown and start, process group setup, the resize monitor interval). The data
share is compared with a fresh start's on the same world size.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from jobs.faults.chaos_trainer import RunShape, TrainerTrial, world_sizes
from lance_ray.proof.audit import AttemptLog

CAUSES = {"fault": "worker killed", "node removed": "node removed", "node added": "resize"}


@dataclass(frozen=True)
class Recovery:
    """One restart of the worker group, timed."""

    trial: int
    cause: str
    world_size: int
    total_s: float  # event -> first batch of the restarted group
    data_s: float  # that group's view construction + first read


def data_share(a: AttemptLog) -> float:
    return a.attempt.view_s + a.steps[0].wait_s


def first_batch(a: AttemptLog, step_delay_s: float) -> float:
    """When the group got its first batch (a step is logged after its compute)."""
    return a.steps[0].t - step_delay_s


def recoveries(trial: TrainerTrial, shape: RunShape) -> list[Recovery]:
    step_delay_s, out = shape.step_delay(trial.kind), []
    for a in trial.attempts[1:]:
        before = [(what, t) for what, t in trial.events if t < a.attempt.started]
        if not a.steps or not before:
            continue
        what, t = before[-1]
        out.append(Recovery(trial.trial, CAUSES[what], a.attempt.world_size,
                            first_batch(a, step_delay_s) - t, data_share(a)))
    return out


def fresh_data_shares(trials: list[TrainerTrial]) -> dict[int, float]:
    """Median data share of a fresh start, per world size."""
    by_ws: dict[int, list[float]] = {}
    for t in trials:
        if t.attempts and t.attempts[0].steps:
            by_ws.setdefault(t.attempts[0].attempt.world_size, []).append(
                data_share(t.attempts[0]))
    return {ws: statistics.median(v) for ws, v in by_ws.items()}


def print_trials(trials: list[TrainerTrial]) -> bool:
    """The chaos table; True if every trial passed."""
    print(f"{'trial':>5} {'fault':<12} {'step':>4} {'outcome':<8} {'restarts':>8} "
          f"{'world sizes':<14} {'resumed from':<14} {'dupes':>5} {'lost':>4} "
          f"{'steps identical':>15} {'lost ckpt':>9}  detail")
    for t in trials:
        r = t.report
        resumed = ",".join(str(a.attempt.resumed_from_step) for a in t.attempts[1:]) or "-"
        steps = f"{r.steps_matching}/{r.steps_compared}" if r else "-"
        print(f"{t.trial:>5} {t.kind:<12} {t.step:>4} {'ok' if t.ok else 'FAIL':<8} "
              f"{t.restarts:>8} {world_sizes(t.attempts):<14} {resumed:<14} "
              f"{r.duplicates if r else '-':>5} {r.lost if r else '-':>4} {steps:>15} "
              f"{t.lost_checkpoints:>9}  {t.detail}{'  ' + t.error if t.error else ''}")
    dupes = sum(t.report.duplicates for t in trials if t.report)
    lost = sum(t.report.lost for t in trials if t.report)
    ok = all(t.ok for t in trials)
    print(f"{len(trials)} trials: {sum(t.ok for t in trials)} ok, {dupes} duplicates, "
          f"{lost} lost, {sum(t.lost_checkpoints for t in trials)} lost checkpoints -> "
          f"{'PASS' if ok else 'FAIL'}")
    return ok


def print_recoveries(trials: list[TrainerTrial], shape: RunShape) -> None:
    """Recovery times per restart, and medians per cause against a fresh start."""
    fresh = fresh_data_shares(trials)
    rows = [r for t in trials for r in recoveries(t, shape)]
    print(f"\n{'trial':>5} {'cause':<14} {'ws':>2} {'total s':>8} {'data s':>7} "
          f"{'Ray s':>7} {'data / fresh':>12}")
    for r in rows:
        base = fresh.get(r.world_size)
        ratio = f"{r.data_s / base:.2f}x" if base else "-"
        print(f"{r.trial:>5} {r.cause:<14} {r.world_size:>2} {r.total_s:>8.1f} "
              f"{r.data_s:>7.2f} {r.total_s - r.data_s:>7.1f} {ratio:>12}")
    starts = [first_batch(t.attempts[0], shape.step_delay(t.kind)) - t.launched
              for t in trials if t.attempts and t.attempts[0].steps]
    if starts:
        shares = ", ".join(f"{ws} workers {s:.2f} s" for ws, s in sorted(fresh.items()))
        print(f"fresh start (driver launch -> first batch): median "
              f"{statistics.median(starts):.1f} s; data share: {shares}")
    for cause in sorted({r.cause for r in rows}):
        mine = [r for r in rows if r.cause == cause]
        ratios = [r.data_s / fresh[r.world_size] for r in mine if fresh.get(r.world_size)]
        ratio = f"{statistics.median(ratios):.2f}x a fresh start" if ratios else "no fresh"
        print(f"{cause} -> first batch of the restarted group ({len(mine)}): median "
              f"{statistics.median(r.total_s for r in mine):.1f} s, of which the data path "
              f"{statistics.median(r.data_s for r in mine):.2f} s ({ratio}) and Ray "
              f"{statistics.median(r.total_s - r.data_s for r in mine):.1f} s")
