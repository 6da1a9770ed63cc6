"""Train a tiny causal transformer with TorchTrainer on packed token blocks, exactly once.

    python -m jobs.train_lm --demo                       # table, crash, resize, proof
    python -m jobs.train_lm --db runs/lm/db --workers 2 --crash-at-step 6 --stop-at-step 12
    python -m jobs.train_lm --db runs/lm/db --workers 4  # resumes the same run, resized
    python -m jobs.verify --storage-path runs/lm/storage --name lm-run

The table holds one tokenised document per row (``jobs/make_table.py --tokens``). Every
rank reads its splits packed into blocks of ``--block-len`` tokens (``pack_sequences``,
from lance_ray or, with ``--reader reference``, from ``lancedb.streaming``), trains, and
logs the content id of every block at every global step under
``<storage>/<name>/samples``; checkpoints carry the model, the optimizer and every rank's
packed data state. ``jobs/verify.py`` proves from those logs that the final model trained on
every block of the epoch exactly once and that each global step held the same blocks as
one uninterrupted rank of the reference.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")

import ray
import ray.train
import torch
from ray.train.torch import TorchTrainer

import lance_ray.train as lt
from jobs import lm_data, lm_model
from jobs import train as train_job
from jobs.args import check_run_sizes, non_negative_int, positive_int
from jobs.lm_data import PackedView, PackSpec, block_ids, merge_for
from jobs.lm_model import TinyLM, lm_loss
from lance_ray import storage
from lance_ray.proof.audit import Attempt, SampleLog
from lance_ray.storage import read_json, write_json_atomic
from lance_ray.testing import tables as make_table

logger = logging.getLogger("train_lm")

PACK_COLUMN = "tokens"  # make_table.token_batch's


def restore(reader: str) -> tuple[dict | None, dict | None]:
    """The merged data state and the model/optimizer state of the checkpoint being
    restored (None, None on a fresh start)."""
    state = lt.restored_data_state(merge=merge_for(reader))
    return (None, None) if state is None else (state, lt.load_model_state())


def train_loop(config: dict[str, Any]) -> None:
    """``train_loop_per_worker``: runs on every rank, again from the top after a failure."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    torch.set_num_threads(1)  # ranks share the machine's cores
    torch.manual_seed(config["seed"])  # every rank starts from the same weights
    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    train_job.announce_worker(config["log_dir"], rank, world_size)
    spec = PackSpec(**config["pack"])
    started = time.monotonic()
    state, saved = restore(config["reader"])
    view = PackedView(spec, config["reader"], rank, world_size, state,
                      coordinator=config.get("coordinator"))
    view_s = time.monotonic() - started
    model = TinyLM(config["vocab"], spec.block_len)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    trained = 0  # the optimizer steps the model has taken (saved with it: the proof's check)
    if saved is not None:
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        trained = saved["step"]
    ddp = ray.train.torch.prepare_model(model)
    attempt = Attempt(train_job.shared_attempt_id(rank), view.global_step, world_size,
                      time.time(), view_s=round(view_s, 6), model_step=trained)
    log = SampleLog(config["log_dir"], attempt, rank)
    stop_at, every = config["stop_at_step"], config["checkpoint_every"]
    logger.info("rank %d/%d starts at global step %d", rank, world_size, view.global_step)

    def checkpoint(loss: float) -> None:
        lt.report({"loss": loss}, view,  # type: ignore[arg-type]  (duck-typed view)
                  model_state={"model": model.state_dict(), "optimizer": opt.state_dict(),
                               "step": trained})
        if rank == 0:
            log.checkpoint(view.global_step)
            logger.info("step %d: loss %.3f, %.1f steps/s", view.global_step, loss,
                        view.global_step / (time.monotonic() - started))

    loss = torch.tensor(0.0)
    for batch in view.iter_batches():
        step = view.global_step
        loss = train_job.optimizer_step(
            opt, lm_loss(ddp, batch["input_ids"], batch["doc_ids"], spec.pad_id))
        trained += 1
        log.write(step, block_ids(batch))
        train_job.crash_once(config, step, rank, world_size)
        if step % every == 0 or step == stop_at:
            checkpoint(loss.item())
        if stop_at and step >= stop_at:
            break
    else:
        if view.global_step % every:
            checkpoint(loss.item())
    log.close()


def run_spec(args: argparse.Namespace, db_uri: str, run_dir: str) -> dict[str, Any]:
    """The run's settings: written by its first job, checked by every later one (a resumed
    run keeps its table version, plan, packing and global batch)."""
    import lancedb

    run_file = storage.join(run_dir, "run.json")
    if storage.exists(run_file):
        run = read_json(run_file)
        asked = {"reader": args.reader, "num_splits": args.num_splits,
                 "global_batch": args.global_batch, "block_len": args.block_len,
                 # 0 (every token) is the count the first job made
                 **({"blocks_per_epoch": args.blocks_per_epoch} if args.blocks_per_epoch
                    else {})}
        saved = {"reader": run["reader"], **{k: run["pack"][k] for k in asked if k != "reader"}}
        if saved != asked:
            raise SystemExit(f"run {args.name!r} was started with {saved}, not {asked}")
        return run
    table = lancedb.connect(db_uri).open_table(args.table)
    blocks = args.blocks_per_epoch or make_table.blocks_per_epoch(
        table.to_lance().uri, args.block_len, args.num_splits, PACK_COLUMN)
    spec = PackSpec(db=db_uri, table=args.table, table_version=table.version,
                    num_splits=args.num_splits, shuffle_seed=args.seed,
                    block_len=args.block_len, eos_id=make_table.EOS_ID,
                    pad_id=make_table.PAD_ID, blocks_per_epoch=blocks,
                    global_batch=args.global_batch, column=PACK_COLUMN)
    run = {"reader": args.reader, "vocab": args.vocab, "pack": spec.to_json()}
    write_json_atomic(run_file, run)
    return run


def packed_coordinator(name: str, run: dict[str, Any], run_dir: str, workers: int) -> Any:
    """The run's coordinator (recovered from its ledger when a later job resumes the run):
    it holds the packing arguments and the merged packed progress of every rank."""
    from lance_ray.driver.handle import Coordinator

    spec = PackSpec(**run["pack"])
    return Coordinator.create(
        lm_data.open_table(spec), name, storage_path=storage.join(run_dir, "coordinator"),
        world_size=workers, num_splits=spec.num_splits, shuffle_seed=spec.shuffle_seed,
        table_version=spec.table_version, columns=[spec.column],
        pack_sequences=spec.block_len, eos_id=spec.eos_id, pad_id=spec.pad_id,
        blocks_per_epoch=spec.blocks_per_epoch)


def check_blocks_per_epoch(args: argparse.Namespace) -> None:
    """Exit naming the options unless --blocks-per-epoch is 0 or a multiple of
    --num-splits (every split delivers as many blocks)."""
    if args.blocks_per_epoch % args.num_splits:
        raise SystemExit(f"--blocks-per-epoch ({args.blocks_per_epoch}) must be 0 (every "
                         f"token) or a multiple of --num-splits ({args.num_splits})")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--db", default="runs/lm/db")
    p.add_argument("--table", default="tokens")
    p.add_argument("--name", default="lm-run", help="run name (RunConfig)")
    p.add_argument("--storage-path", default="runs/lm/storage")
    p.add_argument("--workers", type=positive_int, default=2)
    p.add_argument("--reader", choices=lm_data.READERS, default="lance_ray",
                   help="whose pack_sequences reads the blocks (lance_ray: local reader; "
                        "coordinator: lance_ray views attached to a coordinator actor)")
    p.add_argument("--num-splits", type=positive_int, default=4)
    p.add_argument("--block-len", type=positive_int, default=128, help="pack_sequences (L)")
    p.add_argument("--blocks-per-epoch", type=non_negative_int, default=0,
                   help="0: every token of the table (rounded down to a multiple of splits)")
    p.add_argument("--global-batch", type=positive_int, default=8,
                   help="blocks per global step, a multiple of --num-splits")
    p.add_argument("--vocab", type=positive_int, default=256)
    train_job.add_run_arguments(p, checkpoint_every=4)
    p.add_argument("--demo", action="store_true",
                   help="delete --db and --storage-path, make a table, train on 2 workers "
                        "with a crash, resume on 4, verify "
                        "(with the settings above but its own --workers, --crash-at-step and "
                        "--stop-at-step)")
    p.add_argument("--docs", type=positive_int, default=400,
                   help="--demo: documents in the table")
    p.add_argument("--mean-len", type=float, default=100.0, help="--demo: mean doc length")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run (or resume) the training run; returns its final metrics."""
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if args.demo:
        return demo(args)
    db_uri, storage_uri = storage.absolute(args.db), storage.absolute(args.storage_path)
    run_dir = storage.join(storage_uri, args.name)
    check_run_sizes(args.workers, args.num_splits, args.global_batch)
    check_blocks_per_epoch(args)
    train_job.connect(args.address)
    # Train workers cannot import jobs/ as modules: ship them by value, as `ray job
    # submit` ships a __main__ script.
    for module in (train_job, lm_data, lm_model, sys.modules[__name__]):
        if module.__name__ != "__main__":
            ray.cloudpickle.register_pickle_by_value(module)
    run = run_spec(args, db_uri, run_dir)
    coord = packed_coordinator(args.name, run, run_dir, args.workers) \
        if run["reader"] == "coordinator" else None
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"pack": run["pack"], "reader": run["reader"], "vocab": run["vocab"],
                           "seed": args.seed, "checkpoint_every": args.checkpoint_every,
                           "stop_at_step": args.stop_at_step,
                           "crash_at_step": args.crash_at_step,
                           "log_dir": storage.join(run_dir, "samples"),
                           "coordinator": coord and coord.name},
        scaling_config=ray.train.ScalingConfig(num_workers=args.workers,
            resources_per_worker=train_job.worker_resources(args.workers)),
        run_config=train_job.run_config(args.name, storage_uri, args.max_failures),
    )
    try:
        metrics = dict(trainer.fit().metrics or {})
    finally:
        if coord is not None:
            coord.kill()  # its ledger stays in the run's directory for the next job
    print(f"run {args.name!r} ({run['reader']}) on {args.workers} workers finished at global "
          f"step {metrics.get('global_step')}, loss {metrics.get('loss', float('nan')):.3f}")
    return metrics


def start_local_ray(attempts: int = 3) -> None:
    """A local Ray with train slots and its own temp dir (other local Ray sessions on this
    machine keep theirs). Ray gives a starting raylet 30 s to register (fixed in
    ``ray/_private/node.py``), which a loaded machine can miss: then try again."""
    for attempt in range(1, attempts + 1):
        try:
            ray.init(address="local", num_cpus=2, resources={"slot": 8},
                     include_dashboard=False, _temp_dir=tempfile.mkdtemp(prefix="lm-ray-"))
            return
        except Exception as e:  # Ray raises a bare Exception for this
            if "timed out during startup" not in str(e) or attempt == attempts:
                raise
            logger.warning("local Ray did not start (%s); trying again", e)
            ray.shutdown()


# The options --demo passes on to its two jobs, and those it sets itself (and refuses).
DEMO_FORWARDS = ("--num-splits", "--block-len", "--blocks-per-epoch", "--global-batch",
                 "--vocab", "--checkpoint-every", "--max-failures", "--seed")
DEMO_OWN = ("--workers", "--crash-at-step", "--stop-at-step")


def dest(flag: str) -> str:
    """The argparse attribute of ``--flag-name``."""
    return flag.lstrip("-").replace("-", "_")


def demo(args: argparse.Namespace) -> dict[str, Any]:
    """A fresh table and run: 2 workers crash and stop mid-epoch, 4 finish it, then the
    proof (``jobs/verify.py``'s)."""
    from jobs import verify as verify_job

    p = parser()
    own = [flag for flag in DEMO_OWN if getattr(args, dest(flag)) != p.get_default(dest(flag))]
    if own:
        raise SystemExit(f"--demo runs its own schedule (2 workers crash at step 6 and stop at "
                         f"12, then 4 finish the epoch): drop {', '.join(own)}, or leave out "
                         "--demo to run one job of a run")
    for world_size in (2, 4):
        check_run_sizes(world_size, args.num_splits, args.global_batch,
                        workers_from=f"--demo's world size {world_size} (of 2 and 4)")
    check_blocks_per_epoch(args)
    for stale in (args.db, args.storage_path):
        shutil.rmtree(stale, ignore_errors=True)
    # Ray first: its processes start with fork+exec, unsafe once Lance runs threads here.
    if not (args.address or os.environ.get("RAY_ADDRESS")):
        start_local_ray()
    train_job.connect(args.address)
    table = make_table.create_table(args.db, args.table, rows=args.docs, fragments=2,
                                       batch=make_table.token_rows(args.mean_len, args.vocab))
    print(f"token table {args.table!r}: {table.count_rows()} documents")
    common = ["--db", args.db, "--table", args.table, "--storage-path", args.storage_path,
              "--name", args.name, "--reader", args.reader,
              *[a for flag in DEMO_FORWARDS for a in (flag, str(getattr(args, dest(flag))))]]
    main(common + ["--workers", "2", "--crash-at-step", "6", "--stop-at-step", "12"])
    metrics = main(common + ["--workers", "4"])
    ok = verify_job.print_proof(*verify_job.verify_run(
        storage.join(storage.absolute(args.storage_path), args.name)), unit="block")
    if not ok:
        raise SystemExit(1)
    return metrics


if __name__ == "__main__":
    main()
