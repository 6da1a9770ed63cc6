"""The Ray reader's transforms with Ray Data's per-operator reservation on and off, epoch by
epoch in one process.

    python -m jobs.bench.reservation [--pairs 5] [--cases tokens,image] [--out runs/bench]

On a 2-CPU local Ray, Ray Data's reservation
(``DataContext.op_resource_reservation_enabled``) runs short read+transform tasks mostly one
at a time (README, "Transforms"). Turning it off lets them run side by side, but also lets
the reads run ahead of the trainer into the object store, so it is an opt-in. Each pair
runs one epoch with the reservation on, then one with it off, after a warm-up of each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from .configs import ENV
from .runners import timed_pass
from .transform_runs import transform_configurations, transform_runner
from .transforms import CASES, ensure_tables


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--cases", default="tokens,image")
    parser.add_argument("--out", default="runs/bench")
    args = parser.parse_args(argv)
    os.environ.update(ENV)
    db = Path(args.out) / "db"
    db.mkdir(parents=True, exist_ok=True)
    tables = ensure_tables(db)
    import ray
    import ray.data

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    context = ray.data.DataContext.get_current()  # each epoch's pipeline copies it
    configs = {c.name: c for c in transform_configurations()}
    for case in args.cases.split(","):
        table = CASES[case][0]
        spec = {"db": str(db), "table_name": table} | tables[table]
        runner = transform_runner(spec, configs[f"tx-{case}-ray"])
        rates: dict[bool, list[float]] = {True: [], False: []}
        for reserve in (True, False):  # warm-up: Ray workers, caches
            context.op_resource_reservation_enabled = reserve
            timed_pass(runner)
        for i in range(args.pairs):
            line = [f"{case} pair {i + 1}/{args.pairs}:"]
            for reserve in (True, False):
                context.op_resource_reservation_enabled = reserve
                rates[reserve].append(timed_pass(runner).rows_per_s)
                line.append(f"reservation {'on' if reserve else 'off'} "
                            f"{rates[reserve][-1] / 1e3:5.1f}k rows/s")
            print("  ".join(line), flush=True)
        on, off = statistics.median(rates[True]), statistics.median(rates[False])
        higher = sum(b > a for a, b in zip(rates[True], rates[False]))
        print(f"{case}: median rows/s, reservation on {on / 1e3:.1f}k, off {off / 1e3:.1f}k "
              f"({off / on:.2f}x; off higher in {higher} of {args.pairs} pairs)", flush=True)
    context.op_resource_reservation_enabled = True


if __name__ == "__main__":
    main(sys.argv[1:])
