"""Where the Ray reader's time goes on one node: CPU per row by process, against the local reader.

    python -m jobs.bench.ray_cost [--rows 12000] [--cpus 2] [--passes 2]

First it times a worker's writes into the fresh object store until they stop faulting in
pages (``store_puts``), which also leaves the store's pages allocated for the passes. Then
it reads a table of 64 KB rows (full shuffle, batches of 256) with the local reader and the
Ray reader, and prints for each pass its rows/s, and the CPU seconds and page faults per row
of every process that worked (from ``/proc``: the trainer, Ray's workers, Ray's own
actors). Then it times Lance's sorted take of the same 256-row reads in this process and in
a Ray worker, one stream each, so a difference in the read itself would show apart from
contention. Last it runs the Ray reader's read task in plain Ray tasks, without Ray Data,
reading only and reading and returning the block (``plain_tasks``): the worker's CPU per
row, split into the read, the copy into the object store and Ray Data's share.

On a machine whose cores the reads fill, what the Ray reader adds per row (the copy into
the object store, Ray Data's handling of each block, the trainer's read out of it) is CPU
the local reader never spends. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


class Usage(NamedTuple):
    """What one process has used so far."""

    name: str
    cpu: float  # seconds, user + system
    faults: int  # minor page faults: pages mapped in on first touch (and zeroed when new)


def cpu_by_process() -> dict[int, Usage]:
    """The name, CPU seconds and page faults so far of this process and its descendants
    (the local Ray cluster it started), not of other work on the machine."""
    seen: dict[int, tuple[int, Usage]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline") as f:
                name = f.read().replace("\0", " ")[:60].strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        seen[int(pid)] = (int(fields[1]), Usage(
            name, (int(fields[11]) + int(fields[12])) / TICK, int(fields[7])))
    mine = {os.getpid()}
    grew = True
    while grew:
        found = {pid for pid, (parent, _) in seen.items() if parent in mine}
        grew = not found <= mine
        mine |= found
    return {pid: usage for pid, (_, usage) in seen.items() if pid in mine}


def spent_since(before: dict[int, Usage]) -> dict[str, list[float]]:
    """CPU seconds and page faults since ``before`` (a ``cpu_by_process()``), summed by
    role: the trainer (this process), Ray's task workers, and each other process."""
    spent: dict[str, list[float]] = {}
    for pid, now in cpu_by_process().items():
        then = before.get(pid, Usage(now.name, 0.0, 0))
        if now.cpu - then.cpu > 0.01:
            key = "trainer" if pid == os.getpid() else (
                "ray workers" if now.name.startswith("ray::") and "Actor" not in now.name
                else now.name)
            sums = spent.setdefault(key, [0.0, 0.0])
            sums[0] += now.cpu - then.cpu
            sums[1] += now.faults - then.faults
    return spent


def one_pass(table: Any, reader: str) -> None:
    import lance_ray

    before, started = cpu_by_process(), time.perf_counter()
    rows = sum(len(b["id"]) for b in lance_ray.StreamingDataset(table, reader=reader)
               .iter_batches(256))
    wall = time.perf_counter() - started
    spent = spent_since(before)
    total = sum(cpu for cpu, _ in spent.values())
    print(f"{reader:5s} {rows / wall:9,.0f} rows/s  {total / wall:.2f} cores  "
          f"{total * 1e6 / rows:6.1f} us CPU/row in all:")
    for key, (cpu, faults) in sorted(spent.items(), key=lambda kv: -kv[1][0])[:5]:
        print(f"        {cpu * 1e6 / rows:6.1f} us/row  {faults / rows:5.1f} page faults/row  "
              f"{key}")


def plain_tasks(ref: Any, ids: np.ndarray, in_flight: int, rows: int = 1024) -> None:
    """The Ray reader's read task body (``read_block``, rows as Lance read them) in plain
    Ray tasks of ``rows`` rows, ``in_flight`` at a time, without Ray Data: the workers' CPU
    per row when a task only reads (returns its row count) and when it also returns its
    block (the copy into the object store). Against the passes above, this splits a worker's
    cost into Lance's read, the store's copy, and Ray Data's own handling."""
    import ray

    from lance_ray.read.ray_tasks import read_block
    from lance_ray.read.requests import ChunkRequest
    from lance_ray.read.widths import row_bytes

    width = row_bytes(ref, None)  # the reader's own estimate: the same pieces per read

    @ray.remote
    def task(chunk: ChunkRequest, put: bool) -> Any:
        # Rows in Lance's order, as the reader ships blocks that fit Ray Data's block size.
        block = next(read_block(ref, None, None, chunk, 1 << 62, width))
        return block if put else block.num_rows

    chunks = [ChunkRequest(((lo, lo + len(part)),), part)
              for lo in range(0, len(ids), rows) for part in [ids[lo:lo + rows]]]
    for put in (False, True):
        before, pending = cpu_by_process(), []
        for chunk in chunks:
            pending.append(task.remote(chunk, put))
            if len(pending) >= in_flight:
                ray.get(pending.pop(0))
        ray.get(pending)
        cpu = spent_since(before).get("ray workers", [0.0])[0]
        print(f"plain Ray tasks of {rows} rows, {in_flight} at a time, "
              f"{'read + copy into the store' if put else 'read only':26s}: "
              f"{cpu * 1e6 / len(ids):6.1f} us/row in the workers")


def take_us_per_row(ref: Any, ids: np.ndarray) -> float:
    """Median wall time per row of sorted takes of 256 rows (one stream), in a process set
    up as every reading process is (``keep_freed_buffers``)."""
    from lance_ray.read.malloc import keep_freed_buffers
    from lance_ray.read.take import take_sorted

    keep_freed_buffers()

    times = []
    for lo in range(0, len(ids), 256):
        started = time.perf_counter()
        take_sorted(ref, ids[lo:lo + 256], None)
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e6 / 256


def store_puts(rows: int = 256, calls: int = 100, segments: int = 12) -> None:
    """The object store's cost per 64 KB row as a worker writes into it: an actor returns
    the same block of ``rows`` rows ``calls`` times per segment, until a segment faults in
    almost no pages (the store's pages are then mapped in that worker) or after
    ``segments``. Prints the first and the last segment: a fresh cluster's first gigabytes
    cost each worker its store pages' faults (and the kernel their zeroing)."""
    import ray

    @ray.remote
    class Source:
        def __init__(self) -> None:
            rng = np.random.default_rng(0)
            self.block = pa.table({"blob": pa.array([rng.bytes(64 << 10)
                                                     for _ in range(rows)])})

        def pid(self) -> int:
            return os.getpid()

        def block_(self) -> pa.Table:
            return self.block

    source = Source.remote()  # type: ignore[attr-defined]
    pid = ray.get(source.pid.remote())
    n, written = calls * rows, 0
    for segment in range(segments):
        before = cpu_by_process()[pid]
        for _ in range(calls):
            ray.get(source.block_.remote())
        after = cpu_by_process()[pid]
        written += n * (64 << 10)
        faults = (after.faults - before.faults) / n
        line = (f"object store put, {written >> 20:6,} MiB written: "
                f"{(after.cpu - before.cpu) * 1e6 / n:5.1f} us/row in the worker, "
                f"{faults:4.1f} page faults/row")
        if segment == 0:
            print(line + " (fresh store)")
        if faults < 0.5:
            print(line + " (warm)")
            break
    else:
        print(line + f" (still faulting after {segments} segments)")
    ray.kill(source)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=12_000)
    p.add_argument("--cpus", type=int, default=2)
    p.add_argument("--passes", type=int, default=2)
    args = p.parse_args(argv)
    os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
    import lancedb
    import ray

    import lance_ray

    rng = np.random.default_rng(3)
    table = lancedb.connect(tempfile.mkdtemp(prefix="bench-ray-cost-")).create_table(
        "blobs", pa.table({"id": np.arange(args.rows, dtype=np.int64),
                           "blob": pa.array([rng.bytes(64 << 10) for _ in range(args.rows)])}))
    ray.init(address="local", num_cpus=args.cpus, include_dashboard=False,
             log_to_driver=False)
    store_puts()
    one_pass(table, "ray")  # warm-up: workers start, the table opens in each
    for _ in range(args.passes):
        one_pass(table, "ray")
        one_pass(table, "local")
    ref = lance_ray.StreamingDataset(table, reader="local")._table
    ids = rng.permutation(args.rows).astype(np.uint64)
    here = take_us_per_row(ref, ids)
    there = ray.get(ray.remote(take_us_per_row).remote(ref, ids))
    print(f"Lance sorted take, one stream: {here:.1f} us/row here, {there:.1f} us/row in a "
          "Ray worker")
    plain_tasks(ref, ids, args.cpus)
    ray.shutdown()


if __name__ == "__main__":
    main()
