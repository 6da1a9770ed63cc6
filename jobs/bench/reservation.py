"""The Ray reader's transforms with lance_ray's run-ahead bound and with Ray Data's
per-operator reservation (its default, which lance_ray's pipelines replace), epoch by epoch
in one process.

    python -m jobs.bench.reservation [--pairs 5] [--cases tokens,image] [--out runs/bench]

On a 2-CPU local Ray, Ray Data's reservation runs short read+transform tasks mostly one at a
time (docs/transforms.md); ``lance_ray.read.run_ahead`` turns it off and bounds the
pipeline itself. Each pair runs one epoch under each, after a warm-up of each.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path
from typing import Any

from .configs import ENV
from .results import DEFAULT_OUT, result, write
from .runners import timed_pass
from .transform_runs import transform_configurations, transform_runner
from .transforms import CASES, ensure_tables

MODES = ("Ray Data's reservation", "lance_ray's bound")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--cases", default="tokens,image")
    parser.add_argument("--out", default="runs/bench")
    parser.add_argument("--json-out", default=DEFAULT_OUT,
                        help="folder of the shared-format results ('' skips)")
    parser.add_argument("--machine", default=None, help="the machine's name in the results")
    args = parser.parse_args(argv)
    os.environ.update(ENV)
    db = Path(args.out) / "db"
    db.mkdir(parents=True, exist_ok=True)
    tables = ensure_tables(db)
    import ray

    from lance_ray.read.ray_data import RayDataReader

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    bounded = RayDataReader._run_ahead
    # Ray Data's reservation is what a pipeline without lance_ray's bound runs under.
    reader: dict[str, Any] = {MODES[0]: lambda self, requests: None, MODES[1]: bounded}
    configs = {c.name: c for c in transform_configurations()}
    rows: list[list[Any]] = []
    try:
        for case in args.cases.split(","):
            table = CASES[case][0]
            spec = {"db": str(db), "table_name": table} | tables[table]
            runner = transform_runner(spec, configs[f"tx-{case}-ray"])
            rates: dict[str, list[float]] = {m: [] for m in MODES}
            for mode in MODES:  # warm-up: Ray workers, caches
                RayDataReader._run_ahead = reader[mode]  # type: ignore[method-assign]
                timed_pass(runner)
            for i in range(args.pairs):
                line = [f"{case} pair {i + 1}/{args.pairs}:"]
                for mode in MODES:
                    RayDataReader._run_ahead = reader[mode]  # type: ignore[method-assign]
                    rates[mode].append(timed_pass(runner).rows_per_s)
                    line.append(f"{mode} {rates[mode][-1] / 1e3:5.1f}k rows/s")
                print("  ".join(line), flush=True)
            old, new = (statistics.median(rates[m]) for m in MODES)
            higher = sum(b > a for a, b in zip(*rates.values()))
            print(f"{case}: median rows/s, {MODES[0]} {old / 1e3:.1f}k, {MODES[1]} "
                  f"{new / 1e3:.1f}k ({new / old:.2f}x; higher in {higher} of {args.pairs} "
                  "pairs)", flush=True)
            rows.append([case, round(old), round(new), round(new / old, 3), higher,
                         args.pairs])
    finally:
        RayDataReader._run_ahead = bounded  # type: ignore[method-assign]
    if args.json_out and rows:
        write(args.json_out, [result(
            "run-ahead", "Ray reader transforms: lance_ray's run-ahead bound against Ray "
            "Data's per-operator reservation, paired in one process",
            ["case", f"rows/s, {MODES[0]}", f"rows/s, {MODES[1]}", "ratio", "higher in",
             "pairs"], rows,
            command=f"python -m jobs.bench.reservation --pairs {args.pairs} "
                    f"--cases {args.cases}",
            machine=args.machine, notes=[
                "Each pair runs one epoch under each mode, after a warm-up of each; the "
                "ratio is of the median rates."])])


if __name__ == "__main__":
    main(sys.argv[1:])
