"""Packed tokens against the sequential scan, epoch by epoch in one process.

    python -m jobs.bench.paired [--pairs 12] [--readers local,ray] [--out runs/bench]

``python -m jobs.bench --only packing`` runs each configuration in a fresh process, one
after the other, so its "x scan" divides rates measured seconds apart, and the scan's rate
moves most from run to run. Here the scan and each packed reader
alternate in one process after a warm-up, and every packed epoch is divided by the scan
epoch just before it: the median of those ratios is the figure the ">= 0.3x the scan"
target is judged on.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

from .configs import ENV
from .packing import (
    PACK_DOCS,
    PACK_TABLE,
    SCAN_TARGET,
    packing_configurations,
    packing_runner,
)
from .results import DEFAULT_OUT, result, write
from .runners import timed_pass
from .tables import ensure_table


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=12)
    parser.add_argument("--readers", default="local,ray",
                        help="comma-separated: local, ray, loader (StreamingDataLoader nw=2), "
                        "take (Lance's random-order take of the column: what a full shuffle "
                        "reads, no packing)")
    parser.add_argument("--out", default="runs/bench")
    parser.add_argument("--json-out", default=DEFAULT_OUT,
                        help="folder of the shared-format results ('' skips)")
    parser.add_argument("--machine", default=None, help="the machine's name in the results")
    parser.add_argument("--pack-docs", type=int, default=PACK_DOCS)
    parser.add_argument("--fragments", type=int, default=4)
    args = parser.parse_args(argv)
    os.environ.update(ENV)
    db = Path(args.out) / "db"
    db.mkdir(parents=True, exist_ok=True)
    table = ensure_table(db, PACK_TABLE, args.pack_docs, args.fragments, tokens=True)
    spec = {"db": str(db), "table_name": PACK_TABLE, "uri": table["uri"],
            "blocks_per_epoch": table["blocks_per_epoch"]}
    readers = args.readers.split(",")
    if "ray" in readers:
        import ray

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    configs = {c.name: c for c in packing_configurations()}
    names = {r: "pack-limit-take" if r == "take" else f"pack-{r}" for r in readers}
    runners = {n: packing_runner(spec, configs[n])
               for n in ["pack-limit-scan", *names.values()]}
    for runner in runners.values():  # warm-up, one whole epoch: imports, caches, Ray workers
        timed_pass(runner)
    ratios: dict[str, list[float]] = {r: [] for r in readers}
    scans = []
    for i in range(args.pairs):
        scan = timed_pass(runners["pack-limit-scan"]).rows_per_s
        scans.append(scan)
        line = [f"pair {i + 1:>2}/{args.pairs}: scan {scan / 1e6:6.1f}M tokens/s"]
        for r in readers:
            ratios[r].append(timed_pass(runners[names[r]]).rows_per_s / scan)
            line.append(f"{r} {ratios[r][-1]:.3f}x")
        print("  ".join(line), flush=True)
    print(f"\nscan: median {statistics.median(scans) / 1e6:.1f}M tokens/s "
          f"({min(scans) / 1e6:.1f}M-{max(scans) / 1e6:.1f}M)")
    rows = [[r, round(statistics.median(ratios[r]), 3), round(min(ratios[r]), 3),
             round(max(ratios[r]), 3), len(ratios[r])] for r in readers]
    if args.json_out:
        write(args.json_out, [result(
            "packing-paired", "Packed tokens/s as a fraction of the token column's scan, "
            "paired epoch by epoch in one process",
            ["reader", "median x scan", "min", "max", "pairs"], rows,
            command="python -m jobs.bench.paired " + " ".join(
                f"--{k.replace('_', '-')} {v}" for k, v in
                (("pairs", args.pairs), ("readers", args.readers),
                 ("pack_docs", args.pack_docs))),
            machine=args.machine, notes=[
                "Each packed epoch is divided by the scan epoch just before it, so load "
                "changes between epochs cancel; take = Lance's own random-order take of the "
                "column, what a full shuffle reads."])])
    for r in readers:
        got = ratios[r]
        if r == "take":
            print(f"[limit] Lance's random-order take, paired: median "
                  f"{statistics.median(got):.3f}x the scan ({min(got):.3f}x-{max(got):.3f}x)")
            continue
        verdict = "HOLDS" if statistics.median(got) >= SCAN_TARGET else "FAILS"
        print(f"[{verdict}] packed tokens/s ({r}) >= {SCAN_TARGET}x the scan, paired: median "
              f"{statistics.median(got):.3f}x ({min(got):.3f}x-{max(got):.3f}x), "
              f"{sum(x >= SCAN_TARGET for x in got)} of {len(got)} pairs at or above")


if __name__ == "__main__":
    main(sys.argv[1:])
