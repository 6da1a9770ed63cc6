"""Waiting-transform scaling: fraction of the ideal rows/s by declared CPUs and by CPU-only nodes.

    python -m jobs.bench.scaling [--small] [--out docs/bench]

Needs no cores: Ray is started with N *declared* CPUs and the transform waits ``W`` seconds
per row (``time.sleep``, which holds no CPU and releases the GIL) and returns a 3x64x64
``uint8`` array per row. The wait stands in for work other cores or nodes would do; the
ideal is N / W rows/s. For each N, in one fresh Ray (a child process each), side by side:

* lance_ray's Ray reader (``reader="ray"``, full shuffle, ``iter_batches(256)``);
* plain Ray Data doing the same work in order (``read_lance`` + ``map_batches(250)``,
  ``preserve_order``, ``iter_batches(256)``);
* the reference, ``lancedb.streaming.StreamingDataset`` with N transform threads.

Each Ray reader first makes a faster warm-up pass of the same table (a process's first Ray
Data pipeline starts seconds slower than the next, and its first tasks start workers). Each
also reports the trainer process's own CPU per row (``getrusage(RUSAGE_SELF)`` around the
pass: the copy out of the object store, conversion and batching; Ray's workers are other
processes). The multi-node variant starts a ``ray.cluster_utils.Cluster``: a head of 1 CPU
(the trainer) plus 1, 2, 4 CPU-only nodes of 4 CPUs carrying a custom resource, and
``ray_remote_args`` place the reads and transforms there.
Results: ``<out>/scaling.json``
and ``<out>/scaling_nodes.json`` (the shared bench format).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

ENV = {"RAY_AUTH_MODE": "disabled", "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
       "RAY_USAGE_STATS_ENABLED": "0"}
BATCH = 256
PASS_SECONDS = 3.0  # rows per case: about this long at the ideal rate
# (declared CPUs, seconds of wait per row)
CPU_CASES = ((4, 0.008), (8, 0.004), (16, 0.002), (64, 0.008))
SMALL_CPU_CASES = ((8, 0.004), (16, 0.002))
NODE_CPUS, NODE_WAIT, NODE_CASES = 4, 0.008, (1, 2, 4)
NODE_RESOURCE = "cpu_only"
MACHINE = "2-core dev VM"


class Wait:
    """The probe's transform: waits ``seconds`` per row, one 3x64x64 uint8 array per row."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self, batch: pa.RecordBatch) -> list[np.ndarray]:
        time.sleep(batch.num_rows * self.seconds)
        ids = batch.column("id").to_numpy()
        return [np.full((3, 64, 64), i % 251, dtype=np.uint8) for i in ids]


class WaitColumns:
    """The same work for plain Ray Data's ``map_batches`` (numpy batches in and out)."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        ids = batch["id"]
        time.sleep(len(ids) * self.seconds)
        out = np.empty((len(ids), 3, 64, 64), dtype=np.uint8)
        out[:] = (ids % 251).astype(np.uint8)[:, None, None, None]
        return {"image": out}


def make_table(db: str, rows: int) -> Any:
    import lancedb

    ids = np.arange(rows, dtype=np.int64)
    pad = pa.array([bytes(64)] * rows, pa.binary())
    return lancedb.connect(db).create_table(f"t{rows}", pa.table({"id": ids, "pad": pad}),
                                            mode="overwrite")


def _cpu() -> tuple[float, float]:
    """This process's CPU seconds so far: all of it, and the kernel's share."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime, usage.ru_stime


def timed(rows: int, batches: Any) -> dict[str, float]:
    """Rows/s over a whole pass (first ``next`` to the last batch) and the trainer process's
    CPU microseconds per row, all of it and the kernel's (file reads from the page cache,
    fresh buffers' pages faulted in and zeroed)."""
    (cpu, sys_cpu), started, got = _cpu(), time.perf_counter(), 0
    for batch in batches:
        got += len(batch["image"]) if isinstance(batch, dict) else len(batch)
    seconds = time.perf_counter() - started
    if got != rows:
        raise RuntimeError(f"a pass gave {got} rows, not {rows}")
    cpu_end, sys_end = _cpu()
    return {"rows_s": rows / seconds, "cpu_us_row": (cpu_end - cpu) / rows * 1e6,
            "sys_us_row": (sys_end - sys_cpu) / rows * 1e6}


def warm_workers(n: int, resources: Mapping[str, float] | None = None) -> None:
    """Start ``n`` Ray worker processes before timing (a worker's start is not the probe's
    subject), each importing what a read task imports."""
    import ray

    @ray.remote(num_cpus=1, resources=dict(resources or {}))
    def hold() -> None:
        import lance  # noqa: F401

        import lance_ray.read.ray_data  # noqa: F401
        time.sleep(1.0)

    ray.get([hold.remote() for _ in range(n)])


def ray_reader(table: Any, rows: int, wait: float, **kw: Any) -> dict[str, float]:
    from lance_ray import StreamingDataset

    ds = StreamingDataset(table, reader="ray", transform=Wait(wait), **kw)
    return timed(rows, ds.iter_batches(BATCH))


def plain_ray_data(table: Any, rows: int, wait: float) -> dict[str, float]:
    import ray.data

    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True
    ds = ray.data.read_lance(table.to_lance().uri).map_batches(
        WaitColumns(wait), batch_size=250, batch_format="numpy")
    return timed(rows, ds.iter_batches(batch_size=BATCH, batch_format="numpy"))


def reference(table: Any, rows: int, transform: Any, threads: int | None
              ) -> dict[str, float]:
    """``lancedb.streaming`` with ``transform`` on ``threads`` threads (None: its default),
    items gathered into batches of ``BATCH`` (arrays stacked)."""
    from lancedb.streaming import StreamingDataset

    ds = StreamingDataset(table, transform=transform, transform_parallelism=threads)

    def batches() -> Any:
        batch: list[Any] = []
        for item in ds:
            batch.append(item)
            if len(batch) == BATCH:
                yield np.stack(batch) if isinstance(item, np.ndarray) else batch
                batch = []
        if batch:
            yield np.stack(batch) if isinstance(batch[0], np.ndarray) else batch

    return timed(rows, batches())


def cpus_child(cpus: int, wait: float) -> dict[str, Any]:
    """One declared-CPU case in a fresh Ray: the three readers side by side."""
    import ray

    ideal = cpus / wait
    rows = int(ideal * PASS_SECONDS)
    with tempfile.TemporaryDirectory() as db:
        table = make_table(db, rows)
        ray.init(address="local", num_cpus=cpus, include_dashboard=False,
                 log_to_driver=False)
        try:
            warm_workers(cpus)
            # A first Ray Data pipeline in a process starts seconds slower than the next
            # ones (imports, the executor's first start), and the first pass of a shape
            # starts Ray worker processes (two at a time on two cores): warm each reader
            # up with a faster pass of the same table.
            ray_reader(table, rows, wait / 8)
            plain_ray_data(table, rows, wait / 8)
            out: dict[str, Any] = {"cpus": cpus, "wait_ms": wait * 1e3, "rows": rows,
                                   "ideal": ideal}
            out["ray_reader"] = ray_reader(table, rows, wait)
            out["plain_ray_data"] = plain_ray_data(table, rows, wait)
        finally:
            ray.shutdown()
        out["reference"] = reference(table, rows, Wait(wait), cpus)
    return out


def nodes_child(nodes: int) -> dict[str, Any]:
    """The multi-node case: a 1-CPU head (the trainer) and ``nodes`` CPU-only nodes."""
    import ray
    from ray.cluster_utils import Cluster

    ideal = nodes * NODE_CPUS / NODE_WAIT
    rows = int(ideal * PASS_SECONDS)
    cluster = Cluster(initialize_head=True, connect=True,
                      head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        for _ in range(nodes):
            cluster.add_node(num_cpus=NODE_CPUS, resources={NODE_RESOURCE: NODE_CPUS})
        cluster.wait_for_nodes()
        where = {NODE_RESOURCE: 1}
        warm_workers(nodes * NODE_CPUS, where)
        with tempfile.TemporaryDirectory() as db:
            table = make_table(db, rows)
            ray_reader(table, rows, NODE_WAIT / 8, ray_remote_args={"resources": where})
            got = ray_reader(table, rows, NODE_WAIT, ray_remote_args={"resources": where})
    finally:
        ray.shutdown()
        cluster.shutdown()
    return {"nodes": nodes, "cpus": nodes * NODE_CPUS, "rows": rows, "ideal": ideal, **got}


def _child(args: list[str]) -> dict[str, Any]:
    """Run one case in a fresh Python (a fresh Ray), its result as the last output line."""
    env = os.environ | ENV
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, "-m", "jobs.bench.scaling", "--child", *args],
                          env=env, capture_output=True, text=True, timeout=600)
    if done.returncode:
        raise RuntimeError(f"case {args} failed:\n{done.stderr[-3000:]}")
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def _write(out: Path, name: str, title: str, columns: list[str], rows: list[list[Any]],
           notes: list[str], command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    doc = {"name": name, "title": title, "machine": MACHINE, "command": command,
           "date": datetime.date.today().isoformat(), "columns": columns, "rows": rows,
           "notes": notes}
    (out / f"{name}.json").write_text(json.dumps(doc, indent=1) + "\n")


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="8 and 16 CPUs, 1 and 2 nodes")
    parser.add_argument("--out", default="docs/bench")
    parser.add_argument("--only", choices=("cpus", "nodes"), default=None)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    os.environ.update(ENV)
    if args.child:
        kind, *rest = args.child
        result = cpus_child(int(rest[0]), float(rest[1])) if kind == "cpus" \
            else nodes_child(int(rest[0]))
        print(json.dumps(result), flush=True)
        return
    out = Path(args.out)
    command = "python -m jobs.bench.scaling" + (" --small" if args.small else "")
    if args.only in (None, "cpus"):
        rows: list[list[Any]] = []
        for cpus, wait in SMALL_CPU_CASES if args.small else CPU_CASES:
            r = _child(["cpus", str(cpus), str(wait)])
            line = [f"{cpus} CPUs, {wait * 1e3:g} ms/row", round(r["ideal"])]
            for reader in ("ray_reader", "plain_ray_data", "reference"):
                line += [round(r[reader]["rows_s"] / r["ideal"], 2),
                         round(r[reader]["cpu_us_row"], 1)]
            print(line, flush=True)
            rows.append(line)
            _write(out, "scaling", "Waiting transform: fraction of ideal by declared CPUs",
                   ["case", "ideal rows/s", "lance_ray Ray reader", "its trainer CPU us/row",
                    "plain Ray Data, ordered", "its trainer CPU us/row",
                    "reference threads (N)", "its trainer CPU us/row"], rows,
                   ["The transform waits W per row (no CPU): the ideal is N/W rows/s; each "
                    "figure is rows/s over a whole pass divided by it, the three readers in "
                    "one fresh Ray per row of the table.",
                    "Trainer CPU is the consuming process's own (getrusage) per row; Ray's "
                    "workers are other processes.",
                    "On 2 real cores Ray Data's fixed cost per task (~30-40 ms of CPU) is "
                    "paid on the same cores as the trainer.",
                    "The Ray reader also transforms its first rows in the trainer while the "
                    "pipeline starts (a thread beyond N), so a short pass can pass N/W."],
                   command)
    if args.only in (None, "nodes"):
        rows = []
        base = None
        for nodes in NODE_CASES[:2] if args.small else NODE_CASES:
            r = _child(["nodes", str(nodes)])
            base = base or r["rows_s"]
            line = [f"{nodes} CPU-only node(s) x {NODE_CPUS} CPUs", round(r["ideal"]),
                    round(r["rows_s"]), round(r["rows_s"] / r["ideal"], 2),
                    round(r["rows_s"] / base, 2), round(r["cpu_us_row"], 1)]
            print(line, flush=True)
            rows.append(line)
            _write(out, "scaling_nodes", "Waiting transform on CPU-only nodes "
                   "(ray_remote_args place the reads and transforms)",
                   ["case", "ideal rows/s", "rows/s", "fraction of ideal", "x one node",
                    "trainer CPU us/row"], rows,
                   [f"A ray.cluster_utils.Cluster: a 1-CPU head (the trainer) plus CPU-only "
                    f"nodes of {NODE_CPUS} declared CPUs carrying a custom resource; the "
                    f"transform waits {NODE_WAIT * 1e3:g} ms per row.",
                    "All nodes share this machine's cores: the figures show that added "
                    "nodes are used, not more hardware."], command)


if __name__ == "__main__":
    main(sys.argv[1:])
