"""One configuration in a fresh process: warm-up, timed epochs, resumes, peak RSS.

    python -m jobs.bench.child SPEC.json RESULT.json   (started by jobs.bench.run)
"""

from __future__ import annotations

import json
import math
import os
import resource
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .cases import build_runner
from .configs import (
    BATCH,
    ENV,
    FRACTIONS,
    SPLITS,
    WARM_BATCHES,
    Config,
)
from .memory import TreeSampler, current_rss_mb, descendants, peak_rss_mb
from .runners import Runner, timed_pass


def progress(msg: str) -> None:
    """A progress line for the parent to show (everything else goes to the log)."""
    print(f"@@ {msg}", flush=True)


FORKSERVER_PRELOAD = ["numpy", "pyarrow", "torch", "lance", "lancedb", "lance_ray"]


def measure(runner: Runner, cfg: Config, spec: dict[str, Any]) -> dict[str, Any]:
    """Warm-up, the timed epochs, then the resumes from the states they captured."""
    if spec["warm_up"]:
        # Ray worker start-up and first imports happen here (the "cold" first batch).
        if runner.warm_whole_epoch:
            warm = timed_pass(runner)
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
    if runner.ids is not None and complete and (cfg.kind == "ray_data"
                                                or spec["rows"] % SPLITS == 0):
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
    try:
        runner = build_runner(spec, cfg)
    except NotImplementedError as e:  # a path this checkout cannot run: say so, no figure
        progress(f"skipped: {e}")
        Path(result_path).write_text(json.dumps({"config": asdict(cfg),
                                                 "error": f"skipped: {e}"}))
        return
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
    if cfg.nodes:
        from .transform_runs import rows_per_node

        result["rows_per_node"] = rows_per_node(spec["node_log"])
    Path(result_path).write_text(json.dumps(result, indent=1))
    if cfg.needs_ray or cfg.nodes:
        import ray

        ray.shutdown()
    if "cluster" in spec:
        spec["cluster"].shutdown()



if __name__ == "__main__":
    child_main(*sys.argv[1:3])
