r"""Train a small PyTorch model with Ray Train's TorchTrainer on a Lance table, exactly once.

    python -m jobs.make_table --db runs/demo/db                 # the table, once
    python -m jobs.train --db runs/demo/db --workers 2 --crash-at-step 30 --stop-at-step 60
    python -m jobs.train --db runs/demo/db --workers 4          # resumes the same run
    python -m jobs.train --db runs/demo/db --name elastic-run --min-workers 2 --workers 4 \
        --num-splits 12 --global-batch 48 --resize-interval 5  # elastic: a run of its own
    ray job submit --address "$(cluster/local.sh address)" --working-dir . -- \
        python -m jobs.train --db "$PWD/runs/demo/db" --storage-path "$PWD/runs/demo/storage"

A job from ``ray job submit --working-dir .`` runs in a copy of the working dir, so give it
absolute paths (``$PWD/...``, expanded by your shell) for the table and the run storage.

Every rank logs the sample ids of each global step under ``<storage>/<name>/samples`` so
``jobs/verify.py`` can prove that the final model saw every sample exactly once. Re-running
with the same ``--name`` and ``--storage-path`` resumes from the latest checkpoint, on any
``--workers`` that divides ``--num-splits``. With ``--min-workers`` the run is elastic
within the job: Ray Train checks every ``--resize-interval`` seconds whether the cluster
can hold more workers and restarts the group at the new size from the latest checkpoint.
"""

from __future__ import annotations

import argparse
import logging
import os
import time
from typing import Any

os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")

import lancedb
import ray
import ray.train
import torch
from ray.train.torch import TorchTrainer

import lance_ray.train as lt
from jobs.args import check_run_sizes, non_negative_float, positive_int
from lance_ray import storage
from lance_ray.cli import print_status
from lance_ray.driver.handle import Coordinator
from lance_ray.proof.audit import Attempt, SampleLog, new_attempt_id
from lance_ray.storage import read_json, write_json_atomic
from lance_ray.view.stats import progress_bar

logger = logging.getLogger("train")
READ_CPUS = 0.5  # what each read task asks for: train workers and reads share the CPUs


def shared_attempt_id(rank: int) -> str:
    """One id for all ranks of this worker-group start (rank 0's, broadcast)."""
    ids = [new_attempt_id() if rank == 0 else None]
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.broadcast_object_list(ids, src=0)
    return str(ids[0])


def train_loop(config: dict[str, Any]) -> None:
    """``train_loop_per_worker``: runs on every rank, again from the top after a failure."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    announce_worker(config["log_dir"], rank, world_size)
    view_started = time.monotonic()
    ds = lt.get_dataset(config["name"], columns=["id", "v", "label"], read_batch_size=1024,
                        ray_remote_args={"num_cpus": READ_CPUS})
    view_s = time.monotonic() - view_started
    model = torch.nn.Sequential(torch.nn.Linear(config["dim"], 32), torch.nn.ReLU(),
                                torch.nn.Linear(32, 10))
    saved = lt.load_model_state()
    # The optimizer steps the model has taken, the trainer's own count saved with it: the
    # proof checks that the data resumed at the same step.
    trained = 0 if saved is None else saved["step"]
    if saved is not None:
        model.load_state_dict(saved["model"])
    ddp = ray.train.torch.prepare_model(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    attempt = Attempt(shared_attempt_id(rank), ds.global_step, world_size, time.time(),
                      view_s=round(view_s, 6), model_step=trained)
    log = SampleLog(config["log_dir"], attempt, rank)
    stop_at, every = config["stop_at_step"], config["checkpoint_every"]
    logger.info("rank %d/%d starts at global step %d", rank, world_size, ds.global_step)
    started, rows = time.monotonic(), 0
    loss = torch.tensor(0.0)
    for batch in ds.iter_batches(config["global_batch"] // world_size):
        step = ds.global_step
        loss = optimizer_step(opt, torch.nn.functional.cross_entropy(ddp(batch["v"]),
                                                                      batch["label"]))
        trained += 1
        if config["step_delay_s"]:
            time.sleep(config["step_delay_s"])  # stands in for a real model's compute
        log.write(step, batch["id"].tolist(), wait_s=ds.stats.last_wait_s)
        rows += len(batch["id"])
        crash_once(config, step, rank, world_size)
        if step % every == 0 or step == stop_at:
            lt.report({"loss": loss.item()}, ds,
                      model_state={"model": model.state_dict(), "step": trained})
            if rank == 0:
                log.checkpoint(step)
                done, total = len(ds) - ds.samples_remaining, len(ds)
                rate = rows / (time.monotonic() - started)
                logger.info("step %d %s %d/%d samples of rank 0, %.0f rows/s, ETA %.0fs, "
                            "loss %.3f", step, progress_bar(done, total), done, total, rate,
                            (total - done) / rate if rate else 0.0, loss.item())
        if stop_at and step >= stop_at:
            break
    else:
        if ds.global_step % every:
            lt.report({"loss": loss.item()}, ds,
                      model_state={"model": model.state_dict(), "step": trained})
            if rank == 0:
                log.checkpoint(ds.global_step)
    log.close()


def optimizer_step(opt: torch.optim.Optimizer, loss: torch.Tensor) -> torch.Tensor:
    """One step of ``opt`` down ``loss``'s gradient; returns ``loss``."""
    opt.zero_grad()
    loss.backward()
    opt.step()
    return loss


def crash_once(config: dict[str, Any], step: int, rank: int, world_size: int) -> None:
    """Kill this worker at ``config["crash_at_step"]`` if it is the last rank, once per run
    (a marker under the log dir, a path or URI, tells the restarted group it happened)."""
    if step != config["crash_at_step"] or rank != world_size - 1:
        return
    marker = storage.join(config["log_dir"], "crash-injected")
    if storage.exists(marker):
        return
    storage.write_bytes_atomic(marker, b"")
    logger.warning("rank %d: injected crash at global step %d", rank, step)
    os._exit(1)


def add_run_arguments(p: argparse.ArgumentParser, *, checkpoint_every: int) -> None:
    """The options every training job here shares: checkpoints, stop, crash, retries."""
    p.add_argument("--checkpoint-every", type=positive_int, default=checkpoint_every)
    p.add_argument("--stop-at-step", type=int, default=0, help="stop after this step (0: epoch)")
    p.add_argument("--crash-at-step", type=int, default=-1, help="kill a worker once here")
    p.add_argument("--max-failures", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--address", default=None)


def run_config(name: str, storage_uri: str, max_failures: int) -> ray.train.RunConfig:
    """The run's Ray Train storage (a path or URI), retries and kept checkpoints."""
    return ray.train.RunConfig(
        name=name, **lt.run_storage(storage_uri),
        failure_config=ray.train.FailureConfig(max_failures=max_failures),
        checkpoint_config=ray.train.CheckpointConfig(num_to_keep=3))


def worker_resources(workers: int) -> dict[str, float]:
    """One train slot per worker on a cluster that has slots (``cluster/local.sh``, KubeRay,
    the launcher: train workers then never take the CPUs Ray Data reads need; an elastic run
    grows as slots join); half a CPU on a cluster without any (a plain ``ray.init``).

    A cluster with slots, but fewer than ``workers``, is refused: a group asking for slots
    would wait for them forever, and one asking for CPUs instead would take the few CPUs
    that Ray Data's reads need (all of a ``cluster/local.sh`` cluster's) and hang."""
    resources = ray.cluster_resources()
    slots = int(resources.get("slot", 0))
    if not slots:
        # Half a CPU each, and at least a read task's half left over: with no CPU left for
        # the reads the group would wait for ever (a local cluster of no worker nodes).
        if resources.get("CPU", 0.0) - 0.5 * workers < READ_CPUS:
            raise SystemExit(
                f"{workers} train workers at 0.5 CPU each leave no CPU for the reads on this "
                f"cluster ({resources.get('CPU', 0.0):g} CPUs, no train slots): add nodes (a "
                "local cluster: cluster/local.sh resize 1) or lower --workers")
        return {"CPU": 0.5}
    if slots < workers:
        raise SystemExit(
            f"{workers} train workers need {workers} train slots, but the cluster has "
            f"{slots} train slot(s): add nodes (a local cluster: cluster/local.sh resize "
            f"{-(-workers // 2)}, at 2 slots a node; an autoscaling one: "
            f"ray.autoscaler.sdk.request_resources(bundles=[{{'slot': 1}}] * {workers})), "
            f"or lower --workers (--min-workers, for an elastic run) to at most {slots}")
    return {"slot": 1}


def announce_worker(log_dir: str, rank: int, world_size: int) -> None:
    """Record this train worker's pid, so fault injection (``jobs/faults/chaos.py --trainer``)
    can find the process of a rank in the current group."""
    record = {"pid": os.getpid(), "rank": rank, "world_size": world_size, "t": time.time(),
              "node": ray.get_runtime_context().get_node_id()}
    storage.write_json_atomic(storage.join(log_dir, "workers", f"{os.getpid()}.json"), record)


def connect(address: str | None) -> None:
    """Join the cluster named by ``--address`` or ``RAY_ADDRESS`` (``ray job submit`` sets
    it); otherwise start a local one with train slots, sized for 2 cores."""
    if ray.is_initialized():
        return
    if address or os.environ.get("RAY_ADDRESS"):
        ray.init(address=address)
    else:
        ray.init(address="local", num_cpus=2, resources={"slot": 8}, include_dashboard=False)


def open_table(db_uri: str, name: str) -> Any:
    """The run's table; a missing one exits naming the database and how to create it."""
    try:
        return lancedb.connect(db_uri).open_table(name)
    except ValueError as e:
        if "not found" not in str(e):
            raise
    raise SystemExit(
        f"no table {name!r} in the LanceDB database {db_uri}: create it with `python -m "
        f"jobs.make_table --db {db_uri} --name {name}`, or pass the --db and --table that hold "
        "it (a job from `ray job submit --working-dir .` runs in a copy of the working dir: "
        "give it absolute paths, e.g. \"$PWD/runs/demo/db\")")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--db", default="runs/demo/db")
    p.add_argument("--table", default="demo")
    p.add_argument("--name", default="demo-run", help="run name (RunConfig and coordinator)")
    p.add_argument("--storage-path", default="runs/demo/storage")
    p.add_argument("--workers", type=positive_int, default=2)
    p.add_argument("--min-workers", type=positive_int, default=None,
                   help="elastic training: ScalingConfig(num_workers=(min, --workers))")
    p.add_argument("--resize-interval", type=non_negative_float, default=60.0,
                   help="elastic training: seconds between Ray Train's checks for a "
                        "cluster that can hold more workers "
                        "(ScalingConfig.elastic_resize_monitor_interval_s)")
    p.add_argument("--step-delay", type=non_negative_float, default=0.0,
                   help="seconds each step sleeps, standing in for model compute")
    p.add_argument("--num-splits", type=positive_int, default=8)
    p.add_argument("--global-batch", type=positive_int, default=64)
    add_run_arguments(p, checkpoint_every=20)
    p.add_argument("--local-mode", action="store_true",
                   help="run the loop in this process (ScalingConfig(num_workers=0))")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run (or resume) the training run; returns its final metrics."""
    args = parser().parse_args(argv)
    if args.local_mode:
        args.workers = 1
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    # I/O: --db and --storage-path are local paths or URIs (s3://...), via lance_ray.storage.
    db_uri, storage_uri = storage.absolute(args.db), storage.absolute(args.storage_path)
    run_dir = storage.join(storage_uri, args.name)

    num_workers = args.workers if args.min_workers is None else (args.min_workers, args.workers)
    check_run_sizes(num_workers, args.num_splits, args.global_batch)
    connect(args.address)
    table = open_table(db_uri, args.table)
    run = {"db": db_uri, "table": args.table,
           "num_splits": args.num_splits, "shuffle_seed": args.seed,
           "global_batch": args.global_batch, "table_version": table.version}
    run_file = storage.join(run_dir, "run.json")
    if storage.exists(run_file):  # a resumed run keeps its plan and global batch
        saved = read_json(run_file)
        changed = {k: (saved[k], v) for k, v in run.items() if saved.get(k) != v
                   and k != "table_version"}
        if changed:
            raise SystemExit(f"run {args.name!r} was started with other settings: {changed}")
        run = saved
    else:
        write_json_atomic(run_file, run)
    # Keep the handle: a non-detached actor lives only as long as its handle does.
    ledger_dir = storage.join(run_dir, "coordinator")
    coordinator = Coordinator.create(table, args.name, storage_path=ledger_dir,
                       world_size=args.workers, num_splits=args.num_splits,
                       shuffle_seed=args.seed, table_version=run["table_version"])
    if not coordinator.created:  # a live one: its job's driver holds it (it dies with it)
        raise SystemExit(f"run {args.name!r} is running in another job (its coordinator is "
                         "live): wait for that job to end, or stop it (ray job stop), then "
                         "submit this one again to resume the run")
    resources = worker_resources(args.min_workers or args.workers)
    scaling = ray.train.ScalingConfig(num_workers=0 if args.local_mode else num_workers,
                                      resources_per_worker=resources,
                                      elastic_resize_monitor_interval_s=args.resize_interval)
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"name": args.name, "dim": 16, "global_batch": args.global_batch,
                           "checkpoint_every": args.checkpoint_every,
                           "stop_at_step": args.stop_at_step, "crash_at_step": args.crash_at_step,
                           "step_delay_s": args.step_delay,
                           "log_dir": storage.join(run_dir, "samples")},
        scaling_config=scaling,
        run_config=run_config(args.name, storage_uri, args.max_failures),
    )
    result = trainer.fit()
    status = coordinator.status()
    coordinator.kill()  # its sealed progress stays on storage for the next job of this run
    metrics = dict(result.metrics or {})
    print(f"run {args.name!r} on {args.workers} workers finished at global step "
          f"{metrics.get('global_step')}; coordinator status:")
    print_status({**status, "namespace": coordinator.namespace})
    return metrics


if __name__ == "__main__":
    main()
