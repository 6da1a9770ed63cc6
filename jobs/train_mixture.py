"""Train a tiny model in TorchTrainer on a three-source weighted mixture, with a crash and a
resize on the way, and prove it: every sample of each source trained on exactly once, and
the observed mix against the weights.

    ray job submit --working-dir . -- python -m jobs.train_mixture
    python -m jobs.train_mixture --workdir runs/mixture --rows 2000 --workers 4 --then 2

The three tables (``web``, ``code``, ``math``) hold rows in the proportions of their
weights (7:2:1), so under ``stop="first_exhausted"`` one mixture epoch reads each of them
whole. The first job trains on ``--workers`` ranks, one rank dies at ``--crash-at-step``
(Ray Train restarts the group from the latest checkpoint) and the job stops at
``--stop-at-step``; the second job resumes the same run on ``--then`` ranks (a resize) and
finishes the epoch. Every rank logs the ``(source, id)`` samples of each global step in the
sample log that the other training jobs write (``lance_ray.proof.audit``); the proof keeps,
of each attempt, the steps up to where the next attempt resumed (what the final model
trained on, ``audit.lineage``) and checks them.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")

import lancedb
import numpy as np
import pyarrow as pa
import ray
import ray.train
import torch
from ray.train.torch import TorchTrainer

import lance_ray
import lance_ray.train as lt
from jobs.args import check_run_sizes, positive_int
from jobs.train import crash_once, optimizer_step, shared_attempt_id, worker_resources
from lance_ray.proof.audit import Attempt, SampleLog, lineage, read_attempts

logger = logging.getLogger("train_mixture")
SOURCES = (("web", 7), ("code", 2), ("math", 1))
DIM = 8


def make_tables(db: str, rows: int) -> dict[str, int]:
    """The three source tables (``id``, ``x`` of ``DIM`` floats, ``label``), ``rows`` in all
    in the proportions of the weights; returns each table's version."""
    conn = lancedb.connect(db)
    total = sum(w for _, w in SOURCES)
    versions = {}
    for k, (name, weight) in enumerate(SOURCES):
        n = rows * weight // total
        if name in conn.table_names():
            versions[name] = conn.open_table(name).version
            continue
        rng = np.random.default_rng(k)
        x = rng.normal(size=(n, DIM)).astype(np.float32)
        data = pa.table({"id": np.arange(n, dtype=np.int64),
                         "x": pa.FixedSizeListArray.from_arrays(pa.array(x.ravel()), DIM),
                         "label": (x.sum(axis=1) > 0).astype(np.int64) + 2 * (k % 2)})
        versions[name] = conn.create_table(name, data).version
    return versions


def sources(db: str, versions: dict[str, int]) -> list[lance_ray.Source]:
    conn = lancedb.connect(db)
    return [lance_ray.Source(conn.open_table(name), weight=w, table_version=versions[name])
            for name, w in SOURCES]


def train_loop(config: dict[str, Any]) -> None:
    """``train_loop_per_worker``: runs on every rank, from the top after every restart."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if config.get("coordinator"):  # the coordinator holds the plans and merged progress
        ds = lt.get_dataset(config["coordinator"], columns=["id", "x", "label"])
    else:
        ds = lt.get_mixture(sources(config["db"], config["versions"]),
                            num_splits=config["num_splits"], shuffle_seed=config["seed"],
                            stop="first_exhausted", columns=["id", "x", "label"])
    rank, world_size = ds.rank, ds.world_size
    model = torch.nn.Linear(DIM, 4)
    saved = lt.load_model_state()
    trained = 0 if saved is None else saved["step"]  # the model's optimizer steps, saved with it
    if saved is not None:
        model.load_state_dict(saved["model"])
    ddp = ray.train.torch.prepare_model(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    attempt = Attempt(shared_attempt_id(rank), ds.global_step, world_size, time.time(),
                      model_step=trained)
    log = SampleLog(config["log_dir"], attempt, rank)
    logger.info("rank %d/%d starts at global step %d", rank, world_size, ds.global_step)
    loss = torch.tensor(0.0)
    for batch in ds.iter_batches(config["global_batch"] // world_size):
        step = ds.global_step
        loss = optimizer_step(opt, torch.nn.functional.cross_entropy(ddp(batch["x"]),
                                                                      batch["label"]))
        trained += 1
        log.write(step, [list(p) for p in zip(batch["source"].tolist(), batch["id"].tolist())])
        crash_once(config, step, rank, world_size)
        if step % config["checkpoint_every"] == 0 or step == config["stop_at_step"]:
            lt.report({"loss": loss.item()}, ds,
                      model_state={"model": model.state_dict(), "step": trained})
        if config["stop_at_step"] and step >= config["stop_at_step"]:
            break
    else:
        if ds.global_step % config["checkpoint_every"]:
            lt.report({"loss": loss.item()}, ds,
                      model_state={"model": model.state_dict(), "step": trained})
    log.close()


def run_job(workdir: Path, *, workers: int, num_splits: int, global_batch: int,
            checkpoint_every: int, crash_at_step: int, stop_at_step: int, seed: int,
            versions: dict[str, int], name: str = "mixture",
            coordinator: str | None = None) -> dict[str, Any]:
    """One Ray job of the run: trains until ``stop_at_step`` (0: the epoch's end)."""
    lt.check_world_sizes(workers, num_splits)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"db": str(workdir / "db"), "versions": versions,
                           "num_splits": num_splits, "seed": seed,
                           "global_batch": global_batch, "checkpoint_every": checkpoint_every,
                           "crash_at_step": crash_at_step, "stop_at_step": stop_at_step,
                           "log_dir": str(workdir / "samples"),
                           "coordinator": coordinator},
        scaling_config=ray.train.ScalingConfig(
            num_workers=workers,
            resources_per_worker=worker_resources(workers)),
        run_config=ray.train.RunConfig(
            name=name, **lt.run_storage(workdir / "storage"),
            failure_config=ray.train.FailureConfig(max_failures=2),
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=2)))
    return dict(trainer.fit().metrics or {})


def planned_samples(workdir: Path, versions: dict[str, int], num_splits: int,
                    seed: int) -> list[tuple[int, int]]:
    """The ``(source, id)`` samples of the epoch, read by one rank without interruption."""
    ds = lance_ray.MixtureDataset(sources(str(workdir / "db"), versions),
                                  num_splits=num_splits, shuffle_seed=seed,
                                  stop="first_exhausted", columns=["id"], reader="local")
    return [(s, i) for b in ds.iter_batches(256)
            for s, i in zip(b["source"].tolist(), b["id"].tolist())]


def proof(workdir: Path, versions: dict[str, int], num_splits: int,
          seed: int = 0) -> dict[str, Any]:
    """Per source: planned, trained once, repeated, lost; the observed mix. Exactly once
    means the trained samples are the planned ones, each once (which ids, not how many)."""
    # What the final model trained on; raises where an attempt's log does not follow from
    # its restored checkpoint (model and data resumed at different steps, steps trained twice).
    steps = lineage(workdir / "samples")
    trained = [(s, i) for step in steps for s, i in step]
    attempts = [a for a, _ in read_attempts(workdir / "samples")]
    planned = planned_samples(workdir, versions, num_splits, seed)
    total_w = sum(w for _, w in SOURCES)
    out: dict[str, Any] = {"attempts": [(a.world_size, a.resumed_from_step) for a in attempts],
                           "steps": len(steps), "samples": len(trained), "sources": []}
    for i, (name, weight) in enumerate(SOURCES):
        want = Counter(x for s, x in planned if s == i)
        ids = Counter(x for s, x in trained if s == i)
        out["sources"].append({
            "source": name, "weight": weight / total_w, "planned": sum(want.values()),
            "once": sum(1 for x, c in ids.items() if c == 1 and x in want),
            "repeated": sum(1 for c in ids.values() if c > 1),
            "lost": sum((want - ids).values()), "unexpected": sum((ids - want).values()),
            "observed": sum(ids.values()) / max(len(trained), 1)})
    out["exactly_once"] = Counter(trained) == Counter(planned) and all(
        c == 1 for c in Counter(trained).values())
    return out


def print_proof(p: dict[str, Any]) -> None:
    print(f"\nattempts (world size, resumed from step): {p['attempts']}; "
          f"{p['steps']} global steps, {p['samples']} samples trained on")
    print(f"{'source':>7} {'planned':>8} {'once':>6} {'repeat':>7} {'lost':>5} {'unexp':>6} "
          f"{'weight':>7} {'observed':>9}")
    for s in p["sources"]:
        print(f"{s['source']:>7} {s['planned']:>8} {s['once']:>6} {s['repeated']:>7} "
              f"{s['lost']:>5} {s['unexpected']:>6} {s['weight']:>7.3f} {s['observed']:>9.3f}")
    print("PROOF:", "every sample of every source exactly once" if p["exactly_once"]
          else "FAILED")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default="runs/mixture")
    parser.add_argument("--rows", type=positive_int, default=4000,
                        help="rows of all sources together")
    parser.add_argument("--num-splits", type=positive_int, default=4)
    parser.add_argument("--global-batch", type=positive_int, default=40)
    parser.add_argument("--workers", type=positive_int, default=4)
    parser.add_argument("--then", type=positive_int, default=2, help="world size after the resize")
    parser.add_argument("--checkpoint-every", type=positive_int, default=3)
    parser.add_argument("--crash-at-step", type=int, default=5)
    parser.add_argument("--stop-at-step", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--coordinator", action="store_true",
                        help="read through a mixture coordinator (Coordinator.create over the "
                             "sources) instead of the checkpoint route")
    args = parser.parse_args(argv)
    for flag, workers in (("--workers", args.workers), ("--then", args.then)):
        check_run_sizes(workers, args.num_splits, args.global_batch, workers_from=flag)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    workdir = Path(args.workdir).resolve()
    mine = workdir / ".train_mixture"  # this job made the directory: its to clean
    if workdir.is_dir() and any(workdir.iterdir()) and not mine.exists():
        raise SystemExit(f"--workdir {workdir} holds files of something else; this job starts "
                         "afresh in its workdir (it deletes its db, samples, storage and "
                         "coordinator there): pass a new or empty directory")
    workdir.mkdir(parents=True, exist_ok=True)
    mine.touch()
    for stale in ("db", "samples", "storage", "coordinator"):
        # Each run proves itself: an earlier run's tables, logs and checkpoints would be
        # resumed instead (and its crash marker, in samples/, skip this run's crash).
        shutil.rmtree(workdir / stale, ignore_errors=True)
    versions = make_tables(str(workdir / "db"), args.rows)
    started = not ray.is_initialized()
    if started:
        ray.init(address=os.environ.get("RAY_ADDRESS", "local"), num_cpus=2,
                 resources={"slot": 8}, include_dashboard=False)
    coord = None
    if args.coordinator:  # in the driver: it outlives the train workers and their restarts
        coord = lance_ray.Coordinator.create(
            sources(str(workdir / "db"), versions), f"train-mixture-{uuid.uuid4().hex[:8]}",
            storage_path=str(workdir / "coordinator"), world_size=args.workers,
            num_splits=args.num_splits, shuffle_seed=args.seed, stop="first_exhausted")
    common = {"num_splits": args.num_splits, "global_batch": args.global_batch,
              "checkpoint_every": args.checkpoint_every, "seed": args.seed,
              "versions": versions, "coordinator": coord and coord.name}
    run_job(workdir, workers=args.workers, crash_at_step=args.crash_at_step,
            stop_at_step=args.stop_at_step, **common)
    metrics = run_job(workdir, workers=args.then, crash_at_step=-1, stop_at_step=0, **common)
    result = proof(workdir, versions, args.num_splits, args.seed)
    result["global_step"] = metrics.get("global_step")
    if coord is not None:
        result["coordinator_step"] = coord.status()["sealed_step"]
        coord.release_version()
        coord.kill()
    print_proof(result)
    if started:
        ray.shutdown()
    return result


if __name__ == "__main__":
    raise SystemExit(0 if main()["exactly_once"] else 1)
