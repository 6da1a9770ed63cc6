"""The driver: tables, one local Ray, every configuration in its own process, the report.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from .cases import GROUPS, configurations
from .cold_start import measure as measure_cold
from .configs import (
    BATCH,
    CLUMP,
    DIM,
    ENV,
    REPO,
    SEED,
    SPLITS,
    TAKE_ROWS,
    Config,
)
from .export import exported
from .formats import fmt_rate
from .memory import TreeSampler, tree_rss_mb
from .packing import PACK_BATCH, PACK_DOCS, PACK_LEN, PACK_MEAN_LEN, PACK_TABLE
from .report import analyse, chart, print_report
from .results import DEFAULT_OUT
from .results import write as write_results
from .transform_runs import transform_report

TABLE_NAMES = {"small": "bench", "big": "bench_big", "wide": "wide", "tokens": PACK_TABLE}


def start_ray() -> str:
    """One local Ray for every configuration that needs it; returns its address."""
    import ray

    t = time.perf_counter()
    for attempt in range(6):  # on a loaded machine the raylet can miss Ray's 30 s start wait
        try:
            ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
                     _temp_dir=tempfile.mkdtemp(prefix="lance_ray_bench_ray_"))
            break
        except Exception as e:  # Ray raises a bare Exception for it
            if attempt == 5 or "timed out during startup" not in str(e):
                raise
            print(f"Ray did not start ({e}); trying again", flush=True)
            ray.shutdown()
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
    cmd = [sys.executable, "-m", "jobs.bench.child", str(spec_path), str(result_path)]
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
    p = argparse.ArgumentParser(prog="python -m jobs.bench", description="Throughput: "
                                "lance_ray vs lancedb.streaming vs Ray Data vs Lance's limits.")
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
    p.add_argument("--wide-rows", type=int, default=40_000,
                   help="rows of the wide table (0: skip the wide-row configurations)")
    p.add_argument("--wide-bytes", type=int, default=65_536, help="bytes per wide row")
    p.add_argument("--cold-trials", type=int, default=3,
                   help="fresh processes per loader for the no-cluster cold start (0: skip)")
    p.add_argument("--pack-docs", type=int, default=PACK_DOCS,
                   help="documents of the packed-tokens case's table")
    p.add_argument("--json-out", default=DEFAULT_OUT,
                   help="folder of the shared-format results (docs/performance.md is rendered "
                        "from them by python -m jobs.bench.performance; '' skips)")
    p.add_argument("--machine", default=None,
                   help="the machine's name in the results (default: $LANCE_RAY_BENCH_MACHINE "
                        "or '<cpus>-core machine')")
    p.add_argument("--only", default="",
                   help="comma-separated configuration names, or groups of the case registry "
                        f"({', '.join(GROUPS)}: jobs.bench.cases), or 'cold-start'")
    args = p.parse_args()
    db = Path(args.out).resolve() / "db"

    started = time.monotonic()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    os.environ.update(ENV)
    # Under `ray job submit` this driver carries the job's runtime env (a working_dir package
    # held by the job's cluster); our own local Ray and its drivers must not inherit it.
    os.environ.pop("RAY_JOB_CONFIG_JSON_ENV_VAR", None)
    # Tables are written by a subprocess: this process stays small and never touches Lance
    # (forking after Lance has started its threads is unsafe), it only starts Ray.
    wanted = set(args.only.split(",")) if args.only else set()
    configs = configurations(include_big=args.big_rows > 0, include_wide=args.wide_rows > 0)
    if wanted:
        configs = [c for c in configs if c.name in wanted or c.group in wanted]
    needed = {c.table for c in configs}
    tables_json = out / "tables.json"
    # Only the tables the chosen configurations read (0 rows: not made).
    subprocess.run([sys.executable, "-m", "jobs.bench.tables", str(db),
                    str(args.rows if "small" in needed else 0),
                    str(args.big_rows if "big" in needed else 0), str(args.fragments),
                    str(tables_json), str(args.wide_rows if "wide" in needed else 0),
                    str(args.wide_bytes), str(args.pack_docs if "tokens" in needed else 0)],
                   check=True, cwd=REPO, env=os.environ | ENV | {"PYTHONWARNINGS": "ignore"})
    tables = json.loads(tables_json.read_text())
    big = tables["big"]
    if any(c.transform for c in configs):
        subprocess.run([sys.executable, "-m", "jobs.bench.transforms", "tables", str(db),
                        str(out / "transform_tables.json")], check=True, cwd=REPO,
                       env=os.environ | ENV | {"PYTHONWARNINGS": "ignore"})
        tables |= json.loads((out / "transform_tables.json").read_text())
    # Ray workers import the transforms from this checkout (jobs.bench.transforms).
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    ray_address = start_ray() if any(c.needs_ray for c in configs) else None
    results = []
    for i, cfg in enumerate(configs, 1):
        tbl = tables[cfg.table]
        assert tbl is not None
        print(f"[{i:>2}/{len(configs)}] {cfg.name}: {cfg.label}, shuffle {cfg.shuffle}, "
              f"{tbl['rows']:,} rows  (t+{time.monotonic() - started:.0f}s)", flush=True)
        once = cfg.table == "big"  # one capped pass, no warm-up: the RSS check
        spec = {"db": str(db), "table_name": TABLE_NAMES.get(cfg.table, cfg.table),
                "uri": tbl["uri"], "rows": tbl["rows"],
                "blocks_per_epoch": tbl.get("blocks_per_epoch"),
                "repeats": 1 if once else {"wide": 2}.get(cfg.table, args.repeats),
                "warm_up": not once,
                "max_seconds": args.big_seconds if once else args.max_seconds}
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
    cold = None
    if args.cold_trials and (not wanted or "cold-start" in wanted):
        print("cold start: fresh processes, no Ray connected (reference, lance_ray default)",
              flush=True)
        cold = measure_cold(str(db), TABLE_NAMES["small"], ["reference", "default"],
                            args.cold_trials)
    analysis = analyse(results, cold)
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
    lines: list[str] = []
    if any(c.transform for c in configs):
        lines, analysis["transform_targets"] = transform_report(results)
        notes.append("transforms: " + " / ".join(
            f"{name} {t['rows']:,} rows" for name, t in tables.items()
            if t and name not in TABLE_NAMES) + "; the CPU-only nodes of the "
            "scaling rows are simulated on this machine's cores (ray.cluster_utils), so they "
            "show placement, not added hardware")
    print_report(results, analysis, args, notes)
    if lines:
        print("\n" + "\n".join(lines))
    meta = {"rows": args.rows, "big_rows": args.big_rows, "repeats": args.repeats, "dim": DIM,
            "batch_size": BATCH, "num_splits": SPLITS, "clump": CLUMP, "seed": SEED,
            "take_rows": TAKE_ROWS, "max_seconds": args.max_seconds,
            "big_seconds": args.big_seconds, "tables": tables,
            "pack": {"docs": args.pack_docs, "mean_len": PACK_MEAN_LEN, "block_len": PACK_LEN,
                     "batch_blocks": PACK_BATCH},
            "git": git_state(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "total_s": total,
            "started": time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - total))}
    (out / "bench.json").write_text(json.dumps(
        {"meta": meta, "results": results, **analysis, "notes": notes}, indent=1))
    if any(r["config"]["table"] == "small" and "error" not in r for r in results):
        chart(results, out / "bench.png",
              f"lance_ray vs lancedb.streaming vs Lance's limits\n{args.rows:,} rows, dim {DIM}, "
              f"batch {BATCH}, {SPLITS} splits, {os.cpu_count()} CPUs")
    print(f"\nwrote {out / 'bench.json'} and {out / 'bench.png'} in {total:.0f}s")
    if args.json_out:
        files = exported(results, analysis, args, command_line(sys.argv[1:]), args.machine)
        for path in write_results(args.json_out, files):
            print(f"wrote {path}")


def command_line(argv: list[str]) -> str:
    """The command that regenerates a run, without where it writes or the machine's name."""
    kept, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in ("--out", "--json-out", "--machine"):
            skip = True
        elif not a.startswith(("--out=", "--json-out=", "--machine=")):
            kept.append(a)
    return shlex.join(["python", "-m", "jobs.bench", *kept])

