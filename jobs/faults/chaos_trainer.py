"""Chaos in real TorchTrainer runs: ``python -m jobs.faults.chaos --trainer --trials 20``.

This process owns one ``ray.cluster_utils.Cluster`` (a head with 2 train slots) and is the
only one that adds or removes its nodes (``Cluster`` must be driven from the main thread).
Each trial runs ``jobs/train.py`` as its own driver process on that cluster, elastic over
2..4 workers with a short resize monitor interval, and injects one fault once the run's
sample logs reach a random step:

* ``sigkill``: SIGKILL one train worker process;
* ``node``: the run starts on 4 workers over two nodes; the second node is removed;
* ``coordinator``: kill the coordinator actor (Ray restarts it from its persisted ledger);
* ``report``: SIGKILL a worker right after it logged a checkpoint step, inside
  ``lance_ray.train.report``;
* ``resize``: add a node, so the group grows 2 -> 4, and SIGKILL a worker of the new group
  as it starts;
* ``elastic``: no kill: add a node (2 -> 4), and remove it once the grown group has
  committed a checkpoint (4 -> 2).

Each trial is proven from its per-step sample logs (``jobs/verify.py``): the steps the
final model descends from hold every sample exactly once, with the same samples per global
step as an uninterrupted run, and every restart resumed from the newest checkpoint that was
committed before it (none lost).
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import ray

from jobs import verify as verify_job
from lance_ray.driver.handle import Coordinator
from lance_ray.proof.audit import AttemptLog, read_attempt_logs
from lance_ray.proof.verify import CoverageReport

logger = logging.getLogger("chaos")
REPO = Path(__file__).resolve().parents[2]
KINDS = ("sigkill", "node", "coordinator", "report", "resize", "elastic")
RESIZING = ("node", "resize", "elastic")  # kinds whose run changes world size mid-epoch
NODE = {"num_cpus": 1, "resources": {"slot": 2}}
T = TypeVar("T")


@dataclass(frozen=True)
class RunShape:
    """The training run every trial repeats."""

    rows: int = 2880
    global_batch: int = 48
    num_splits: int = 12  # every world size in 2..4 divides it
    checkpoint_every: int = 5
    step_delay_s: float = 0.25
    # Runs that must resize mid-epoch step slower: Ray Train takes 10-30 s to notice a
    # node here, and a group restart takes about a minute on this 2-core machine.
    resize_step_delay_s: float = 0.5
    resize_interval_s: float = 5.0
    # After a node dies, Ray Train's controller still sees its resources for a moment and
    # starts a group of the old size, which can only fail by Ray Train's group start
    # timeout (60 s by default, RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S) before it shrinks.
    # Groups of 2-4 start in 8-15 s here: 30 s keeps a 2x margin and saves 30 s per node
    # loss.
    group_start_timeout_s: float = 30.0
    timeout_s: float = 1800.0  # per trial: a resize trial took 870 s on the loaded 2-core box

    @property
    def steps(self) -> int:
        return self.rows // self.global_batch

    def step_delay(self, kind: str) -> float:
        return self.resize_step_delay_s if kind in RESIZING else self.step_delay_s


@dataclass
class TrainerTrial:
    """One run with one fault, and what its logs prove."""

    trial: int
    kind: str
    step: int
    detail: str = ""
    exit_code: int | None = None
    launched: float = 0.0
    events: list[tuple[str, float]] = field(default_factory=list)  # (what, when)
    attempts: list[AttemptLog] = field(default_factory=list)
    report: CoverageReport | None = None
    lost_checkpoints: int = 0
    error: str = ""

    @property
    def restarts(self) -> int:
        return max(len(self.attempts) - 1, 0)

    @property
    def ok(self) -> bool:
        r = self.report
        return (not self.error and self.exit_code == 0 and r is not None and r.exactly_once
                and r.steps_identical and r.after == r.planned and not self.lost_checkpoints)

    def summary(self) -> dict[str, Any]:
        r = self.report
        return {"trial": self.trial, "kind": self.kind, "step": self.step, "ok": self.ok,
                "restarts": self.restarts, "world_sizes": world_sizes(self.attempts),
                "duplicates": r.duplicates if r else None, "lost": r.lost if r else None,
                "steps_identical": bool(r and r.steps_identical),
                "lost_checkpoints": self.lost_checkpoints, "error": self.error,
                "detail": self.detail, "launched": self.launched, "events": self.events,
                "steps_per_attempt": [len(a.steps) for a in self.attempts],
                "resumed_from": [a.attempt.resumed_from_step for a in self.attempts]}


def world_sizes(attempts: list[AttemptLog]) -> str:
    return "->".join(str(a.attempt.world_size) for a in attempts)


class TrialRunner:
    """Runs trials on ``cluster`` (connected, head only between trials)."""

    def __init__(self, cluster: Any, work: Path, db: Path, shape: RunShape):
        self.cluster, self.work, self.db, self.shape = cluster, work, db, shape

    # ------------------------------------------------------------ the run

    def launch(self, name: str, kind: str) -> subprocess.Popen:
        s = self.shape
        cmd = [sys.executable, "-m", "jobs.train", "--address", self.cluster.address,
               "--db", str(self.db), "--table", "demo", "--name", name,
               "--storage-path", str(self.work / "storage"), "--min-workers", "2",
               "--workers", "4", "--resize-interval", str(s.resize_interval_s),
               "--step-delay", str(s.step_delay(kind)), "--num-splits", str(s.num_splits),
               "--global-batch", str(s.global_batch),
               "--checkpoint-every", str(s.checkpoint_every), "--max-failures", "10"]
        out = open(self.work / f"{name}.log", "w")  # noqa: SIM115 (the child owns it)
        env = {**os.environ, "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(
            s.group_start_timeout_s)}  # the driver passes it on to the controller
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env=env)

    def wait(self, proc: subprocess.Popen, what: str, until: Callable[[], T | None],
             deadline: float) -> T:
        """Poll ``until`` (every 50 ms) while the run is alive and within its time."""
        while time.monotonic() < deadline:
            got = until()
            if got:
                return got
            if proc.poll() is not None:
                raise RuntimeError(f"the run ended (exit {proc.returncode}) before {what}")
            time.sleep(0.05)
        raise TimeoutError(f"timed out waiting for {what}")

    # ------------------------------------------------------------ what the logs say

    @staticmethod
    def latest(log_dir: Path) -> AttemptLog | None:
        try:
            logs = read_attempt_logs(log_dir)
        except (FileNotFoundError, json.JSONDecodeError):  # a line being written
            return None
        return logs[-1] if logs else None

    def at_step(self, log_dir: Path, step: int, *, world_size: int | None = None,
                checkpoint: bool = False) -> AttemptLog | None:
        """The latest attempt, once it logged a step >= ``step`` (a checkpoint step if
        ``checkpoint``) on ``world_size`` workers."""
        a = self.latest(log_dir)
        if a is None or not a.steps or (world_size and a.attempt.world_size != world_size):
            return None
        last = a.steps[-1].step
        if last < step or (checkpoint and last % self.shape.checkpoint_every):
            return None
        return a

    @staticmethod
    def workers(log_dir: Path, *, since: float = 0.0) -> list[dict]:
        """Train workers announced since ``since``, newest first."""
        found = []
        for f in (log_dir / "workers").glob("*.json"):
            try:
                found.append(json.loads(f.read_text()))
            except json.JSONDecodeError:  # being written
                continue
        return sorted((w for w in found if w["t"] >= since), key=lambda w: -w["t"])

    def current_worker(self, log_dir: Path, world_size: int) -> dict:
        """The highest rank of the newest group of ``world_size`` workers."""
        group = [w for w in self.workers(log_dir) if w["world_size"] == world_size][:world_size]
        return max(group, key=lambda w: w["rank"])

    # ------------------------------------------------------------ faults

    def sigkill(self, trial: TrainerTrial, worker: dict) -> None:
        os.kill(worker["pid"], signal.SIGKILL)
        trial.events.append(("fault", time.time()))
        trial.detail = f"rank {worker['rank']}/{worker['world_size']}"

    def add_node(self, trial: TrainerTrial) -> None:
        self.cluster.add_node(**NODE)
        trial.events.append(("node added", time.time()))

    def remove_nodes(self, trial: TrainerTrial | None = None) -> None:
        for node in list(self.cluster.worker_nodes):
            self.cluster.remove_node(node)
            if trial is not None:
                trial.events.append(("node removed", time.time()))

    def inject(self, trial: TrainerTrial, proc: subprocess.Popen, log_dir: Path,
               deadline: float) -> None:
        kind, k = trial.kind, trial.step
        if kind in ("sigkill", "node", "coordinator"):
            a = self.wait(proc, f"step {k}", lambda: self.at_step(log_dir, k), deadline)
            if kind == "sigkill":
                self.sigkill(trial, self.current_worker(log_dir, a.attempt.world_size))
            elif kind == "node":
                self.remove_nodes(trial)
                trial.detail = f"node of {a.attempt.world_size} workers"
            else:
                ray.kill(Coordinator.get(f"trial{trial.trial}").handle, no_restart=False)
                trial.events.append(("fault", time.time()))
                trial.detail = "actor restarted"
        elif kind == "report":
            a = self.wait(proc, f"a checkpoint step >= {k}",
                          lambda: self.at_step(log_dir, k, checkpoint=True), deadline)
            trial.step = a.steps[-1].step
            self.sigkill(trial, self.current_worker(log_dir, a.attempt.world_size))
        elif kind in ("resize", "elastic"):
            self.wait(proc, f"step {k}", lambda: self.at_step(log_dir, k, world_size=2),
                      deadline)
            self.add_node(trial)
            added = trial.events[-1][1]
            if kind == "resize":  # a worker of the grown group, as it starts
                grown = self.wait(proc, "the grown group", lambda: [
                    w for w in self.workers(log_dir, since=added) if w["world_size"] == 4],
                    deadline)
                self.sigkill(trial, grown[0])
                trial.detail += " of the grown group, starting"
            else:  # shrink once the grown group committed a checkpoint
                self.wait(proc, "a checkpoint of the grown group", lambda: (
                    (a := self.latest(log_dir)) is not None and a.attempt.world_size == 4
                    and a.checkpoints), deadline)
                self.remove_nodes(trial)
                trial.detail = "grown 2->4, shrunk"

    # ------------------------------------------------------------ one trial

    def run(self, i: int, kind: str, step: int) -> TrainerTrial:
        name = f"trial{i}"
        trial = TrainerTrial(i, kind, step)
        run_dir = self.work / "storage" / name
        log_dir = run_dir / "samples"
        if kind == "node":  # start on two nodes, so there is a node to take away
            self.cluster.add_node(**NODE)
            self.cluster.wait_for_nodes()
        trial.launched = time.time()
        proc = self.launch(name, kind)
        deadline = time.monotonic() + self.shape.timeout_s
        try:
            self.inject(trial, proc, log_dir, deadline)
            trial.exit_code = proc.wait(timeout=max(deadline - time.monotonic(), 1))
        except Exception as e:  # the trial failed; record it and go on with the next
            trial.error = f"{type(e).__name__}: {e}"
            if proc.poll() is None:
                proc.kill()
            proc.wait()
            trial.exit_code = proc.returncode
        finally:
            self.remove_nodes()
        try:
            trial.report, _ = verify_job.verify_run(run_dir)
            trial.attempts = read_attempt_logs(log_dir)
            trial.lost_checkpoints = lost_checkpoints(trial.attempts)
        except Exception as e:  # noqa: BLE001 - a run that left no provable log
            trial.error = trial.error or f"verify: {type(e).__name__}: {e}"
        if kind == "report" and trial.attempts and trial.detail:
            trial.detail += " " + in_report(trial, log_dir)
        return trial


def lost_checkpoints(attempts: list[AttemptLog]) -> int:
    """Restarts that resumed from an older step than the newest checkpoint committed
    (in the lineage the restart continues) before the restart began."""
    lost, committed = 0, 0
    for a in attempts:
        if a.attempt.resumed_from_step < committed:
            lost += 1
        committed = a.attempt.resumed_from_step
        for step, _ in a.checkpoints:
            committed = max(committed, step)
    return lost


def in_report(trial: TrainerTrial, log_dir: Path) -> str:
    """Whether the killed rank died inside ``report`` of the step it was killed at: it had
    logged that step, and the step's checkpoint was not committed before the kill."""
    fault_t = next(t for what, t in trial.events if what == "fault")
    first = trial.attempts[0]
    committed = [t for s, t in first.checkpoints if s == trial.step]
    rank = trial.detail.split()[1].split("/")[0]
    rank_file = log_dir / first.attempt.attempt / f"rank{rank}.jsonl"
    logged = any(json.loads(line)["step"] == trial.step
                 for line in rank_file.read_text().splitlines() if line.strip())
    inside = logged and not any(t < fault_t for t in committed)
    return "(inside report)" if inside else "(not inside report)"


def pick_steps(rng: random.Random, kinds: tuple[str, ...], trials: int,
               shape: RunShape) -> list[tuple[str, int]]:
    """Kinds take turns; kill steps are random, early enough for the run to react (a
    resize needs a monitor interval and a group restart before the epoch ends)."""
    out = []
    for i in range(trials):
        kind = kinds[i % len(kinds)]
        hi = 8 if kind in RESIZING else shape.steps - 6
        out.append((kind, rng.randint(3, hi)))
    return out
