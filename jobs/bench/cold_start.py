"""Time to the first batch in a fresh process, with no Ray running: lance_ray vs the reference.

    python -m jobs.bench.cold_start --db runs/db --table bench [--trials 3] [--profile out.prof]

Each trial is a new Python process with ``RAY_ADDRESS`` unset and no Ray cluster started by
this script. The child imports torch, lancedb and lance_ray (timed apart: imports are the
same for every loader), then times constructing the dataset and taking its first batch of
256 (``iter_batches`` for lance_ray, ``DataLoader(batch_size=256)`` for the reference). It
prints each trial and the median ratio to the reference. ``--profile`` writes a cProfile of
one lance_ray cold start (default reader) to that path.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

BATCH = 256
SPLITS = 8
CHILD = r"""
import json, os, sys, time
t0 = time.perf_counter()
import torch, lancedb, lance_ray
imported = time.perf_counter() - t0
kind, db, name, profile = sys.argv[1:5]
table = lancedb.connect(db).open_table(name)
prof = None
if profile:
    import cProfile
    prof = cProfile.Profile()
    prof.enable()
t = time.perf_counter()
if kind == "reference":
    from lancedb.streaming import StreamingDataset
    from torch.utils.data import DataLoader
    ds = StreamingDataset(table, num_splits=SPLITS, shuffle_seed=0)
    batch = next(iter(DataLoader(ds, batch_size=BATCH)))
else:
    kw = {} if kind == "default" else {"reader": kind}
    ds = lance_ray.StreamingDataset(table, num_splits=SPLITS, shuffle_seed=0, **kw)
    batch = next(iter(ds.iter_batches(BATCH)))
first = time.perf_counter() - t
if prof is not None:
    prof.disable()
    prof.dump_stats(profile)
import ray
print("@@" + json.dumps({"import_s": imported, "first_batch_s": first, "rows": len(batch["id"]),
                         "ray_started": ray.is_initialized()}), flush=True)
os._exit(0)  # skip interpreter teardown (Ray's shutdown hooks): not part of the figure
""".replace("SPLITS", str(SPLITS)).replace("BATCH", str(BATCH))


def trial(kind: str, db: str, name: str, profile: str = "") -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"RAY_DATA_DISABLE_PROGRESS_BARS": "1", "RAY_AUTH_MODE": "disabled"}
    out = subprocess.run([sys.executable, "-c", CHILD, kind, db, name, profile], env=env,
                         capture_output=True, text=True, timeout=300)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("@@")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"{kind} trial failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][2:])


def measure(db: str, table: str, kinds: list[str], trials: int) -> dict[str, float]:
    """Median time to first batch per loader over ``trials`` fresh processes each,
    interleaved so that load changes hit every loader alike; prints every trial."""
    got: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(trials):
        for kind in kinds:
            r = trial(kind, db, table)
            got[kind].append(r["first_batch_s"])
            print(f"trial {i + 1} {kind:<9} first batch {r['first_batch_s']:.3f}s "
                  f"(imports {r['import_s']:.2f}s, Ray started: {r['ray_started']})",
                  flush=True)
    return {k: statistics.median(v) for k, v in got.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--db", default="runs/db")
    p.add_argument("--table", default="bench")
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--kinds", default="reference,default,local,ray")
    p.add_argument("--profile", default="")
    args = p.parse_args()
    db = os.path.abspath(args.db)
    med = measure(db, args.table, args.kinds.split(","), args.trials)
    ref = med.get("reference")
    print(f"\n{'loader':<10} {'median 1st batch s':>18} {'x reference':>11}")
    for kind, m in med.items():
        ratio = f"{m / ref:.2f}x" if ref else "-"
        print(f"{kind:<10} {m:>18.3f} {ratio:>11}")
    if args.profile:
        t = time.perf_counter()
        trial("default", db, args.table, os.path.abspath(args.profile))
        print(f"\nprofiled one default cold start into {args.profile} "
              f"({time.perf_counter() - t:.1f}s)")


if __name__ == "__main__":
    main()
