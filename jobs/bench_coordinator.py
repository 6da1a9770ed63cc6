"""Coordinator figures: report throughput with many ranks, restart recovery, plan memory.

    python jobs/bench_coordinator.py [--ranks 64] [--steps 50] [--rows 200000]

* reports/s: ``--ranks`` simulated ranks (threads in this driver, each with its own actor
  handle calls) report ``--steps`` global steps each; the coordinator seals every step;
* recovery: time from killing the actor to the first answered call of its restart, and the
  sealed step it recovered;
* plan memory: bytes of plan a view receives, against the full plan.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_table import create_table  # noqa: E402

from lance_ray.coordinator import Coordinator  # noqa: E402
from lance_ray.plan import rank_splits  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--rows", type=int, default=200_000)
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="lance_ray_bench_coord_"))
    table = create_table(str(work / "db"), rows=args.rows, dim=4)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    splits = args.ranks
    coord = Coordinator.create(table, "bench", storage_path=str(work / "store"),
                               world_size=args.ranks, num_splits=splits, lease_version=False)
    handle = coord.handle
    ray.get(handle.plan_part.remote(0, 0, 1))  # build the plan before timing

    def rank_reports(rank: int) -> None:
        owned = rank_splits(rank, args.ranks, splits)
        for step in range(1, args.steps + 1):
            counts = [step] * len(owned)
            handle.report.remote(rank, args.ranks, 0, step, counts, counts)

    started = time.monotonic()
    with ThreadPoolExecutor(16) as pool:
        list(pool.map(rank_reports, range(args.ranks)))
    while coord.status()["sealed_step"] < args.steps:
        time.sleep(0.01)
    elapsed = time.monotonic() - started
    reports = args.ranks * args.steps
    print(f"{args.ranks} ranks x {args.steps} steps: {reports} reports in {elapsed:.2f}s = "
          f"{reports / elapsed:,.0f} reports/s, {args.steps / elapsed:.1f} sealed steps/s")

    pid = coord.status()["pid"]
    killed = time.monotonic()
    ray.kill(handle, no_restart=False)
    status = coord.status()
    while status["pid"] == pid:  # until the restarted process answers
        status = coord.status()
    print(f"restart recovery: {time.monotonic() - killed:.2f}s to the first answer, sealed step "
          f"{status['sealed_step']} recovered (of {args.steps})")

    view = coord.view(0, args.ranks, reader="local")
    full = ray.get(handle.plan_part.remote(0, 0, splits))[0].row_ids.nbytes
    print(f"plan memory: a view of 1/{args.ranks} holds {view.plan.row_ids.nbytes:,} bytes; "
          f"the full plan is {full:,} bytes ({full / view.plan.row_ids.nbytes:.0f}x)")
    coord.kill()
    ray.shutdown()


if __name__ == "__main__":
    main()
