"""Chaos trials: kill a rank, the coordinator, or a whole node at a random step, recover the
way Ray Train does, and prove exactly-once coverage every time.

    python -m jobs.faults.chaos --trials 24 [--seed 0]
    python -m jobs.faults.chaos --trainer --trials 20 [--seed 0] [--kinds sigkill,node,...]

``--trainer`` runs the trials in real TorchTrainer runs (``jobs/train.py``, elastic over
2..4 workers): SIGKILL of a train worker, node removal, a coordinator kill, a kill inside
``lance_ray.train.report``, a kill during an elastic resize, and a plain grow-and-shrink;
see ``jobs/faults/chaos_trainer.py``. It prints the proof table and the recovery times.
Without it, the trials below use stand-in rank actors:

Each trial runs one epoch on a real multi-node Ray cluster (``ray.cluster_utils.Cluster``,
head + 2 worker nodes). Ranks are actors spread over the worker nodes; every
``--checkpoint-every`` steps the driver gathers every rank's state at the same step and keeps
the merged state, as ``ray.train.report`` keeps a checkpoint. Faults:

* ``rank``: kill one rank's process; all ranks restart from the last checkpoint (Ray
  Train's full worker-group restart);
* ``checkpoint``: kill a rank while the states of a checkpoint are being gathered, so that
  checkpoint never completes;
* ``coordinator``: kill the coordinator actor; Ray restarts it, it reloads its ledger, and
  the ranks continue without restarting;
* ``node``: remove a worker node with its ranks; the run resumes from the last checkpoint on
  a different world size (the surviving slots), then a replacement node joins.

The sample ids of every step are logged per attempt; the steps the final state descends from
must hold every planned sample exactly once, with the same sample set per global step as an
uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")

import ray

import lance_ray
from jobs.faults import chaos_report, chaos_trainer
from lance_ray.driver.handle import Coordinator
from lance_ray.proof.verify import CoverageReport, compare_steps, coverage
from lance_ray.testing.ranks import Rank
from lance_ray.testing.tables import create_table

logger = logging.getLogger("chaos")
KINDS = ("rank", "checkpoint", "coordinator", "node")
NUM_SPLITS, GLOBAL_BATCH, CHECKPOINT_EVERY = 8, 32, 5


@dataclass
class Trial:
    kind: str
    step: int
    recovered: bool = False
    world_sizes: str = ""
    report: CoverageReport | None = None
    error: str = ""


def start_ranks(name: str, world_size: int, state: dict) -> list[Any]:
    return [Rank.options(resources={"slot": 1}, scheduling_strategy="SPREAD")
            .remote(r, world_size, GLOBAL_BATCH // world_size, coordinator=name, state=state,
                    reader="local", read_batch_size=128) for r in range(world_size)]


def remove_a_rank_node(cluster: Any, ranks: list[Any]) -> None:
    """Remove a worker node (never the head) that hosts one of ``ranks``."""
    hosts = set(ray.get([r.node.remote() for r in ranks]))
    victim = next(n for n in cluster.worker_nodes if n.node_id in hosts)
    cluster.remove_node(victim)


def run_trial(cluster: Any, uri: str, version: int, kind: str, kill_step: int, store: str,
              trial_name: str, uninterrupted: list[list[int]], node_args: dict) -> Trial:
    """One epoch with one fault; ``node_args`` make the replacement for a removed node."""
    trial = Trial(kind, kill_step)
    coord = Coordinator.create(uri, trial_name, storage_path=store, world_size=2,
                               num_splits=NUM_SPLITS, table_version=version, lease_version=False)
    checkpoint = coord.initial_state()
    world_size, sizes = 2, ["2"]
    ranks = start_ranks(trial_name, world_size, checkpoint)
    steps: dict[int, list[int]] = {}
    step, injected = 0, False
    while True:
        try:
            if not injected and step == kill_step and kind != "checkpoint":
                injected = True
                if kind == "rank":
                    ray.kill(ranks[-1])
                elif kind == "coordinator":
                    ray.kill(coord.handle, no_restart=False)
                elif kind == "node":
                    remove_a_rank_node(cluster, ranks)
            parts = ray.get([r.next.remote() for r in ranks])
            if all(p is None for p in parts):
                break
            step += 1
            steps[step] = [i for p in parts if p for i in p]
            if step % CHECKPOINT_EVERY == 0:
                refs = [r.state.remote() for r in ranks]
                if kind == "checkpoint" and not injected and step >= kill_step:
                    injected = True
                    ray.kill(ranks[0])
                states = ray.get(refs)
                checkpoint = lance_ray.merge_state_dicts(states)
        except ray.exceptions.RayError as e:  # a rank died: restart the group (Ray Train)
            trial.recovered = True
            for r in ranks:
                ray.kill(r)
            if kind == "node":
                world_size = 1  # the surviving slots, until a replacement node joins
                cluster.add_node(**node_args)
            logger.info("%s: %s at step %d; restarting %d rank(s) from step %s", trial_name,
                        type(e).__name__, step, world_size, checkpoint["lance_ray"]["global_step"])
            step = checkpoint["lance_ray"]["global_step"]
            steps = {s: ids for s, ids in steps.items() if s <= step}
            coord.load_state_dict(checkpoint)
            sizes.append(str(world_size))
            ranks = start_ranks(trial_name, world_size, checkpoint)
    if kind == "coordinator":  # recovered: the restarted actor sealed the final step
        deadline = time.monotonic() + 20
        while coord.status()["sealed_step"] != step and time.monotonic() < deadline:
            time.sleep(0.1)
        trial.recovered = coord.status()["sealed_step"] == step
    got = [steps[s] for s in sorted(steps)]
    report = coverage([i for s in uninterrupted for i in s], [], [i for s in got for i in s])
    trial.report = compare_steps(report, uninterrupted, got)
    trial.world_sizes = "->".join(sizes)
    for r in ranks:
        ray.kill(r)
    coord.kill()
    return trial


def run_trials(cluster: Any, trials: int, seed: int, node_args: dict, *, rows: int = 1200,
               kinds: tuple[str, ...] = KINDS) -> list[Trial]:
    """``trials`` random faults on ``cluster`` (already connected); kinds take turns."""
    rng = random.Random(seed)
    work = Path(tempfile.mkdtemp(prefix="lance_ray_chaos_"))
    table = create_table(str(work / "db"), rows=rows, dim=4)
    uri, version = table.to_lance().uri, table.version
    ds = lance_ray.StreamingDataset(uri, num_splits=NUM_SPLITS, table_version=version,
                                    columns=["id"], reader="local")
    uninterrupted = [b["id"].tolist() for b in ds.iter_batches(GLOBAL_BATCH)]
    out = []
    for i in range(trials):
        kind = kinds[i % len(kinds)]
        step = rng.randrange(1, len(uninterrupted) - 1)
        started = time.monotonic()
        trial = run_trial(cluster, uri, version, kind, step, str(work / "store"), f"chaos{i}",
                          uninterrupted, node_args)
        r = trial.report
        logger.info("trial %d: kill %s at step %d -> dupes %d lost %d (%.0fs)", i, kind, step,
                    r.duplicates if r else -1, r.lost if r else -1, time.monotonic() - started)
        out.append(trial)
    return out


def print_table(trials: list[Trial]) -> bool:
    print(f"{'trial':>5} {'kind':<12} {'step':>4} {'recovered':>9} {'world sizes':<11} "
          f"{'dupes':>5} {'lost':>4} {'steps = uninterrupted':>21}")
    ok = True
    for i, t in enumerate(trials):
        r = t.report
        assert r is not None
        good = r.exactly_once and r.steps_identical and t.recovered
        ok &= good
        print(f"{i:>5} {t.kind:<12} {t.step:>4} {str(t.recovered):>9} {t.world_sizes:<11} "
              f"{r.duplicates:>5} {r.lost:>4} {f'{r.steps_matching}/{r.steps_compared}':>21}")
    total_d = sum(t.report.duplicates for t in trials if t.report)
    total_l = sum(t.report.lost for t in trials if t.report)
    print(f"{len(trials)} trials: {total_d} duplicates, {total_l} lost -> "
          f"{'PASS' if ok else 'FAIL'}")
    return ok


def run_trainer_trials(trials: int, seed: int, kinds: tuple[str, ...], work: Path,
                       shape: chaos_trainer.RunShape) -> list[chaos_trainer.TrainerTrial]:
    """``trials`` faults in real TorchTrainer runs on a cluster of this process's own."""
    from ray.cluster_utils import Cluster

    create_table(str(work / "db"), "demo", rows=shape.rows, dim=16, fragments=3)
    cluster = Cluster(initialize_head=True, connect=True, head_node_args={
        "num_cpus": 1, "resources": {"slot": 2}, "include_dashboard": False,
        "temp_dir": str(work / "r")})  # short: Ray puts unix sockets under it
    runner = chaos_trainer.TrialRunner(cluster, work, work / "db", shape)
    out = []
    try:
        plan = chaos_trainer.pick_steps(random.Random(seed), kinds, trials, shape)
        for i, (kind, step) in enumerate(plan):
            started = time.monotonic()
            trial = runner.run(i, kind, step)
            logger.info("trial %d: %s at step %d -> %s in %.0fs: %s", i, kind, trial.step,
                        "ok" if trial.ok else "FAIL", time.monotonic() - started,
                        json.dumps(trial.summary()))
            out.append(trial)
    finally:
        ray.shutdown()
        cluster.shutdown()
    return out


def trainer_main(args: argparse.Namespace) -> bool:
    kinds = tuple(args.kinds.split(",")) if args.kinds else chaos_trainer.KINDS
    unknown = set(kinds) - set(chaos_trainer.KINDS)
    if unknown:
        raise SystemExit(f"unknown --kinds {sorted(unknown)}; choose from {chaos_trainer.KINDS}")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="lrchaos_")).resolve()
    work.mkdir(parents=True, exist_ok=True)
    shape = chaos_trainer.RunShape(rows=args.rows or chaos_trainer.RunShape.rows)
    trials = run_trainer_trials(args.trials, args.seed, kinds, work, shape)
    ok = chaos_report.print_trials(trials)
    chaos_report.print_recoveries(trials, shape)
    if args.json:
        Path(args.json).write_text(json.dumps([t.summary() for t in trials], indent=1))
    print(f"run logs and sample logs: {work}")
    return ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=24)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--trainer", action="store_true", help="faults in real TorchTrainer runs")
    p.add_argument("--kinds", default="", help="--trainer: comma-separated fault kinds "
                   f"(default: all of {','.join(chaos_trainer.KINDS)}, taking turns)")
    p.add_argument("--rows", type=int, default=0, help="--trainer: table rows")
    p.add_argument("--workdir", default="", help="--trainer: where tables, Ray and logs go")
    p.add_argument("--json", default="", help="--trainer: write the trial summaries here")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.trainer:
        sys.exit(0 if trainer_main(args) else 1)
    from ray.cluster_utils import Cluster

    node_args = {"num_cpus": 1, "resources": {"slot": 2}}
    cluster = Cluster(initialize_head=True, connect=True,
                      head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(**node_args)
    cluster.wait_for_nodes()
    try:
        ok = print_table(run_trials(cluster, args.trials, args.seed, node_args))
    finally:
        ray.shutdown()
        cluster.shutdown()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
