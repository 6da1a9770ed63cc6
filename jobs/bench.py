"""Throughput benchmark: lance_ray vs lancedb.streaming vs Ray Data vs Lance's own read limits.

    python jobs/bench.py [--rows 200000] [--big-rows 2000000] [--repeats 3] [--out runs/bench]
    ray job submit --working-dir . -- python jobs/bench.py --out /abs/path/runs/bench

One run measures, side by side on the same generated table (int64 id, int64 label, float32
x, 64 x float32 vector; ``jobs/make_table.create_table``), for a full shuffle and for
``shuffle_clump_size=1024``, batch size 256, ``num_splits=8``:

1. lance_ray's batch path ``StreamingDataset(...).iter_batches(256)``, ``reader="ray"`` (the
   default) and ``reader="local"``;
2. lance_ray rows through ``StreamingDataLoader(ds, batch_size=256, num_workers=0 / 2)``;
3. the reference, ``lancedb.streaming.StreamingDataset`` through torch
   ``DataLoader(batch_size=256)`` with the same arguments (its defaults otherwise);
4. Ray's own ``ray.data.read_lance(uri).iter_torch_batches(batch_size=256)`` (unshuffled,
   not deterministic);
5. Lance's limits: sorted ``_take_rows`` of random row ids, 4096 per call (the limit for a
   full shuffle), the same for clumped ids, and a sequential ``to_batches(4096)`` scan.

How:

* Every configuration runs in a fresh subprocess, so peak RSS is per configuration. Those
  that use Ray attach to one local Ray (``num_cpus=2``) that this driver starts before any
  timing; the driver itself never opens Lance (the tables are written by a subprocess).
* Each subprocess first warms up (its "cold" first batch includes Ray worker start-up;
  Ray paths warm up on a small filtered table read to its end, because stopping a Ray Data
  pipeline early kills the workers running its tasks), then runs ``--repeats`` timed
  epochs. rows/s is their median; a pass counts from constructing the dataset to its last
  batch (so it includes building the epoch's plan); "steady" rows/s counts only after the
  first batch (the start-up is the separate time-to-first-batch figure); an epoch longer
  than ``--max-seconds`` is measured over the part read (marked *).
* The first timed epoch of lance_ray (and of the reference) takes ``state_dict()`` at 50%
  and 90% of its batches (not timed). Time to first batch after resuming = construct a new
  dataset + ``load_state_dict`` + first batch; fresh = construct + first batch.
* Peak RSS = the trainer process's own peak (VmHWM) plus that of its largest DataLoader
  worker; "tree" is the sampled sum of RSS over the trainer, its children and, for Ray
  configurations, the whole local Ray.
* If DataLoader workers crash with the default start method (fork), the configuration is
  measured again with ``multiprocessing_context="forkserver"`` and marked [forkserver].
* At ``--big-rows`` only the lance_ray batch path (reader="ray") and the reference run, full
  shuffle, one pass capped at ``--big-seconds`` (to stay under 10 minutes), to compare the
  trainer's peak RSS with the ``--rows`` table.

Writes ``<out>/bench.json``, ``<out>/bench.png`` and per-configuration logs under
``<out>/logs``; prints progress and the tables. The tables live in ``<out>/db`` and are
reused by later runs when rows, dim and fragments match. Under ``ray job submit`` pass an
absolute ``--out`` (the job's working directory is a temporary copy).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

BATCH = 256
SPLITS = 8
CLUMP = 1024
DIM = 64
SEED = 0
TAKE_ROWS = 4096  # rows per Lance call in the limit measurements
WARM_BATCHES = 16
WARM_FILTER = f"id < {2 * TAKE_ROWS}"  # the warm-up table of the Ray paths
FRACTIONS = (0.5, 0.9)
SHUFFLES = {"full": None, "clump": CLUMP}

ENV = {"RAY_AUTH_MODE": "disabled", "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}


# ------------------------------------------------------------------------------ configurations


@dataclass
class Config:
    """One measured configuration; everything a subprocess needs to run it."""

    name: str
    label: str
    kind: str  # lance_ray | reference | ray_data | limit
    shuffle: str  # full | clump | none
    table: str = "small"  # small | big
    reader: str = "ray"
    loader_workers: int | None = None  # None: iter_batches; else StreamingDataLoader workers
    limit: str | None = None  # take_random | take_clump | scan
    resume: bool = False

    @property
    def needs_ray(self) -> bool:
        # A StreamingDataLoader with workers reads in its workers (no Ray); with
        # num_workers=0 it reads through the dataset's reader, like iter_batches.
        return self.kind == "ray_data" or (self.kind == "lance_ray" and self.reader == "ray"
                                           and not self.loader_workers)


def configurations(include_big: bool) -> list[Config]:
    out = [
        Config("limit-take", f"Lance sorted take, random ids, {TAKE_ROWS}/call", "limit",
               "full", limit="take_random"),
        Config("limit-take-big", f"Lance sorted take, random ids, {4 * TAKE_ROWS}/call",
               "limit", "full", limit="take_random_big"),
        Config("limit-take-clump", f"Lance sorted take, clumped ids, {TAKE_ROWS}/call",
               "limit", "clump", limit="take_clump"),
        Config("limit-scan", f"Lance sequential scan, to_batches({TAKE_ROWS})", "limit", "none",
               limit="scan"),
    ]
    for shuffle in SHUFFLES:
        out += [
            Config(f"reference-{shuffle}", "lancedb.streaming + DataLoader(nw=0)", "reference",
                   shuffle, resume=True),
            Config(f"batch-ray-{shuffle}", "lance_ray iter_batches (ray)", "lance_ray", shuffle,
                   reader="ray", resume=True),
            Config(f"batch-local-{shuffle}", "lance_ray iter_batches (local)", "lance_ray",
                   shuffle, reader="local", resume=True),
            Config(f"loader0-{shuffle}", "lance_ray StreamingDataLoader(nw=0)", "lance_ray",
                   shuffle, loader_workers=0, resume=True),
            Config(f"loader2-{shuffle}", "lance_ray StreamingDataLoader(nw=2)", "lance_ray",
                   shuffle, loader_workers=2, resume=True),
        ]
    out.append(Config("ray-read-lance", "ray.data.read_lance iter_torch_batches", "ray_data",
                      "none"))
    if include_big:
        out += [
            Config("big-batch-ray-full", "lance_ray iter_batches (ray)", "lance_ray", "full",
                   table="big", reader="ray"),
            Config("big-reference-full", "lancedb.streaming + DataLoader(nw=0)", "reference",
                   "full", table="big"),
        ]
    return out


# ------------------------------------------------------------------------------ measuring (child)


def progress(msg: str) -> None:
    """A progress line for the parent to show (everything else goes to the log)."""
    print(f"@@ {msg}", flush=True)


def current_rss_mb(pid: int | str = "self") -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, IndexError, ValueError):
        return 0.0


def peak_rss_mb(pid: int | str = "self") -> float:
    """VmHWM: the process's own peak RSS since its exec.

    Unlike ``ru_maxrss``, which Linux carries over ``execve`` from the parent (so a child
    started by a large parent reports at least the parent's size), VmHWM belongs to the
    process's own address space.
    """
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0.0


def descendants(root: int) -> list[int]:
    """Pids of all processes below ``root`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, stack = [], list(children.get(root, []))
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack.extend(children.get(pid, []))
    return out


def tree_rss_mb(root: int, *, include_root: bool = True) -> float:
    """Sum of the current RSS of ``root``'s descendants (and of ``root``)."""
    pids = descendants(root) + ([root] if include_root else [])
    return sum(current_rss_mb(pid) for pid in pids)


class TreeSampler(threading.Thread):
    """Peak of ``measure()`` (an RSS sum from /proc), sampled every ``every_s``."""

    def __init__(self, measure: Callable[[], float], every_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.measure, self.peak, self.every_s = measure, 0.0, every_s
        self._stop_event = threading.Event()

    def sample(self) -> None:
        self.peak = max(self.peak, self.measure())

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(self.every_s)

    def stop(self) -> float:
        self._stop_event.set()
        return self.peak


@dataclass
class Pass:
    rows: int = 0
    batches: int = 0
    seconds: float = 0.0  # construction to last batch, state_dict() calls excluded
    construct_s: float = 0.0
    first_batch_s: float = 0.0  # construction (+ load_state_dict) to first batch
    first_rows: int = 0  # rows of the first batch
    complete: bool = True  # False when stopped early (row or time cap)
    id_sum: int | None = 0

    @property
    def rows_per_s(self) -> float:
        return self.rows / self.seconds if self.seconds > 0 else 0.0

    @property
    def steady_rows_per_s(self) -> float:
        """Rows after the first batch over the time after it: throughput without start-up."""
        t = self.seconds - self.first_batch_s
        return (self.rows - self.first_rows) / t if t > 0 else 0.0


@dataclass
class Runner:
    """How to run one configuration: ``make(state)`` returns ``(holder, batch iterator)``."""

    make: Callable[[dict | None], tuple[Any, Iterator[Any]]]
    count: Callable[[Any], int]
    epoch_rows: int
    ids: Callable[[Any], int] | None = None
    state: Callable[[Any], dict] | None = None
    # A small complete pass for warming up Ray (same code path, a filtered table).
    warm: Callable[[dict | None], tuple[Any, Iterator[Any]]] | None = None


def close(it: Any) -> None:
    closer = getattr(it, "close", None) or getattr(it, "_shutdown_workers", None)
    if closer is not None:
        closer()


def timed_pass(runner: Runner, *, state: dict | None = None,
               capture: dict[int, float] | None = None, states: dict[float, dict] | None = None,
               max_rows: int | None = None, max_seconds: float | None = None,
               min_seconds: float = 0.0,
               make: Callable[[dict | None], tuple[Any, Iterator[Any]]] | None = None) -> Pass:
    """One pass: construct, iterate to the end of the epoch or a cap, maybe capture states.

    Stops early once ``max_rows`` rows were read and ``min_seconds`` passed since the first
    batch, or once ``max_seconds`` of the pass have passed.
    """
    gc.collect()
    p = Pass(id_sum=0 if runner.ids is not None else None)
    excluded = 0.0
    start = time.perf_counter()
    holder, it = (make or runner.make)(state)
    p.construct_s = time.perf_counter() - start
    try:
        for batch in it:
            now = time.perf_counter()
            n = runner.count(batch)
            if p.batches == 0:
                p.first_batch_s, p.first_rows = now - start, n
            p.rows += n
            p.batches += 1
            if p.id_sum is not None and runner.ids is not None:
                p.id_sum += runner.ids(batch)
            if capture and p.batches in capture and runner.state is not None:
                t = time.perf_counter()
                states[capture[p.batches]] = runner.state(holder)  # type: ignore[index]
                excluded += time.perf_counter() - t
            elapsed = now - start - excluded
            if (max_rows is not None and p.rows >= max_rows
                    and elapsed - p.first_batch_s >= min_seconds) or (
                    max_seconds is not None and elapsed > max_seconds):
                p.complete = p.rows >= runner.epoch_rows
                break
    finally:
        p.seconds = time.perf_counter() - start - excluded
        close(it)
    return p


def build_runner(spec: dict[str, Any], cfg: Config, mp_context: str | None = None) -> Runner:
    clump = SHUFFLES.get(cfg.shuffle)
    rows = spec["rows"]
    epoch_rows = rows - rows % SPLITS
    if cfg.kind == "limit":
        return limit_runner(spec["uri"], cfg.limit or "scan")
    if cfg.kind == "ray_data":
        import ray.data

        def make_ray(state: dict | None, filter: str | None = None) -> tuple[Any, Iterator[Any]]:
            ds = ray.data.read_lance(spec["uri"], filter=filter)
            return ds, iter(ds.iter_torch_batches(batch_size=BATCH))

        return Runner(make_ray, lambda b: len(b["id"]), rows, ids=lambda b: int(b["id"].sum()),
                      warm=lambda state: make_ray(state, WARM_FILTER))

    import lancedb

    table = lancedb.connect(spec["db"]).open_table(spec["table_name"])
    if cfg.kind == "reference":
        from lancedb.streaming import StreamingDataset as Reference
        from torch.utils.data import DataLoader

        def make_ref(state: dict | None) -> tuple[Any, Iterator[Any]]:
            ds = Reference(table, num_splits=SPLITS, shuffle_seed=SEED, shuffle_clump_size=clump)
            if state is not None:
                ds.load_state_dict(state)
            return ds, iter(DataLoader(ds, batch_size=BATCH, num_workers=0))

        return Runner(make_ref, lambda b: len(b["id"]), epoch_rows,
                      ids=lambda b: int(b["id"].sum()), state=lambda ds: ds.state_dict())

    import lance_ray

    loader_kw = {} if mp_context is None else {"multiprocessing_context": mp_context}

    def make_lr(state: dict | None, filter: str | None = None) -> tuple[Any, Iterator[Any]]:
        ds = lance_ray.StreamingDataset(table, num_splits=SPLITS, shuffle_seed=SEED,
                                        shuffle_clump_size=clump, reader=cfg.reader,
                                        filter=filter)
        if state is not None:
            ds.load_state_dict(state)
        if cfg.loader_workers is None:
            return ds, ds.iter_batches(BATCH)
        loader = lance_ray.StreamingDataLoader(ds, batch_size=BATCH,
                                               num_workers=cfg.loader_workers, **loader_kw)
        return loader, iter(loader)

    return Runner(make_lr, lambda b: len(b["id"]), epoch_rows, ids=lambda b: int(b["id"].sum()),
                  state=lambda holder: holder.state_dict(),
                  warm=(lambda state: make_lr(state, WARM_FILTER)) if cfg.needs_ray else None)


def limit_runner(uri: str, which: str) -> Runner:
    """Lance's own read paths, no torch: the ceilings the loaders are compared with."""
    import lance
    import numpy as np

    ds = lance.dataset(uri)
    n = ds.count_rows()
    if which == "scan":
        def make_scan(state: dict | None) -> tuple[Any, Iterator[Any]]:
            return ds, iter(ds.to_batches(batch_size=TAKE_ROWS))

        return Runner(make_scan, lambda b: b.num_rows, n)
    row_ids = ds.to_table(columns=[], with_row_id=True).column("_rowid").to_numpy()
    rng = np.random.default_rng(SEED)
    per_call = 4 * TAKE_ROWS if which == "take_random_big" else TAKE_ROWS
    if which.startswith("take_random"):
        order = row_ids[rng.permutation(n)]
    else:  # clumps of CLUMP consecutive rows, in random clump order
        clumps = [row_ids[lo:lo + CLUMP] for lo in range(0, n, CLUMP)]
        order = np.concatenate([clumps[i] for i in rng.permutation(len(clumps))])

    def takes() -> Iterator[Any]:
        for lo in range(0, n, per_call):
            yield ds._take_rows(np.sort(order[lo:lo + per_call]).tolist())

    def make_take(state: dict | None) -> tuple[Any, Iterator[Any]]:
        return ds, takes()

    return Runner(make_take, lambda b: b.num_rows, n)


FORKSERVER_PRELOAD = ["numpy", "pyarrow", "torch", "lance", "lancedb", "lance_ray"]


def measure(runner: Runner, cfg: Config, spec: dict[str, Any]) -> dict[str, Any]:
    """Warm-up, the timed epochs, then the resumes from the states they captured."""
    if spec["warm_up"]:
        # Ray worker start-up and first imports happen here (the "cold" first batch). Ray
        # paths read a small filtered table to its end: stopping a Ray Data pipeline early
        # cancels its running read tasks, which kills their worker processes.
        if runner.warm is not None:
            warm = timed_pass(runner, make=runner.warm, max_seconds=spec["max_seconds"])
        else:
            warm = timed_pass(runner, max_rows=WARM_BATCHES * BATCH,
                              max_seconds=spec["max_seconds"])
        cold = warm.first_batch_s
        progress(f"warm-up: cold first batch {cold:.2f}s")
    else:
        cold = None
    nb = math.ceil(runner.epoch_rows / BATCH)
    capture = {max(1, math.floor(f * nb)): f for f in FRACTIONS} if cfg.resume else None
    states: dict[float, dict] = {}
    passes = []
    for i in range(spec["repeats"]):
        p = timed_pass(runner, capture=capture if i == 0 else None, states=states,
                       max_seconds=spec["max_seconds"])
        passes.append(p)
        part = "" if p.complete else f" (capped: {p.rows / runner.epoch_rows:.0%} of the epoch)"
        progress(f"run {i + 1}/{spec['repeats']}: {p.rows_per_s:,.0f} rows/s, "
                 f"{p.rows} rows in {p.seconds:.2f}s, first batch {p.first_batch_s:.3f}s{part}")
    resume: dict[str, list[float]] = {}
    for frac, state in sorted(states.items()):
        times = []
        for _ in range(spec["repeats"] if cfg.kind == "lance_ray" else 1):
            times.append(timed_pass(runner, state=state, max_rows=1).first_batch_s)
        resume[f"{frac:g}"] = times
        progress(f"resume at {frac:.0%}: first batch {statistics.median(times):.3f}s")
    complete = all(p.complete for p in passes)
    expected_sum = None
    if cfg.kind != "limit" and complete and (cfg.kind == "ray_data" or spec["rows"] % SPLITS == 0):
        expected_sum = runner.epoch_rows * (runner.epoch_rows - 1) // 2
    return {
        "cold_first_batch_s": cold if cold is not None else passes[0].first_batch_s,
        "passes": [asdict(p) | {"rows_per_s": p.rows_per_s,
                                "steady_rows_per_s": p.steady_rows_per_s} for p in passes],
        "rows_per_s": statistics.median(p.rows_per_s for p in passes),
        "steady_rows_per_s": statistics.median(p.steady_rows_per_s for p in passes),
        "complete": complete,
        "first_batch_s": statistics.median(p.first_batch_s for p in passes),
        "resume_first_batch_s": {k: statistics.median(v) for k, v in resume.items()},
        "resume_runs_s": resume,
        "ids_ok": None if expected_sum is None else all(
            p.id_sum == expected_sum for p in passes),
    }


def child_main(spec_path: str, result_path: str) -> None:
    os.environ.update(ENV)
    spec = json.loads(Path(spec_path).read_text())
    cfg = Config(**spec["config"])
    started = time.perf_counter()
    import numpy  # noqa: F401  (imports are part of set-up, never of a timing)

    if cfg.kind != "limit":
        import lancedb  # noqa: F401
        import torch  # noqa: F401
    ray_init_s = 0.0
    if cfg.needs_ray:
        import ray
        import ray.data  # noqa: F401

        t = time.perf_counter()
        # The parent's Ray cluster (RAY_ADDRESS); ray.init is never part of a timing.
        ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
        ray_init_s = time.perf_counter() - t
    runner = build_runner(spec, cfg)
    setup_s = time.perf_counter() - started
    rss_setup = current_rss_mb()
    progress(f"set-up {setup_s:.1f}s (ray.init {ray_init_s:.1f}s), RSS {rss_setup:.0f} MB")

    start_method, fork_error, workers = None, None, None
    if cfg.loader_workers:
        start_method = "fork (default)"
        # The largest DataLoader worker (or fork server): its own peak, sampled.
        workers = TreeSampler(lambda: max(map(peak_rss_mb, descendants(os.getpid())),
                                          default=0.0), every_s=0.5)
        workers.start()
    try:
        measured = measure(runner, cfg, spec)
    except RuntimeError as e:
        if not cfg.loader_workers:
            raise
        # A DataLoader worker died (lance is not fork-safe once the parent has used it):
        # measure again with forkserver workers, the heavy imports preloaded in the server.
        import multiprocessing

        fork_error = f"{type(e).__name__}: {str(e).splitlines()[0]}"
        progress(f"DataLoader worker failed with the default start method (fork): "
                 f"{fork_error}; measuring again with multiprocessing_context='forkserver'")
        multiprocessing.set_forkserver_preload(FORKSERVER_PRELOAD)
        start_method = "forkserver (fork failed)"
        measured = measure(build_runner(spec, cfg, mp_context="forkserver"), cfg, spec)

    rss_self = peak_rss_mb()
    rss_children = workers.stop() if workers is not None else 0.0
    result = {
        "config": asdict(cfg),
        "rows": spec["rows"],
        "epoch_rows": runner.epoch_rows,
        "setup_s": setup_s,
        "ray_init_s": ray_init_s,
        "rss_setup_mb": rss_setup,
        "start_method": start_method,
        "fork_error": fork_error,
        **measured,
        "peak_rss_self_mb": rss_self,
        "peak_rss_children_mb": rss_children,
        "peak_rss_mb": rss_self + rss_children,
        "ru_maxrss_self_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "ru_maxrss_children_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
    }
    Path(result_path).write_text(json.dumps(result, indent=1))
    if cfg.needs_ray:
        import ray

        ray.shutdown()



# ------------------------------------------------------------------------------ driver (parent)


def ensure_table(db: Path, name: str, rows: int, fragments: int) -> dict[str, Any]:
    """Create the table unless an identical one (same rows, dim, fragments) is there."""
    import lancedb

    marker = db / f"{name}.bench.json"
    want = {"rows": rows, "dim": DIM, "fragments": fragments}
    conn = lancedb.connect(str(db))
    if marker.exists() and name in conn.table_names():
        got = json.loads(marker.read_text())
        table = conn.open_table(name)
        if {k: got.get(k) for k in want} == want and got.get("version") == table.version \
                and table.count_rows() == rows:
            print(f"reusing table {name!r}: {rows:,} rows, dim {DIM}, version {table.version}",
                  flush=True)
            return got | {"uri": table.to_lance().uri, "created_s": 0.0}
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from make_table import create_table

    t = time.perf_counter()
    table = create_table(str(db), name, rows=rows, dim=DIM, fragments=fragments)
    took = time.perf_counter() - t
    info = want | {"version": table.version}
    marker.write_text(json.dumps(info))
    print(f"created table {name!r}: {rows:,} rows, dim {DIM}, {fragments} fragments in "
          f"{took:.1f}s", flush=True)
    return info | {"uri": table.to_lance().uri, "created_s": took}


def start_ray() -> str:
    """One local Ray for every configuration that needs it; returns its address."""
    import ray

    t = time.perf_counter()
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    address = ray.get_runtime_context().gcs_address
    print(f"started a local Ray (num_cpus=2) at {address} in {time.perf_counter() - t:.1f}s",
          flush=True)
    return address


def run_child(cfg: Config, spec: dict[str, Any], out: Path, timeout: float,
              ray_address: str | None) -> dict[str, Any]:
    logs = out / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    spec_path = logs / f"{cfg.name}.spec.json"
    result_path = logs / f"{cfg.name}.result.json"
    result_path.unlink(missing_ok=True)
    spec_path.write_text(json.dumps(spec | {"config": asdict(cfg)}))
    # Any Ray use in the child goes to our cluster, never to another one on this machine.
    env = os.environ | ENV | {"RAY_ADDRESS": ray_address or "local"}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path),
           "--result", str(result_path)]
    started = time.monotonic()
    with open(logs / f"{cfg.name}.log", "w") as log:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env,
                                cwd=REPO)
        # The trainer's process tree, plus the whole Ray cluster if the configuration uses it.
        sampler = TreeSampler((lambda: tree_rss_mb(os.getpid(), include_root=False))
                              if cfg.needs_ray else (lambda: tree_rss_mb(proc.pid)),
                              every_s=0.5)
        sampler.start()
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                if line.startswith("@@ "):
                    print(f"      {line[3:].rstrip()}", flush=True)
                else:
                    log.write(line)
            code = proc.wait()
        finally:
            timer.cancel()
            tree_peak = sampler.stop()
    took = time.monotonic() - started
    if code != 0 or not result_path.exists():
        why = "timed out" if took >= timeout else f"exit code {code}"
        print(f"      FAILED ({why}); see {logs / (cfg.name + '.log')}", flush=True)
        return {"config": asdict(cfg), "error": why, "wall_s": took}
    return json.loads(result_path.read_text()) | {"wall_s": took, "tree_peak_rss_mb": tree_peak}


W = 50  # width of the configuration column


def label_of(r: dict[str, Any]) -> str:
    """The configuration's label, with the DataLoader start method when it had to change."""
    method = r.get("start_method") or ""
    return r["config"]["label"] + (" [forkserver]" if method.startswith("forkserver") else "")


def fmt_rate(x: float | None) -> str:
    if not x:
        return "-"
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k"


def fmt_ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def fmt_s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def analyse(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Ratios to the reference and to the limits, and the targets of the issue."""
    ok = {r["config"]["name"]: r for r in results if "error" not in r}

    def rate(name: str) -> float | None:
        return ok[name]["rows_per_s"] if name in ok else None

    limits = {"full": rate("limit-take"), "clump": rate("limit-scan"),
              "none": rate("limit-scan")}
    refs = {"full": rate("reference-full"), "clump": rate("reference-clump"),
            "none": rate("reference-full")}
    for r in results:
        c = r["config"]
        if "error" in r or c["table"] != "small":
            continue
        ref, lim = refs[c["shuffle"]], limits[c["shuffle"]]
        r["x_reference"] = r["rows_per_s"] / ref if ref else None
        r["x_limit"] = r["rows_per_s"] / lim if lim else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    def get(name: str, *keys: str) -> float | None:
        v: Any = ok.get(name)
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        return v

    targets = []

    def target(what: str, value: float | None, bound: float, detail: str) -> None:
        targets.append({"target": what, "value": value, "bound": bound, "detail": detail,
                        "holds": None if value is None else value >= bound})

    def target_le(what: str, value: float | None, bound: float, detail: str) -> None:
        targets.append({"target": what, "value": value, "bound": bound, "detail": detail,
                        "holds": None if value is None else value <= bound})

    for reader in ("ray", "local"):
        name = f"batch-{reader}-full"
        target(f"full-shuffle batch path ({reader}) >= 3x reference",
               ratio(rate(name), rate("reference-full")), 3.0, ">= 3.0x")
        target(f"full-shuffle batch path ({reader}) >= 0.6x sorted-take limit",
               ratio(rate(name), rate("limit-take")), 0.6, ">= 0.6x")
        target(f"clumped (1024) batch path ({reader}) >= 0.5x sequential scan",
               ratio(rate(f"batch-{reader}-clump"), rate("limit-scan")), 0.5, ">= 0.5x")
        target_le(f"first batch after resume at 90% <= 1.2x fresh ({reader}, full shuffle)",
                  ratio(get(name, "resume_first_batch_s", "0.9"), get(name, "first_batch_s")),
                  1.2, "<= 1.2x")
    target_le("trainer peak RSS at big rows <= 1.2x at rows (batch path, ray, full shuffle)",
              ratio(get("big-batch-ray-full", "peak_rss_mb"), get("batch-ray-full", "peak_rss_mb")),
              1.2, "<= 1.2x")
    return {"targets": targets, "limits": limits, "references": refs}


def print_report(results: list[dict[str, Any]], analysis: dict[str, Any], args: Any,
                 notes: list[str]) -> None:
    small = [r for r in results if r["config"]["table"] == "small"]
    print(f"\nThroughput at {args.rows:,} rows (dim {DIM}), batch {BATCH}, num_splits {SPLITS}; "
          f"rows/s = median of {args.repeats} epochs, construction to last batch (steady/s: "
          "after the first batch); x reference = vs the reference with the "
          "same shuffle (unshuffled rows: vs full shuffle); x limit = vs Lance's sorted take "
          f"of random ids, {TAKE_ROWS}/call (full shuffle) or sequential scan (clump, "
          "unshuffled)")
    head = (f"{'configuration':<{W}} {'shuffle':<7} {'rows/s':>8} {'x ref':>7} {'x limit':>8} "
            f"{'steady/s':>8} {'1st batch s':>11} {'peak RSS MB':>11} {'tree RSS MB':>11}")
    print(head)
    print("-" * len(head))
    for r in small:
        c = r["config"]
        if "error" in r:
            print(f"{c['label']:<{W}} {c['shuffle']:<7} FAILED: {r['error']}")
            continue
        flag = "" if r.get("complete", True) else "*"
        print(f"{label_of(r):<{W}} {c['shuffle']:<7} {fmt_rate(r['rows_per_s']) + flag:>8} "
              f"{fmt_ratio(r.get('x_reference')):>7} {fmt_ratio(r.get('x_limit')):>8} "
              f"{fmt_rate(r.get('steady_rows_per_s')):>8} "
              f"{fmt_s(r['first_batch_s'] if c['kind'] != 'limit' else None):>11} "
              f"{r['peak_rss_mb']:>11.0f} {r['tree_peak_rss_mb']:>11.0f}")

    print("\nTime to first batch (s; construct [+ load_state_dict] to first batch, warm; cold = "
          "first pass of the process, incl. Ray worker start-up)")
    head = (f"{'configuration':<{W}} {'shuffle':<7} {'cold':>7} {'fresh':>7} {'res 50%':>8} "
            f"{'res 90%':>8} {'90%/fresh':>9}")
    print(head)
    print("-" * len(head))
    for r in small:
        c = r["config"]
        if "error" in r or not c["resume"]:
            continue
        res = r["resume_first_batch_s"]
        r90 = res.get("0.9")
        print(f"{label_of(r):<{W}} {c['shuffle']:<7} {r['cold_first_batch_s']:>7.3f} "
              f"{r['first_batch_s']:>7.3f} {fmt_s(res.get('0.5')):>8} {fmt_s(r90):>8} "
              f"{fmt_ratio(r90 / r['first_batch_s'] if r90 else None):>9}")

    big = {r["config"]["name"]: r for r in results if r["config"]["table"] == "big"}
    if big:
        byname = {r["config"]["name"]: r for r in small}
        print(f"\nTrainer peak RSS, {args.rows:,} vs {args.big_rows:,} rows (full shuffle; big "
              f"rows: one pass capped at {args.big_seconds:g}s of iteration)")
        head = (f"{'configuration':<{W}} {'RSS small':>9} {'RSS big':>9} {'ratio':>7} "
                f"{'tree big':>9} {'rows/s big':>10} {'epoch read':>10}")
        print(head)
        print("-" * len(head))
        for name, r in big.items():
            if "error" in r:
                print(f"{r['config']['label']:<{W}} FAILED: {r['error']}")
                continue
            s = byname.get(name.removeprefix("big-"))
            s_rss = s["peak_rss_mb"] if s and "error" not in s else None
            frac = sum(p["rows"] for p in r["passes"]) / (r["epoch_rows"] * len(r["passes"]))
            print(f"{r['config']['label']:<{W}} {s_rss or 0:>9.0f} {r['peak_rss_mb']:>9.0f} "
                  f"{fmt_ratio(r['peak_rss_mb'] / s_rss if s_rss else None):>7} "
                  f"{r['tree_peak_rss_mb']:>9.0f} {fmt_rate(r['rows_per_s']):>10} {frac:>10.0%}")

    print("\nTargets")
    for t in analysis["targets"]:
        mark = {True: "HOLDS", False: "FAILS", None: "n/a"}[t["holds"]]
        print(f"  [{mark:<5}] {t['target']}: {fmt_ratio(t['value'])} (needs {t['detail']})")
    for n in notes:
        print(f"note: {n}")


def chart(results: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if "error" not in r and r["config"]["table"] == "small"]
    labels = list(dict.fromkeys(label_of(r) for r in rows))
    colors = {"full": "#1f77b4", "clump": "#ff7f0e", "none": "#7f7f7f"}
    fig, ax = plt.subplots(figsize=(10, 0.65 * len(labels) + 1.8))
    height = 0.38
    for i, label in enumerate(labels):
        mine = [r for r in rows if label_of(r) == label]
        for r in mine:
            sh = r["config"]["shuffle"]
            off = 0.0 if len(mine) == 1 else (-height / 2 if sh == "full" else height / 2)
            ax.barh(i + off, r["rows_per_s"], height=height, color=colors[sh])
            ax.text(r["rows_per_s"] * 1.03, i + off, fmt_rate(r["rows_per_s"]),
                    va="center", fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=9)
    ax.invert_yaxis()
    ax.set_xscale("log")
    rates = [r["rows_per_s"] for r in rows]
    ax.set_xlim(min(rates) / 2, max(rates) * 2.5)
    ax.set_xlabel("rows/s (median; log scale)")
    ax.set_title(title, fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, ["full shuffle", f"shuffle_clump_size={CLUMP}", "unshuffled / n.a."],
              loc="lower right", fontsize=8)
    ax.grid(axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def git_state() -> dict[str, Any]:
    def git(*a: str) -> str:
        try:
            return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True,
                                  timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""

    return {"commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--", "lance_ray"))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=200_000)
    p.add_argument("--big-rows", type=int, default=2_000_000,
                   help="rows of the table for the RSS scaling check (0: skip)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="runs/bench")
    p.add_argument("--fragments", type=int, default=4)
    p.add_argument("--max-seconds", type=float, default=20.0,
                   help="cap on one timed epoch; a capped epoch is measured over its part")
    p.add_argument("--big-seconds", type=float, default=25.0,
                   help="iteration time cap of the one pass at --big-rows")
    p.add_argument("--only", default="", help="comma-separated configuration names (debugging)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--tables", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child_main(args.child, args.result)
        return
    db = Path(args.out).resolve() / "db"
    if args.tables:
        tables = {"small": ensure_table(db, "bench", args.rows, args.fragments),
                  "big": ensure_table(db, "bench_big", args.big_rows, args.fragments)
                  if args.big_rows else None}
        Path(args.result).write_text(json.dumps(tables))
        return

    started = time.monotonic()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.update(ENV)
    # Under `ray job submit` this driver carries the job's runtime env (a working_dir package
    # held by the job's cluster); our own local Ray and its drivers must not inherit it.
    os.environ.pop("RAY_JOB_CONFIG_JSON_ENV_VAR", None)
    # Tables are written by a subprocess: this process stays small and never touches Lance
    # (forking after Lance has started its threads is unsafe), it only starts Ray.
    tables_json = out / "tables.json"
    subprocess.run([sys.executable, str(Path(__file__).resolve()), "--tables", "--out",
                    str(out), "--rows", str(args.rows), "--big-rows", str(args.big_rows),
                    "--fragments", str(args.fragments), "--result", str(tables_json)],
                   check=True, env=os.environ | ENV | {"PYTHONWARNINGS": "ignore"})
    tables = json.loads(tables_json.read_text())
    small, big = tables["small"], tables["big"]
    configs = configurations(include_big=big is not None)
    if args.only:
        wanted = set(args.only.split(","))
        configs = [c for c in configs if c.name in wanted]
    ray_address = start_ray() if any(c.needs_ray for c in configs) else None
    results = []
    for i, cfg in enumerate(configs, 1):
        tbl = small if cfg.table == "small" else big
        assert tbl is not None
        print(f"[{i:>2}/{len(configs)}] {cfg.name}: {cfg.label}, shuffle {cfg.shuffle}, "
              f"{tbl['rows']:,} rows  (t+{time.monotonic() - started:.0f}s)", flush=True)
        spec = {"db": str(db), "table_name": "bench" if cfg.table == "small" else "bench_big",
                "uri": tbl["uri"], "rows": tbl["rows"],
                "repeats": args.repeats if cfg.table == "small" else 1,
                "warm_up": cfg.table == "small",
                "max_seconds": args.max_seconds if cfg.table == "small" else args.big_seconds}
        r = run_child(cfg, spec, out, timeout=max(180.0, 8 * args.max_seconds),
                      ray_address=ray_address)
        results.append(r)
        if "error" not in r:
            print(f"      => {fmt_rate(r['rows_per_s'])} rows/s, first batch "
                  f"{r['first_batch_s']:.3f}s, peak RSS {r['peak_rss_mb']:.0f} MB "
                  f"({r['wall_s']:.0f}s)", flush=True)
    if ray_address:
        import ray

        ray.shutdown()
    analysis = analyse(results)
    total = time.monotonic() - started
    notes = []
    if any(not r.get("complete", True) for r in results if r["config"]["table"] == "small"):
        notes.append(f"* = epochs stopped at the --max-seconds cap ({args.max_seconds:g}s); "
                     "rows/s is over the part read")
    if big:
        notes.append(f"RSS at {args.big_rows:,} rows is measured over one pass capped at "
                     f"{args.big_seconds:g}s of iteration (not a whole epoch), to keep the run "
                     "under 10 minutes")
    notes.append("peak RSS = the trainer process's own peak (VmHWM; ru_maxrss is not used "
                 "because Linux carries it over exec from the parent) + the largest DataLoader "
                 "worker's; tree = sampled peak of the summed RSS of the trainer, its children "
                 "and, for configurations that use Ray, the whole local Ray (daemons and "
                 "workers; shared pages counted once per process)")
    notes.append("every configuration ran in a fresh process; those that use Ray attach to "
                 "one local Ray (num_cpus=2) started before any timing")
    fork_errors = [r["fork_error"] for r in results if r.get("fork_error")]
    if fork_errors:
        notes.append("[forkserver] = the DataLoader workers crashed with the default start "
                     f"method (fork) ({fork_errors[0]}) and the configuration was measured "
                     "again with multiprocessing_context='forkserver'")
    notes.append(f"timings are noisy on a shared 2-core machine; total run {total:.0f}s"
                 + (" (OVER the 10-minute budget)" if total > 600 else ""))
    print_report(results, analysis, args, notes)
    meta = {"rows": args.rows, "big_rows": args.big_rows, "repeats": args.repeats, "dim": DIM,
            "batch_size": BATCH, "num_splits": SPLITS, "clump": CLUMP, "seed": SEED,
            "take_rows": TAKE_ROWS, "max_seconds": args.max_seconds,
            "big_seconds": args.big_seconds, "tables": {"small": small, "big": big},
            "git": git_state(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "total_s": total,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - total))}
    (out / "bench.json").write_text(json.dumps(
        {"meta": meta, "results": results, **analysis, "notes": notes}, indent=1))
    chart(results, out / "bench.png",
          f"lance_ray vs lancedb.streaming vs Lance's limits\n{args.rows:,} rows, dim {DIM}, "
          f"batch {BATCH}, {SPLITS} splits, {os.cpu_count()} CPUs")
    print(f"\nwrote {out / 'bench.json'} and {out / 'bench.png'} in {total:.0f}s")


if __name__ == "__main__":
    main()
