"""Plans at scale: build time, memory and one trained epoch for each plan mode.

    python -m jobs.bench.plan --rows 10000000           # a real narrow table (int64 id)
    python -m jobs.bench.plan --simulate 100000000      # plan="index" over a simulated id space

For a real table it writes ``--rows`` rows (one int64 column, ~8 bytes a row on disk) under
``--dir``, then, for each plan mode, in a fresh process (so peak RSS is that mode's own):
constructs a ``StreamingDataset`` (which builds the epoch's plan), iterates one whole epoch
with ``iter_batches`` while checking that every planned row comes exactly once, and times
``set_epoch(1)`` (the next epoch's plan is built in the background meanwhile). A mode that
cannot build prints its error. The table is deleted at the end unless ``--keep``.

``--simulate N`` needs no table: it computes every row id of a ``plan="index"`` epoch over
N rows in ``N / 1M`` fragments, through the same per-rank order and plan lookups a read
request uses, in 65,536-sample slices, and checks the ids form a bijection.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

MODES: dict[str, dict[str, Any]] = {
    "lancedb shuffled": {"plan": "lancedb"},
    "lancedb clump 1024": {"plan": "lancedb", "shuffle_clump_size": 1024},
    "lancedb unshuffled": {"plan": "lancedb", "shuffle": False},
    "index shuffled": {"plan": "index"},
    "index clump 1024": {"plan": "index", "shuffle_clump_size": 1024},
    "index filter id%2=0": {"plan": "index", "filter": "id % 2 = 0"},
}
SLICE = 65536


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def write_table(uri: str, rows: int) -> None:
    import lance
    import pyarrow as pa

    schema = pa.schema([("id", pa.int64())])
    chunk = 1 << 20

    def batches():
        for lo in range(0, rows, chunk):
            yield pa.record_batch([pa.array(np.arange(lo, min(lo + chunk, rows)))], schema=schema)

    lance.write_dataset(pa.RecordBatchReader.from_batches(schema, batches()), uri,
                        max_rows_per_file=chunk)


def run_mode(uri: str, rows: int, splits: int, batch: int, mode: dict[str, Any]) -> dict:
    """One mode in this process: build, one epoch, the next epoch's plan."""
    import lance
    import lancedb.permutation  # noqa: F401  (imports are not part of the build time)

    from lance_ray import StreamingDataset  # imports torch (lazily)

    lance.dataset(uri).count_rows()
    base = rss_bytes()
    started = time.perf_counter()
    try:
        ds = StreamingDataset(uri, num_splits=splits, reader="local", columns=["id"],
                              **mode)
    except Exception as e:  # a mode that cannot build: report its error
        return {"error": f"{type(e).__name__}: {e}", "build_s": time.perf_counter() - started}
    build_s = time.perf_counter() - started
    plan_rss = rss_bytes() - base
    seen = np.zeros(rows, dtype=bool)
    count = 0
    started = time.perf_counter()
    for b in ds.iter_batches(batch):
        ids = b["id"].numpy()
        if seen[ids].any():
            raise AssertionError("a row came twice in one epoch")
        seen[ids] = True
        count += len(ids)
    epoch_s = time.perf_counter() - started
    if count != len(ds):
        raise AssertionError(f"the epoch yielded {count} rows, the plan has {len(ds)}")
    started = time.perf_counter()
    ds.set_epoch(1)
    next_s = time.perf_counter() - started
    return {"rows": count, "build_s": build_s, "epoch_s": epoch_s, "rows_per_s": count / epoch_s,
            "next_epoch_plan_s": next_s, "plan_rss_mb": plan_rss / 1e6,
            "peak_rss_mb": peak_rss_bytes() / 1e6}


def simulate(rows: int, splits: int, filtered: bool, sample: int) -> dict:
    """Every row id of a ``plan="index"`` epoch over a simulated table of ``rows`` rows (or
    only the first ``sample`` samples of the epoch, checked distinct, when ``sample``)."""
    from lance_ray.plan.index import computed_plan, dense_row_space, listed_row_space
    from lance_ray.plan.splits import PlanSpec
    from lance_ray.stream.order import stream_for

    frag = 1 << 20
    counts = [(f, min(frag, rows - f * frag)) for f in range(-(-rows // frag))]
    base = rss_bytes()
    started = time.perf_counter()
    if filtered:  # every other row matches: the listed row space, as a filter builds it
        space = listed_row_space((np.uint64(f) << np.uint64(32)) | np.arange(0, n, 2,
                                                                             dtype=np.uint64)
                                 for f, n in counts)
    else:
        space = dense_row_space(counts)
    plan = computed_plan(PlanSpec(1, splits, True, 0, 0, None, "sim" if filtered else None,
                                  "index"), space)
    build_s = time.perf_counter() - started
    plan_bytes = space.nbytes
    plan_rss = rss_bytes() - base
    stream = stream_for(range(splits), [0] * splits, [0] * splits, plan.split_len)
    total = min(sample, len(stream)) if sample else len(stream)
    seen = np.zeros(len(counts) * frag if not sample else 0, dtype=bool)
    kept: list[np.ndarray] = []
    lookup_s = 0.0  # the lookups only, not the check
    for lo in range(0, total, SLICE):
        started = time.perf_counter()
        s, p = stream.slice(lo, min(lo + SLICE, total))
        ids = plan.rows_at(s, p)
        lookup_s += time.perf_counter() - started
        flat = ((ids >> np.uint64(32)) * np.uint64(frag) + (ids & np.uint64(0xFFFFFFFF))
                ).astype(np.int64)
        if sample:
            kept.append(flat)
            continue
        if seen[flat].any():
            raise AssertionError("a row id came twice")
        seen[flat] = True
    if sample and np.unique(np.concatenate(kept)).size != total:
        raise AssertionError("a row id came twice")
    return {"rows": total, "build_s": build_s, "plan_bytes": plan_bytes,
            "plan_rss_mb": plan_rss / 1e6, "lookup_s": lookup_s,
            "ids_per_s": total / lookup_s, "ms_per_64k": 1e3 * lookup_s / (total / SLICE),
            "peak_rss_mb": peak_rss_bytes() / 1e6}


def child(args: argparse.Namespace) -> None:
    if args.simulate:
        out = simulate(args.simulate, args.splits, args.child == "filtered", args.sample)
    else:
        out = run_mode(args.uri, args.rows, args.splits, args.batch, MODES[args.child])
    print(json.dumps(out))


def in_child(argv: list[str]) -> dict:
    done = subprocess.run([sys.executable, "-m", "jobs.bench.plan", *argv], capture_output=True,
                          text=True, cwd=Path(__file__).resolve().parents[2])
    if done.returncode:
        return {"error": "\n".join(done.stderr.strip().splitlines()[-3:]) or "failed"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=10_000_000)
    p.add_argument("--simulate", type=int, default=0, help="rows of a simulated id space")
    p.add_argument("--sample", type=int, default=0,
                   help="with --simulate: look up only the epoch's first SAMPLE samples")
    p.add_argument("--kinds", default="dense,filtered", help="with --simulate")
    p.add_argument("--splits", type=int, default=64)
    p.add_argument("--batch", type=int, default=4096)
    p.add_argument("--dir", default="runs/bench_plan")
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated mode names")
    p.add_argument("--keep", action="store_true", help="keep the table afterwards")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--uri", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    common = ["--splits", str(args.splits)]
    if args.simulate:
        for kind in args.kinds.split(","):
            out = in_child(["--child", kind, "--simulate", str(args.simulate),
                            "--sample", str(args.sample), *common])
            print(f"simulated {args.simulate:,} rows, plan='index' {kind}: {json.dumps(out)}",
                  flush=True)
        return
    root = Path(args.dir)
    uri = str(root / f"ids_{args.rows}.lance")
    if not Path(uri).exists():
        started = time.perf_counter()
        write_table(uri, args.rows)
        print(f"wrote {args.rows:,} rows to {uri} in {time.perf_counter() - started:.1f}s",
              flush=True)
    try:
        for name in args.modes.split(","):
            out = in_child(["--child", name, "--uri", uri, "--rows", str(args.rows),
                            "--batch", str(args.batch), *common])
            print(f"{args.rows:,} rows, {name}: {json.dumps(out)}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(uri, ignore_errors=True)


if __name__ == "__main__":
    main()
