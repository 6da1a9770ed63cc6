"""Elastic resume without Ray Train: checkpoint 2 ranks mid-epoch, resume on 1, 2 and 4.

    python -m jobs.elastic_resume [--rows 20000] [--num-splits 8] [--global-batch 64]

Each rank is a Ray actor holding a ``lance_ray.StreamingDataset`` view whose reads run in
Ray Data. All ranks step in lockstep (one batch each per global step). At ``--stop-step``
every rank saves its state, the states are merged into one JSON checkpoint, the ranks are
killed, and the rest of the epoch is read by fresh ranks on each world size. The proof
table compares every run with an uninterrupted one-rank run.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import ray

import lance_ray
from jobs.args import check_run_sizes, positive_int
from lance_ray.proof.verify import compare_steps, coverage
from lance_ray.testing.ranks import Rank
from lance_ray.testing.tables import create_table

logger = logging.getLogger("demo")

RESUME_ON = (1, 2, 4)  # the world sizes that resume the 2 ranks' checkpoint


def run_steps(uri: str, world_size: int, global_batch: int, plan: dict, *,
              state: dict | None = None, stop_step: int | None = None
              ) -> tuple[list[list[int]], dict | None]:
    """Step ``world_size`` ranks in lockstep; returns the global steps and, if stopped, the
    merged checkpoint."""
    ranks = [Rank.remote(r, world_size, global_batch // world_size, table=uri, plan=plan,
                         state=state) for r in range(world_size)]
    steps: list[list[int]] = []
    started, rows = time.monotonic(), 0
    while stop_step is None or len(steps) < stop_step:
        parts = ray.get([r.next.remote() for r in ranks])
        if all(p is None for p in parts):
            break
        step = [i for p in parts if p for i in p]
        steps.append(step)
        rows += len(step)
        if len(steps) % 50 == 0:
            logger.info("world_size=%d step %d: %d rows, %.0f rows/s", world_size, len(steps),
                        rows, rows / (time.monotonic() - started))
    merged = None
    if stop_step is not None:
        merged = lance_ray.merge_state_dicts(ray.get([r.state.remote() for r in ranks]))
    for r in ranks:
        ray.kill(r)
    return steps, merged


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/elastic")
    parser.add_argument("--rows", type=positive_int, default=20_000)
    parser.add_argument("--num-splits", type=positive_int, default=8)
    parser.add_argument("--global-batch", type=positive_int, default=64)
    parser.add_argument("--stop-step", type=positive_int, default=100)
    parser.add_argument("--seed", type=int, default=7)
    args = parser.parse_args(argv)
    # Every world size (2, which takes the checkpoint, among them) must divide --num-splits,
    # and --global-batch be a multiple of it; the largest size divides what the others do.
    for world_size in RESUME_ON:
        check_run_sizes(world_size, args.num_splits, None,
                        workers_from=f"world size {world_size} (of {RESUME_ON})")
    check_run_sizes(max(RESUME_ON), args.num_splits, args.global_batch,
                    workers_from=f"world sizes {RESUME_ON}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    workdir = Path(args.workdir)
    table = create_table(str(workdir / "db"), rows=args.rows, dim=16)
    uri = table.to_lance().uri
    plan = {"num_splits": args.num_splits, "shuffle_seed": args.seed,
            "table_version": table.version}
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)

    logger.info("uninterrupted reference run on 1 rank")
    full, _ = run_steps(uri, 1, args.global_batch, plan)
    epoch = [i for s in full for i in s]
    if args.stop_step >= len(full):  # a checkpoint at the epoch's end leaves nothing to resume
        ray.shutdown()
        raise SystemExit(f"--stop-step {args.stop_step} is not inside the epoch: it has "
                         f"{len(full)} global steps of {args.global_batch} samples; pass a "
                         f"--stop-step below {len(full)} (or more --rows)")

    logger.info("2 ranks until global step %d, then checkpoint", args.stop_step)
    before_steps, merged = run_steps(uri, 2, args.global_batch, plan, stop_step=args.stop_step)
    ckpt = workdir / "checkpoint.json"
    lance_ray.save_state(ckpt, merged)
    before = [i for s in before_steps for i in s]

    rows = []
    for world_size in RESUME_ON:
        logger.info("resume from %s on %d rank(s)", ckpt, world_size)
        after_steps, _ = run_steps(uri, world_size, args.global_batch, plan,
                                   state=lance_ray.load_state(ckpt))
        report = coverage(epoch, before, [i for s in after_steps for i in s])
        report = compare_steps(report, full, before_steps + after_steps)
        rows.append((world_size, report))
    ray.shutdown()

    print(f"\nExactly-once proof: {len(epoch)} planned samples, {args.num_splits} splits, "
          f"global batch {args.global_batch}, checkpoint at step {args.stop_step} on 2 ranks")
    print(f"{'resume on':>9} {'before':>7} {'after':>7} {'total':>7} {'dupes':>6} {'lost':>5} "
          f"{'steps = uninterrupted':>22}")
    for world_size, r in rows:
        print(f"{world_size:>9} {r.before:>7} {r.after:>7} {r.before + r.after:>7} "
              f"{r.duplicates:>6} {r.lost:>5} {f'{r.steps_matching}/{r.steps_compared}':>22}")
    ok = all(r.exactly_once and r.steps_identical and r.before + r.after == len(epoch)
             for _, r in rows)
    print("PROOF:", "nothing lost, nothing repeated" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
