"""Object-store outages mid-epoch: the run continues exactly once, or fails after a bounded
time with a clear error and resumes exactly once when the store is back.

    python -m jobs.faults.s3_faults [--outage 10] [--bound 5] [--train]

Everything lives on a local S3-compatible server (moto on 127.0.0.1, started and stopped
here): the table, the coordinator's ledger and, with ``--train``, the Ray Train checkpoints
and sample logs. Two ranks read one epoch in lockstep (the local reader, or the Ray Data
reader), reporting to a coordinator whose ledger is on S3; at a given global step the store
goes away for ``--outage`` seconds:

* ``down``: the endpoint refuses connections and cuts open ones (the clients talk to moto
  through a loopback port that is closed and reopened on the same number; moto itself keeps
  its objects in memory, so a real restart would empty the bucket);
* ``frozen``: the server process is stopped (SIGSTOP) and continued (SIGCONT);
* ``down>bound``: the outage outlasts the retry bound (``--bound`` seconds, for Lance reads
  and coordinator writes): the run must fail with a clear error within a bounded time; it
  is then resumed from the coordinator's sealed step once the store is back;
* ``reads>bound``: the same with the ledger on local disk, so only the table's reads meet
  the outage (Lance's own bounded retries, then the error through our reader).

The table lists every trial: fault, step, outcome, duplicates, lost.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
from lance_ray.testing.local_s3 import Forwarder, LocalS3, s3_env

# Big enough that the readers' prefetch cannot hold the rest of the epoch when the store
# goes away at --at-step: reads meet the outage, not only the ledger writes.
BUCKET, NUM_SPLITS, GLOBAL_BATCH, ROWS = "lance-ray-faults", 8, 32, 24000
logger = logging.getLogger("s3_faults")


@dataclass
class Row:
    fault: str
    reader: str
    step: int
    outcome: str
    duplicates: int | str = "-"
    lost: int | str = "-"
    wall_s: float = 0.0
    stall_s: float = 0.0  # the longest single global step: how long the outage held the run


class Outage:
    """Takes the store away for ``seconds`` (in a background thread) when started."""

    def __init__(self, kind: str, server: LocalS3, forwarder: Forwarder, seconds: float):
        self.kind, self.server, self.forwarder, self.seconds = kind, server, forwarder, seconds
        self._thread: threading.Thread | None = None
        self.began = time.monotonic()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        self.began = time.monotonic()
        (self.server.freeze if self.kind == "frozen" else self.forwarder.down)()
        time.sleep(self.seconds)
        self.end()

    def end(self) -> None:
        if self.kind == "frozen":
            self.server.thaw()
        elif self.forwarder._server is None:
            self.forwarder.up()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()


def table_options(bound_s: float):
    """The storage-options factory of the table: credentials from the environment; Lance's
    own retry bound (object_store ``client_retry_timeout``) set to ``bound_s``."""
    def options() -> dict[str, str]:
        return {"client_retry_timeout": f"{bound_s:.0f}s", "client_max_retries": "20"}
    return options


def short_error(e: BaseException) -> str:
    """The gist of an error for the table: its type and first words."""
    text = " ".join(str(e).split())
    m = re.search(r"could not \w+ \S+ after \d+ attempts over \d+s", text)
    if m:
        return "StorageUnavailable: " + re.sub(r"s3://\S+/", ".../", m.group(0))
    return f"{type(e).__name__}: {text[-110:]}"


def lockstep(views: list, steps: list[list[int]], outage: Outage | None, at_step: int,
             stalls: list[float]) -> None:
    """Step the ranks together, appending each global step's ids (and its duration to
    ``stalls``); start ``outage`` at ``at_step``."""
    while True:
        if outage is not None and len(steps) == at_step:
            outage.start()
        began = time.monotonic()
        parts = [next(v, None) for v in views]
        stalls.append(time.monotonic() - began)
        if all(p is None for p in parts):
            return
        steps.append([i for p in parts if p is not None for i in p["id"].tolist()])


def run_trial(kind: str, reader: str, at_step: int, args, server: LocalS3,
              forwarder: Forwarder, uri: str, full: list[list[int]], n: int) -> Row:
    from lance_ray import storage
    from lance_ray.driver.handle import Coordinator
    from lance_ray.proof.verify import compare_steps, coverage
    from lance_ray.storage import RetryPolicy

    bounded = kind.endswith(">bound")
    outage_s = args.bound * 4 if bounded else args.outage
    outage = Outage("down" if bounded else kind, server, forwarder, outage_s)
    store = (tempfile.mkdtemp(prefix="ledger-") if kind == "reads>bound"
             else f"s3://{BUCKET}/store")
    # The bound (Lance's read retries, ledger write retries) is below the outage only in
    # the down>bound trials; otherwise the defaults (3 min for Lance, 60 s for the ledger).
    retry = RetryPolicy(timeout_s=args.bound) if bounded else None
    options = table_options(args.bound) if bounded else None
    name = f"t{n}-{kind.replace('>', '-')}-{reader}"
    ledger = storage.join(store, name, "coordinator.json")

    def coordinator() -> Coordinator:
        return Coordinator.create(uri, name, storage_path=store,
                                  world_size=2, num_splits=NUM_SPLITS, lease_version=False,
                                  storage_options=options, storage_retry=retry)

    opened: list = []

    def views(c: Coordinator) -> list:
        its = [c.view(r, 2, reader=reader, read_batch_size=128)
               .iter_batches(GLOBAL_BATCH // 2) for r in range(2)]
        opened.extend(its)
        return its

    started = time.monotonic()
    coord = coordinator()
    steps: list[list[int]] = []
    stalls: list[float] = []
    outcome = "continued"
    try:
        lockstep(views(coord), steps, outage, at_step, stalls)
    except Exception as e:
        outcome = (f"failed {time.monotonic() - outage.began:.0f}s into the outage: "
                   f"{short_error(e)}")
        logger.info("trial %s failed as expected? %s", name, e)
        outage.wait()  # the store is back; a new job resumes from the sealed step
        coord.kill()
        coord = coordinator()
        sealed = coord.status()["sealed_step"]
        steps = steps[:sealed]
        lockstep(views(coord), steps, None, -1, stalls)
        outcome += f"; resumed at step {sealed}"
    for it in opened:  # while Ray is up: a failed Ray Data iterator shuts down its executor
        it.close()
    outage.wait()
    outage.end()
    deadline = time.monotonic() + 120
    while coord.status()["sealed_step"] < len(steps) and time.monotonic() < deadline:
        time.sleep(0.1)
    persisted = storage.read_json(ledger)["ledger"]["sealed"]["step"]
    if persisted != len(steps):
        outcome += f"; ledger on S3 at step {persisted}, not {len(steps)}"
    coord.kill()
    report = compare_steps(coverage([i for s in full for i in s], [],
                                    [i for s in steps for i in s]), full, steps)
    ok = (report.exactly_once and report.steps_identical and report.after == report.planned
          and persisted == len(steps))
    return Row(kind, reader, at_step, outcome + ("" if ok else " NOT EXACTLY ONCE"),
               report.duplicates, report.lost, time.monotonic() - started, max(stalls))


def train_trial(args, server: LocalS3, forwarder: Forwarder, real_port: int, n: int) -> Row:
    """A TorchTrainer run (jobs/train.py) on S3 with the endpoint down mid-epoch."""
    import pyarrow.fs as pafs
    import ray.cloudpickle

    from jobs import train as train_job
    from jobs import verify as verify_job

    ray.cloudpickle.register_pickle_by_value(train_job)  # workers cannot import jobs/
    name, at_step = f"t{n}-train", 8
    run_dir = f"s3://{BUCKET}/runs/{name}"
    direct = pafs.S3FileSystem(endpoint_override=f"http://127.0.0.1:{real_port}",
                               region="us-east-1")
    outage = Outage("down", server, forwarder, args.outage)

    def watch() -> None:  # take the store down once rank 0 logged step `at_step`
        while True:
            infos = direct.get_file_info(pafs.FileSelector(f"{BUCKET}/runs/{name}/samples",
                                                           recursive=True, allow_not_found=True))
            if sum(i.base_name.startswith("rank0.") for i in infos) >= at_step:
                outage.start()
                return
            time.sleep(0.2)

    started = time.monotonic()
    threading.Thread(target=watch, daemon=True).start()
    argv = ["--db", f"s3://{BUCKET}/db", "--table", "demo", "--storage-path",
            f"s3://{BUCKET}/runs", "--name", name, "--num-splits", str(NUM_SPLITS),
            "--global-batch", str(GLOBAL_BATCH), "--checkpoint-every", "5", "--workers", "2",
            "--max-failures", "5"]
    try:
        metrics = train_job.main(argv)
        outcome = f"continued to step {metrics.get('global_step')}"
    except Exception as e:
        outcome = f"failed: {short_error(e)}"
    outage.wait()
    report, attempts = verify_job.verify_run(run_dir)
    logger.info("train trial attempts: %s", attempts)
    outcome += f", {len(attempts)} attempt(s)"
    ok = report.exactly_once and report.steps_identical and report.after == report.planned
    return Row("down (TorchTrainer)", "ray", at_step, outcome + ("" if ok else " NOT EXACTLY ONCE"),
               report.duplicates, report.lost, time.monotonic() - started)


def print_table(rows: list[Row]) -> None:
    print(f"\n{'fault':<20} {'reader':<6} {'step':>4}  {'dupes':>5} {'lost':>4} {'stall s':>7} "
          f"{'wall s':>6}  outcome")
    for r in rows:
        print(f"{r.fault:<20} {r.reader:<6} {r.step:>4}  {r.duplicates!s:>5} {r.lost!s:>4} "
              f"{r.stall_s:>7.1f} {r.wall_s:>6.0f}  {r.outcome}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--outage", type=float, default=10.0, help="seconds the store is away")
    p.add_argument("--bound", type=float, default=5.0,
                   help="retry bound (s) for reads and ledger writes in the down>bound trials")
    p.add_argument("--at-step", type=int, default=30)
    p.add_argument("--readers", default="local,ray")
    p.add_argument("--faults", default="down,frozen,down>bound,reads>bound")
    p.add_argument("--train", action="store_true", help="also a TorchTrainer trial")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")

    server = LocalS3.start(log=Path(tempfile.gettempdir()) / f"moto-{os.getpid()}.log")
    forwarder = Forwarder(server.port)
    os.environ.update(s3_env(forwarder.port))  # every client (and Ray worker) uses the door
    rows: list[Row] = []
    bad: list[Row] = []
    try:
        server.create_bucket(BUCKET)
        import ray

        import lance_ray
        from lance_ray.testing.tables import create_table

        ray.init(num_cpus=2, resources={"slot": 4}, include_dashboard=False,
                 _temp_dir=tempfile.mkdtemp(prefix="lance_ray_faults_"))
        create_table(f"s3://{BUCKET}/db", "demo", rows=ROWS, dim=16, fragments=4)
        uri = f"s3://{BUCKET}/db/demo.lance"
        ds = lance_ray.StreamingDataset(uri, num_splits=NUM_SPLITS, reader="local")
        full = [b["id"].tolist() for b in ds.iter_batches(GLOBAL_BATCH)]
        for kind in [k for k in args.faults.split(",") if k]:
            for reader in args.readers.split(","):
                rows.append(run_trial(kind, reader, args.at_step, args, server, forwarder, uri,
                                      full, len(rows)))
                print_table(rows[-1:])
        if args.train:
            rows.append(train_trial(args, server, forwarder, server.port, len(rows)))
        print_table(rows)
        bad = [r for r in rows if "NOT EXACTLY ONCE" in r.outcome]
        print("PROOF:", "every trial exactly once" if not bad else f"{len(bad)} trial(s) FAILED",
              flush=True)
        ray.shutdown()
    finally:
        forwarder.down()
        server.stop()
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
