"""The main demo: train on a local multi-node Ray cluster, crash, resize, resume, prove.

    python -m jobs.demo [--rows 6000] [--workdir runs/demo]

1. start a local cluster (head + 1 worker node with 2 train slots): ``cluster/local.sh``;
2. ``ray job submit`` a job that creates the demo table;
3. ``ray job submit`` the TorchTrainer job on 2 workers, with a worker crash injected
   mid-epoch (Ray Train restarts the group from the latest checkpoint), stopping at a
   checkpoint before the epoch ends;
4. resize the cluster to 2 worker nodes (4 slots);
5. ``ray job submit`` the same run on 4 workers: it resumes from the checkpoint and finishes
   the epoch;
6. verify from the per-step sample logs that every sample was trained on exactly once and
   that every global step holds the same samples as an uninterrupted run; stop the cluster.

With ``--s3`` the same proof runs with no shared disk: the table, Ray Train's checkpoints,
the coordinator's ledger and the sample logs all live on a local S3-compatible server (moto
on 127.0.0.1, started and stopped here); every node gets its endpoint and dummy credentials
from the environment.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from lance_ray import storage

REPO = Path(__file__).resolve().parents[1]

S3_BUCKET = "lance-ray-demo"


def run(cmd: list[str], env: dict[str, str], *, title: str) -> None:
    print(f"\n=== {title}\n$ {' '.join(cmd)}", flush=True)
    started = time.monotonic()
    try:
        subprocess.run(cmd, check=True, env=env, cwd=REPO)
    except subprocess.CalledProcessError as e:
        # One line, printed after the cleanup in main()'s `finally` (SystemExit's message
        # is printed as the interpreter exits); the step's own output says why.
        sys.exit(f"demo: step '{title}' failed (exit status {e.returncode})")
    print(f"=== done in {time.monotonic() - started:.0f}s", flush=True)


def inspect_latest_checkpoint(work: Path, run_storage: str, env: dict[str, str]) -> None:
    """Merge the ranks' data states of the latest checkpoint and inspect them (CLI)."""
    latest = max(d for d in storage.list_dirs(storage.join(run_storage, "demo-run"))
                 if storage.basename(d).startswith("checkpoint_"))
    states = [f for f in storage.list_files(latest)
              if storage.basename(f).startswith("lance_ray_state_rank")]
    merged, png = work / "checkpoint_state.json", work / "checkpoint_state.png"
    cli = [sys.executable, "-m", "lance_ray"]
    run(cli + ["merge", *states, "-o", str(merged)], env,
        title=f"merge the rank states of {storage.basename(latest)}")
    run(cli + ["inspect", str(merged), "--png", str(png)], env,
        title="inspect the checkpoint the resized run will resume from")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", default="runs/demo")
    p.add_argument("--rows", type=int, default=6000)
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--crash-at-step", type=int, default=15)
    p.add_argument("--stop-at-step", type=int, default=40)
    p.add_argument("--s3", action="store_true",
                   help="table and run storage on a local S3-compatible server (moto)")
    args = p.parse_args()

    work = (REPO / args.workdir).resolve()
    for stale in ("db", "storage"):
        shutil.rmtree(work / stale, ignore_errors=True)
    bin_dir = Path(sys.executable).parent
    s3_server = None
    db, run_storage = str(work / "db"), str(work / "storage")
    if args.s3:
        from lance_ray.testing.local_s3 import LocalS3

        work.mkdir(parents=True, exist_ok=True)
        s3_server = LocalS3.start(log=work / "moto.log")
        s3_server.create_bucket(S3_BUCKET)
        os.environ.update(s3_server.env())  # the cluster's nodes inherit it
        db, run_storage = f"s3://{S3_BUCKET}/db", f"s3://{S3_BUCKET}/storage"
        print(f"local S3 server at {s3_server.endpoint}: table and run storage on "
              f"s3://{S3_BUCKET}", flush=True)
    env = {**os.environ, "RAY": str(bin_dir / "ray"),
           "LANCE_RAY_CLUSTER_DIR": str(work / "cluster"),
           "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
           "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
           "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    cluster = [str(REPO / "cluster" / "local.sh")]
    address = subprocess.run(cluster + ["address"], env=env, capture_output=True, text=True,
                             check=True).stdout.strip()
    submit = [str(bin_dir / "ray"), "job", "submit", "--address", address, "--working-dir", ".",
              "--", "python"]
    train = ["-m", "jobs.train", "--db", db, "--storage-path", run_storage,
             "--global-batch", str(args.global_batch), "--checkpoint-every", "10"]
    subprocess.run(cluster + ["stop"], env=env, check=False, cwd=REPO, capture_output=True)
    try:
        run(cluster + ["start", "1"], env, title="start a local cluster: head + 1 worker node")
        run(submit + ["-m", "jobs.make_table", "--db", db, "--rows", str(args.rows)],
            env, title="create the demo table")
        run(submit + train + ["--workers", "2", "--crash-at-step", str(args.crash_at_step),
                              "--stop-at-step", str(args.stop_at_step)],
            env, title=f"train on 2 workers, crash at step {args.crash_at_step}, "
                       f"stop at step {args.stop_at_step}")
        inspect_latest_checkpoint(work, run_storage, env)
        run(cluster + ["resize", "2"], env, title="resize the cluster to 2 worker nodes")
        run(submit + train + ["--workers", "4"], env,
            title="resume the same run on 4 workers and finish the epoch")
        out = ["-o", str(work / "run_summary.png")] if args.s3 else []  # the PNG stays local
        run([sys.executable, "-m", "jobs.plot_run", "--storage-path", run_storage, *out], env,
            title="plot throughput and data wait over the run")
        run([sys.executable, "-m", "jobs.verify", "--storage-path", run_storage], env,
            title="verify exactly-once from the sample logs")
    finally:
        subprocess.run(cluster + ["stop"], env=env, check=False, cwd=REPO)
        if s3_server is not None:
            s3_server.stop()


if __name__ == "__main__":
    main()
