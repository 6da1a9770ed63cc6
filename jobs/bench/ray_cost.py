"""Where the Ray reader's time goes on one node: CPU per row by process, against the local reader.

    python -m jobs.bench.ray_cost [--rows 12000] [--cpus 2] [--passes 2]

Reads a table of 64 KB rows (full shuffle, batches of 256) with the local reader and the
Ray reader, and prints for each pass its rows/s and the CPU seconds per row of every
process that worked (from ``/proc``: the trainer, Ray's workers, Ray's own actors). Then it
times Lance's sorted take of the same 256-row reads in this process and in a Ray worker,
one stream each, so a difference in the read itself would show apart from contention.

On a machine whose cores the reads fill, what the Ray reader adds per row (the copy into
the object store, the task's fixed cost, the trainer's read out of it) is CPU the local
reader never spends. Linux only (``/proc``).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import numpy as np
import pyarrow as pa

TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_by_process() -> dict[int, tuple[str, float]]:
    """The name and CPU seconds so far (user + system) of this process and its descendants
    (the local Ray cluster it started), not of other work on the machine."""
    seen: dict[int, tuple[int, str, float]] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline") as f:
                name = f.read().replace("\0", " ")[:60].strip()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        seen[int(pid)] = (int(fields[1]), name, (int(fields[11]) + int(fields[12])) / TICK)
    mine = {os.getpid()}
    grew = True
    while grew:
        found = {pid for pid, (parent, _, _) in seen.items() if parent in mine}
        grew = not found <= mine
        mine |= found
    return {pid: (name, cpu) for pid, (_, name, cpu) in seen.items() if pid in mine}


def one_pass(table: Any, reader: str) -> None:
    import lance_ray

    before, started = cpu_by_process(), time.perf_counter()
    rows = sum(len(b["id"]) for b in lance_ray.StreamingDataset(table, reader=reader)
               .iter_batches(256))
    wall = time.perf_counter() - started
    spent: dict[str, float] = {}
    for pid, (name, cpu) in cpu_by_process().items():
        used = cpu - before.get(pid, (name, 0.0))[1]
        if used > 0.01:
            key = "trainer" if pid == os.getpid() else (
                "ray workers" if name.startswith("ray::") and "Actor" not in name else name)
            spent[key] = spent.get(key, 0.0) + used
    total = sum(spent.values())
    print(f"{reader:5s} {rows / wall:9,.0f} rows/s  {total / wall:.2f} cores  "
          f"{total * 1e6 / rows:6.1f} us CPU/row in all:")
    for key, used in sorted(spent.items(), key=lambda kv: -kv[1])[:5]:
        print(f"        {used * 1e6 / rows:6.1f} us/row  {key}")


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
    ray.shutdown()


if __name__ == "__main__":
    main()
