"""``python -m jobs.bench.device``: a full shuffle of 4 KB vectors into device memory.

Rows of 1024 float32, read in a full shuffle in batches of 4096 and copied to the GPU, by:
the pinned host-to-device copy alone; Lance's random take (4096 sorted ids a call) as one
stream into the GPU; Lance's random takes as K concurrent streams, reads only (the full-shuffle
limit of the disk); lance_ray's local and Ray readers with ``device="cuda"``; the reference
(``lancedb.streaming``) with ``DataLoader(pin_memory=True)``, bounded in time. Without CUDA
the same reads run without the copy. Results go to ``DIR/NAME.json`` (``--name``, default
``device``) as each case ends.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

DIM = 1024
ROW_BYTES = 4 * DIM
BATCH = 4096
SPLITS = 16
SEED = 0
STREAMS = (1, 4, 8, 16)
# A stand-in training step for the cases with a consumer that works: shorter than a batch's
# share of the disk's full-shuffle limit, so the reads stay the bound and the question is only
# whether each batch's copy was done when the step before it ended.
STEP_MS = 15.0
COLUMNS = ["case", "rows/s", "GB/s", "x best concurrent take", "x reference",
           "waited on copy (of batches)", "starved by reads (of batches)", "first batch s"]


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


# ----------------------------------------------------------------------------- the table
def make_table(db: Path, rows: int) -> tuple[str, Any]:
    """``rows`` random 4 KB vectors (``id``, ``v``), written once with Lance (reused when the
    same size is there); the dataset's URI and the LanceDB table."""
    import lance
    import lancedb

    uri = db / "vectors.lance"
    marker = db / "vectors.rows"
    if not (marker.exists() and marker.read_text() == str(rows)):
        shutil.rmtree(uri, ignore_errors=True)
        schema = pa.schema([("id", pa.int64()), ("v", pa.list_(pa.float32(), DIM))])
        step = 32_768
        rng = np.random.default_rng(SEED)

        def batches() -> Iterator[pa.RecordBatch]:
            for lo in range(0, rows, step):
                n = min(step, rows - lo)
                values = pa.array(rng.random(n * DIM, dtype=np.float32))
                yield pa.record_batch([pa.array(np.arange(lo, lo + n)),
                                       pa.FixedSizeListArray.from_arrays(values, DIM)],
                                      schema=schema)

        started = time.perf_counter()
        lance.write_dataset(pa.RecordBatchReader.from_batches(schema, batches()), str(uri),
                            max_rows_per_file=max(step, rows // 8), mode="overwrite")
        marker.write_text(str(rows))
        print(f"wrote {rows:,} rows x {DIM} float32 ({rows * ROW_BYTES / 2**30:.1f} GiB) in "
              f"{time.perf_counter() - started:.1f}s", flush=True)
    return str(uri), lancedb.connect(str(db)).open_table("vectors")


# ----------------------------------------------------------------------------- the copy
class ToDevice:
    """Copies host batches of ``v`` to the GPU from two pinned buffers, non_blocking on a
    side stream (a buffer is refilled once its copy's event completed)."""

    def __init__(self, device: torch.device | None):
        self.device = device
        if device is None:
            return
        self.stream = torch.cuda.Stream(device)
        self.host = [torch.empty((BATCH, DIM), dtype=torch.float32, pin_memory=True)
                     for _ in range(2)]
        self.events: list[Any] = [None, None]
        self.turn = 0

    def __call__(self, rows: np.ndarray) -> None:
        if self.device is None:
            return
        i, n = self.turn, len(rows)
        self.turn = 1 - i
        if self.events[i] is not None:
            self.events[i].synchronize()
        self.host[i][:n].copy_(torch.from_numpy(rows))
        with torch.cuda.stream(self.stream):
            torch.empty((n, DIM), dtype=torch.float32, device=self.device).copy_(
                self.host[i][:n], non_blocking=True)
            self.events[i] = torch.cuda.Event()
            self.events[i].record(self.stream)

    def finish(self) -> None:
        if self.device is not None:
            self.stream.synchronize()


def copy_alone(device: torch.device, seconds: float) -> float:
    """Rows/s of the pinned host-to-device copy alone (one batch, copied over and over)."""
    host = torch.empty((BATCH, DIM), dtype=torch.float32, pin_memory=True)
    out = torch.empty((BATCH, DIM), dtype=torch.float32, device=device)
    stream = torch.cuda.Stream(device)
    copies = 0
    started = time.perf_counter()
    with torch.cuda.stream(stream):
        while time.perf_counter() - started < seconds:
            for _ in range(50):
                out.copy_(host, non_blocking=True)
            copies += 50
            stream.synchronize()
    return copies * BATCH / (time.perf_counter() - started)


# ----------------------------------------------------------------------------- Lance
def id_chunks(rows: int) -> Iterator[np.ndarray]:
    """A full shuffle of the row offsets, 4096 a call, each call's ids sorted."""
    order = np.random.default_rng(SEED + 1).permutation(rows)
    for lo in range(0, rows, BATCH):
        yield np.sort(order[lo:lo + BATCH])


def vectors(table: pa.Table) -> np.ndarray:
    column = table.column("v").combine_chunks()
    return column.values.to_numpy(zero_copy_only=False).reshape(-1, DIM)


def lance_takes(uri: str, rows: int, streams: int, seconds: float,
                copy: ToDevice | None = None) -> float:
    """Rows/s of Lance's takes of a full shuffle on ``streams`` threads, for ``seconds``
    at most (one stream: each batch copied to the device by ``copy``)."""
    import lance

    ds = lance.dataset(uri)
    ds.take(np.arange(8), columns=["v"])  # opened and its metadata read before timing
    chunks = id_chunks(rows)
    lock = threading.Lock()
    done = [0] * streams
    started = time.perf_counter()

    def stream(k: int) -> None:
        while time.perf_counter() - started < seconds:
            with lock:
                ids = next(chunks, None)
            if ids is None:
                return
            got = vectors(ds.take(ids, columns=["v"]))
            if copy is not None:
                copy(got)
            done[k] += len(got)

    threads = [threading.Thread(target=stream, args=(k,)) for k in range(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if copy is not None:
        copy.finish()
    return sum(done) / (time.perf_counter() - started)


# ----------------------------------------------------------------------------- loaders
def synchronize(device: torch.device | None) -> None:
    if device is not None:
        torch.cuda.current_stream(device).synchronize()


def gpu_step(device: torch.device, ms: float) -> Callable[[], None]:
    """A stand-in training step: ``ms`` of GPU work on the consumer's stream, then the host
    waits for it (as ``loss.item()`` does), so the next batch is asked for after it."""
    cycles = 10_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles)  # warm
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    per_ms = cycles / max(start.elapsed_time(end), 1e-6)

    def step() -> None:
        torch.cuda._sleep(int(per_ms * ms))
        torch.cuda.current_stream(device).synchronize()

    return step


def lance_ray_pass(table: Any, reader: str, device: torch.device | None, seconds: float,
                   warm: bool = True, step: Callable[[], None] | None = None
                   ) -> tuple[float, float, float | None, float | None]:
    """(steady rows/s after the first batch, first batch s, fractions of batches the
    consumer waited on their copy / on their read) of one full-shuffle pass, bounded by
    ``seconds``; ``warm``: after a first pass that starts Ray's workers (skipped by --small);
    ``step``: the consumer's work per batch (none: it asks for the next batch at once)."""
    import lance_ray

    def view(filter: str | None = None) -> Any:
        return lance_ray.StreamingDataset(table, num_splits=SPLITS, shuffle_seed=SEED,
                                          columns=["v"], reader=reader, filter=filter)

    if reader == "ray" and warm:
        # Ray's workers start (and import lance_ray) on a first pass, read to its end:
        # stopping a Ray Data pipeline early ends the workers running its tasks.
        for _ in view(f"id < {2 * BATCH}").iter_batches(BATCH, device=device):
            pass
    ds = view()
    started = time.perf_counter()
    rows, first, first_rows = 0, 0.0, 0
    for batch in ds.iter_batches(BATCH, device=device):
        rows += len(batch["v"])
        if step is not None:
            step()
        if not first:
            first, first_rows = time.perf_counter(), rows
        if time.perf_counter() - started > seconds:
            break
    synchronize(device)
    steady = (rows - first_rows) / max(time.perf_counter() - first, 1e-9)
    stats = ds.device_stats
    if not stats.handed:
        return steady, first - started, None, None
    return steady, first - started, stats.waited_fraction, stats.starved_fraction


def reference_pass(table: Any, device: torch.device | None, seconds: float) -> float:
    """Rows/s of the reference with torch's DataLoader(pin_memory=True), bounded."""
    from lancedb.streaming import StreamingDataset as Reference
    from torch.utils.data import DataLoader

    ds = Reference(table, num_splits=SPLITS, shuffle_seed=SEED, columns=["v"])
    loader = DataLoader(ds, batch_size=BATCH, num_workers=0, pin_memory=device is not None)
    started = time.perf_counter()
    rows = 0
    for batch in loader:
        v = batch["v"]
        if isinstance(v, (list, tuple)):  # per-sample lists collate to one tensor per value
            rows += len(v[0])
            v = torch.stack(v, 1)
        else:
            rows += len(v)
        if device is not None:
            v.to(device, non_blocking=True)
        if time.perf_counter() - started > seconds:
            break
    synchronize(device)
    return rows / (time.perf_counter() - started)


@contextlib.contextmanager
def two_streams() -> Iterator[None]:
    """The local reader as it was before its takes were sized from the cores: 2 streams."""
    from lance_ray.read import local

    real = local.usable_cores
    local.usable_cores = lambda: 2
    try:
        yield
    finally:
        local.usable_cores = real


# ----------------------------------------------------------------------------- the report
class Report:
    """``<name>.json`` in the shared bench format, rewritten as each case ends."""

    def __init__(self, out: Path, machine: str, command: str, rows: int, name: str = "device"):
        self.path = out / f"{name}.json"
        self.data: dict[str, Any] = {
            "name": name,
            "title": f"Full shuffle of {rows:,} rows x {DIM} float32 (4 KB) into device memory, "
                     f"batch {BATCH}",
            "machine": machine, "command": command,
            "date": datetime.date.today().isoformat(), "columns": COLUMNS, "rows": [],
            "notes": [
                "rows/s: lance_ray cases after their first batch (first batch s apart); the "
                "others over the whole timed part.",
                "x best concurrent take: vs the best of Lance's K-stream takes (reads only), "
                "the full-shuffle limit of this disk.",
                "waited on copy: batches read before the consumer asked for them whose copy "
                "had not finished when handed over (the consumer's stream waited on it); "
                "starved by reads: batches the consumer asked for before they were read.",
                "The reference is stopped after its time bound (it is far slower).",
                f"'{STEP_MS:g} ms GPU step': the consumer runs that much GPU work per batch "
                "and waits for it (as loss.item() does) before asking for the next batch; "
                "the cases without it ask at once, so a burst of batches arriving together "
                "is handed over as fast as it is staged and counts as waited.",
            ]}
        self.rates: dict[str, float] = {}

    def add(self, case: str, rate: float | None, *, waited: float | None = None,
            starved: float | None = None, first: float | None = None) -> None:
        if rate is not None:
            self.rates[case] = rate
        best = max((r for c, r in self.rates.items() if c.startswith("Lance take, ")
                    and "streams" in c), default=None)
        ref = next((r for c, r in self.rates.items() if c.startswith("reference")), None)
        row = [case, None if rate is None else round(rate),
               None if rate is None else round(rate * ROW_BYTES / 1e9, 3),
               None if rate is None or not best else round(rate / best, 3),
               None if rate is None or not ref else round(rate / ref, 1),
               None if waited is None else round(waited, 4),
               None if starved is None else round(starved, 4),
               None if first is None else round(first, 3)]
        self.data["rows"].append(row)
        print(" | ".join(str(x) for x in row), flush=True)
        self.path.write_text(json.dumps(self.data, indent=1) + "\n")

    def finish(self) -> None:
        """Ratios against cases measured later (the best take, the reference) filled in."""
        best = max((r for c, r in self.rates.items() if c.startswith("Lance take, ")
                    and "streams" in c), default=None)
        ref = next((r for c, r in self.rates.items() if c.startswith("reference")), None)
        for row in self.data["rows"]:
            if row[1] is not None:
                row[3] = round(row[1] / best, 3) if best else None
                row[4] = round(row[1] / ref, 1) if ref else None
        self.path.write_text(json.dumps(self.data, indent=1) + "\n")


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m jobs.bench.device", description=__doc__)
    p.add_argument("--out", default="docs/bench")
    p.add_argument("--rows", type=int, default=None, help="default 500,000 (--small 20,000)")
    p.add_argument("--small", action="store_true", help="a quick run (< 60 s on 2 cores)")
    p.add_argument("--machine", default=None, help="the machine's name in the results")
    p.add_argument("--name", default="device",
                   help="the results' name: they go to OUT/NAME.json (default device)")
    p.add_argument("--db", default=None, help="where the table is written (default: a "
                   "temporary folder, removed at the end)")
    args = p.parse_args()
    for key, value in {"RAY_AUTH_MODE": "disabled", "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
                       "RAY_USAGE_STATS_ENABLED": "0"}.items():
        os.environ.setdefault(key, value)
    rows = args.rows or (20_000 if args.small else 500_000)
    bound = 1.5 if args.small else 4.0  # seconds per bounded case
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else None
    gpu = torch.cuda.get_device_name(device) if cuda else None
    machine = args.machine or (f"{cores()}-core {gpu} machine" if cuda
                               else f"{cores()}-core dev VM, no GPU (reads only, no copy)")
    command = "python -m jobs.bench.device" + (" --small" if args.small else "") + (
        f" --rows {args.rows}" if args.rows else "")
    report = Report(out, machine, command, rows, args.name)
    if args.small:
        report.data["notes"].append("--small: no warm-up pass for the Ray reader, so its "
                                    "figure includes Ray's workers starting.")
    scratch = tempfile.mkdtemp(prefix="lance_ray_device_") if args.db is None else None
    db = Path(args.db or scratch)  # type: ignore[arg-type]
    db.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        uri, table = make_table(db, rows)
        if device is not None:
            report.add("pinned host->device copy alone", copy_alone(device, 1.0))
        report.add("Lance take, 1 stream -> device" if cuda else "Lance take, 1 stream",
                   lance_takes(uri, rows, 1, bound, ToDevice(device)))
        for k in STREAMS:
            report.add(f"Lance take, {k} streams (reads only)",
                       lance_takes(uri, rows, k, bound))
        reads = 3 * bound
        steady, first, waited, starved = lance_ray_pass(table, "local", device, reads)
        report.add("lance_ray local reader, device='cuda'" if cuda else
                   "lance_ray local reader", steady, waited=waited, starved=starved,
                   first=first)
        if device is not None:
            steady, first, waited, starved = lance_ray_pass(
                table, "local", device, reads, step=gpu_step(device, STEP_MS))
            report.add(f"lance_ray local reader, device='cuda', {STEP_MS:g} ms GPU step",
                       steady, waited=waited, starved=starved, first=first)
        if cores() > 2:
            with two_streams():
                steady, first, waited, starved = lance_ray_pass(table, "local", device, reads)
            report.add("lance_ray local reader, 2 streams (before)", steady, waited=waited,
                       starved=starved, first=first)
        import ray

        ray.init(address="local", num_cpus=cores(), include_dashboard=False,
                 log_to_driver=False)  # a cluster of its own, never another one's
        try:
            steady, first, waited, starved = lance_ray_pass(table, "ray", device, reads,
                                                            warm=not args.small)
            report.add("lance_ray Ray reader, device='cuda'" if cuda else
                       "lance_ray Ray reader", steady, waited=waited, starved=starved,
                       first=first)
            if device is not None:
                steady, first, waited, starved = lance_ray_pass(
                    table, "ray", device, reads, warm=False, step=gpu_step(device, STEP_MS))
                report.add(f"lance_ray Ray reader, device='cuda', {STEP_MS:g} ms GPU step",
                           steady, waited=waited, starved=starved, first=first)
        finally:
            ray.shutdown()
        report.add("reference + DataLoader(pin_memory=True)" if cuda else "reference",
                   reference_pass(table, device, 3.0 if args.small else 10.0))
        report.finish()
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"wrote {report.path} in {time.perf_counter() - started:.0f}s", flush=True)


if __name__ == "__main__":
    main()

