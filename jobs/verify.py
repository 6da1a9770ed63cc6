"""Prove from the sample logs that a training run saw every sample exactly once.

    python -m jobs.verify --storage-path runs/demo/storage --name demo-run
    python -m jobs.verify --storage-path runs/lm/storage --name lm-run     # packed blocks

Rebuilds the global steps the final model descends from (after crashes and resizes),
compares them with an uninterrupted one-rank run of the same plan and global batch, and
prints the proof. Exits non-zero if anything was lost, repeated or reordered across steps.
A packed run (``jobs/train_lm.py``: its ``run.json`` has ``pack``) logs block content ids,
and its uninterrupted run is the reference's (``lancedb.streaming``, one rank), whichever
reader trained.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import lance_ray
from lance_ray import storage
from lance_ray.proof.audit import lineage, logged_steps, read_attempts
from lance_ray.proof.verify import CoverageReport, compare_steps, coverage
from lance_ray.storage import read_json


def uninterrupted_steps(run: dict) -> list[list[int]]:
    """The global steps of the same plan read by one rank without interruption."""
    if "pack" in run:
        from jobs.lm_data import PackSpec, uninterrupted_block_steps

        return uninterrupted_block_steps(PackSpec(**run["pack"]))
    ds = lance_ray.StreamingDataset(
        storage.join(run["db"], f"{run['table']}.lance"), num_splits=run["num_splits"],
        shuffle_seed=run["shuffle_seed"], table_version=run["table_version"], columns=["id"],
        reader="local")
    return [b["id"].tolist() for b in ds.iter_batches(run["global_batch"])]


def verify_run(run_dir: str | Path) -> tuple[CoverageReport, list[str]]:
    """The coverage report of the run in ``run_dir`` (a path or URI) and a line per attempt."""
    run = read_json(storage.join(run_dir, "run.json"))
    samples = storage.join(run_dir, "samples")
    attempts = [f"attempt {i}: {a.world_size} worker(s), resumed from step "
                f"{a.resumed_from_step}, " + (f"logged steps {min(s)}..{max(s)}" if s
                                               else "logged no step")
                for i, (a, s) in enumerate(read_attempts(samples))]
    steps = lineage(samples, committed_only=True)  # what the saved model trained on
    logged = logged_steps(samples)
    if logged > len(steps):
        attempts.append(f"steps {len(steps) + 1}..{logged} have no committed checkpoint: the "
                        "saved model never trained on them")
    full = uninterrupted_steps(run)
    report = coverage([i for s in full for i in s], [], [i for s in steps for i in s])
    return compare_steps(report, full, steps), attempts


def print_proof(report: CoverageReport, attempts: list[str], unit: str = "sample") -> bool:
    """Print the attempts and the proof; True if it holds."""
    print("\n".join(attempts))
    print(f"planned {unit}s {report.planned}, trained {report.after}, duplicates "
          f"{report.duplicates}, lost {report.lost}, unexpected {report.unexpected}")
    print(f"global steps identical to an uninterrupted run: "
          f"{report.steps_matching}/{report.steps_compared}")
    ok = report.exactly_once and report.steps_identical and report.after == report.planned
    if not ok and not report.duplicates and not report.unexpected and \
            report.steps_matching == report.steps_trained < report.steps_compared:
        # Sound so far, but not over: the lost ones are the steps not trained yet.
        print(f"PROOF: INCOMPLETE: the saved model reached global step {report.steps_trained} "
              f"of {report.steps_compared}; every {unit} up to it exactly once, same global "
              "steps. The run has not finished (or stopped): submit the training job again "
              "with the same --name and --storage-path to resume it, then verify again")
        return False
    print("PROOF:", f"every {unit} exactly once, same global steps" if ok else "FAILED")
    return ok


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--storage-path", default="runs/demo/storage")
    p.add_argument("--name", default="demo-run")
    args = p.parse_args(argv)
    run_dir = storage.join(storage.absolute(args.storage_path), args.name)
    run_file = storage.join(run_dir, "run.json")
    if not storage.exists(run_file):
        raise SystemExit(f"no run {args.name!r} under {args.storage_path} ({run_file} does not "
                         "exist): pass the --storage-path and --name the run was trained with")
    packed = "pack" in read_json(run_file)
    try:
        ok = print_proof(*verify_run(run_dir), unit="block" if packed else "sample")
    except ValueError as e:  # the log itself shows a step trained twice, lost or missing
        print(f"PROOF: FAILED: {e}")
        ok = False
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
