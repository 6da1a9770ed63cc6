"""Coordinator figures: report throughput with many ranks, restart recovery, plan memory.

    python -m jobs.bench.coordinator [--ranks 64] [--steps 50] [--rows 200000]
                                     [--every-batches 50] [--every-s 0.5]

* reports/s and sealed steps/s: ``--ranks`` simulated ranks step in lockstep in this driver,
  each committing ``--steps`` global steps through its own view-side reporter (the code a
  view reports through, coalescing under ``--every-batches``/``--every-s``; pass
  ``--every-batches 1`` for one actor call per rank and step); a report is one rank's
  progress at one step. Each rank attaches as a view does and checks the coordinator's
  generation before each step (the stale-view check a view makes before each batch). The
  clock stops when the coordinator has sealed the last step;
* status lag: how far the coordinator's sealed step trailed the ranks, sampled while they
  ran (steps, and seconds since the ranks completed the first unsealed step);
* coordinator memory: the actor's resident memory before and after the run, and its
  pending steps;
* recovery: time from killing the actor to the first answered call of its restart, and the
  sealed step it recovered;
* plan memory: bytes of plan a view receives, against the full plan.

The simulated ranks share the machine (and this driver's process) with the actor, so the
figures are lower bounds for ranks that run on their own processes.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray

from lance_ray.coordinator.client import CoordinatorPlans
from lance_ray.driver.handle import Coordinator
from lance_ray.state.ledger import RankReport
from lance_ray.state.reporting import ReportPolicy
from lance_ray.testing.tables import create_table
from lance_ray.topology import Topology, rank_splits


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--every-batches", type=int, default=ReportPolicy.every_batches)
    p.add_argument("--every-s", type=float, default=ReportPolicy.every_s)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lance_ray_bench_coord_"))
    table = create_table(str(work / "db"), rows=args.rows, dim=4)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             _temp_dir=str(work / "ray"))
    splits = args.ranks
    policy = ReportPolicy(every_batches=args.every_batches, every_s=args.every_s)
    coord = Coordinator.create(table, "bench", storage_path=str(work / "store"),
                               world_size=args.ranks, num_splits=splits, lease_version=False,
                               report_policy=policy)
    handle = coord.handle
    ray.get(handle.plan_part.remote(0, 0, 1))  # build the plan before timing
    idle_mib = rss_mib(coord.status()["pid"])
    ranks = [CoordinatorPlans(handle, policy) for _ in range(args.ranks)]
    for rank, plans in enumerate(ranks):  # as each view does: it then watches the generation
        plans.start(Topology(rank, args.ranks))
    owned = [len(rank_splits(r, args.ranks, splits)) for r in range(args.ranks)]
    completed_at: list[float] = []  # when every rank had committed step i + 1
    lags: list[tuple[int, float]] = []
    running = threading.Event()
    running.set()

    def watch_status() -> None:
        while running.is_set():
            sealed = coord.status()["sealed_step"]
            done = len(completed_at)
            if sealed < done:
                lags.append((done - sealed, time.monotonic() - completed_at[sealed]))
            elif done:
                lags.append((0, 0.0))
            time.sleep(0.1)

    watcher = threading.Thread(target=watch_status, daemon=True)
    started = time.monotonic()
    watcher.start()
    split_len = args.rows // splits
    for step in range(1, args.steps + 1):
        for rank, plans in enumerate(ranks):
            counts = [min(step, split_len)] * owned[rank]
            plans.check_current()  # what a view does before each batch (the stale check)
            plans.report(RankReport(rank, args.ranks, 0, step, tuple(counts), tuple(counts)))
        completed_at.append(time.monotonic())
    stepped = time.monotonic()
    for plans in ranks:  # a checkpoint at the last step, as every rank makes it at once
        plans.flush(wait=False)
    for plans in ranks:
        plans.flush()
    flushed = time.monotonic()
    while coord.status()["sealed_step"] < args.steps:
        time.sleep(0.01)
    elapsed = time.monotonic() - started
    print(f"stepping {stepped - started:.2f}s, checkpoint flush {flushed - stepped:.2f}s, "
          f"then sealed in {elapsed - (flushed - started):.2f}s")
    running.clear()
    watcher.join()
    reports = args.ranks * args.steps
    print(f"{args.ranks} ranks x {args.steps} steps, reports every {policy.every_batches} "
          f"batches or {policy.interval_s(args.ranks):.2f}s: {reports} reports in {elapsed:.2f}s = "
          f"{reports / elapsed:,.0f} reports/s, {args.steps / elapsed:.1f} sealed steps/s")
    if lags:
        steps_behind = [s for s, _ in lags]
        seconds = [t for _, t in lags]
        print(f"status lag: median {statistics.median(steps_behind):.0f} steps / "
              f"{statistics.median(seconds):.2f}s, max {max(steps_behind)} steps / "
              f"{max(seconds):.2f}s ({len(lags)} samples)")
    status = coord.status()
    print(f"coordinator memory: {rss_mib(status['pid']):.0f} MiB resident ({idle_mib:.0f} MiB "
          f"before the reports), {len(status['pending_steps'])} pending steps")

    pid = status["pid"]
    killed = time.monotonic()
    ray.kill(handle, no_restart=False)
    status = coord.status()
    while status["pid"] == pid:  # until the restarted process answers
        status = coord.status()
    print(f"restart recovery: {time.monotonic() - killed:.2f}s to the first answer, sealed step "
          f"{status['sealed_step']} recovered (of {args.steps})")

    view = coord.view(0, args.ranks, reader="local")
    full = ray.get(handle.plan_part.remote(0, 0, splits)).row_ids.nbytes
    print(f"plan memory: a view of 1/{args.ranks} holds {view.plan.row_ids.nbytes:,} bytes; "
          f"the full plan is {full:,} bytes ({full / view.plan.row_ids.nbytes:.0f}x)")
    coord.kill()
    ray.shutdown()


if __name__ == "__main__":
    main()
