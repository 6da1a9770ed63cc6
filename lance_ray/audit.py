"""Sample audit logs: which sample ids each rank trained on at each global step.

A training attempt (one start of the worker group) writes ``attempt.json`` (which step it
resumed from), one JSON-lines file per rank, and ``checkpoints.jsonl`` (the steps whose
checkpoint it committed, and when). :func:`lineage` rebuilds the steps that the
final model descends from: an attempt that resumed from step ``c`` replaces everything the
earlier attempts logged after ``c`` (those steps died with the crashed attempt).
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from .state import read_json, write_json_atomic

CHECKPOINTS_FILE = "checkpoints.jsonl"


@dataclass(frozen=True)
class Attempt:
    """One start of the worker group. ``view_s``: how long rank 0 took to build its view
    (the data path's share of a start, before the first read)."""

    attempt: str
    resumed_from_step: int
    world_size: int
    started: float
    view_s: float = 0.0


@dataclass(frozen=True)
class StepRecord:
    """One global step of an attempt, over all its ranks."""

    step: int
    t: float  # when the last rank logged it
    samples: int
    wait_s: float  # the slowest rank's data wait for its batch


@dataclass(frozen=True)
class AttemptLog:
    """An attempt's steps (in step order) and the checkpoints it committed ``(step, t)``."""

    attempt: Attempt
    steps: list[StepRecord]
    checkpoints: list[tuple[int, float]]


def new_attempt_id() -> str:
    return f"{time.time_ns():020d}-{uuid.uuid4().hex[:8]}"


class SampleLog:
    """Append-only log of one rank's samples per global step in one attempt."""

    def __init__(self, root: str | Path, attempt: Attempt, rank: int):
        self.dir = Path(root) / attempt.attempt
        self.dir.mkdir(parents=True, exist_ok=True)
        if rank == 0:
            write_json_atomic(self.dir / "attempt.json", attempt.__dict__)
        self._file: IO[str] = open(self.dir / f"rank{rank}.jsonl", "a")  # noqa: SIM115

    def write(self, step: int, ids: list[int], *, wait_s: float = 0.0) -> None:
        """Log the sample ids trained on at ``step``, when, and how long data took."""
        record = {"step": step, "ids": ids, "t": time.time(), "wait_s": round(wait_s, 6)}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def checkpoint(self, step: int) -> None:
        """Log that the checkpoint of ``step`` is committed (call it on one rank)."""
        with open(self.dir / CHECKPOINTS_FILE, "a") as f:
            f.write(json.dumps({"step": step, "t": time.time()}) + "\n")

    def close(self) -> None:
        self._file.close()


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _attempt_dirs(root: str | Path) -> list[tuple[Attempt, Path]]:
    """Every attempt under ``root`` in start order."""
    found = [(Attempt(**read_json(d / "attempt.json")), d)
             for d in Path(root).iterdir() if (d / "attempt.json").exists()]
    return sorted(found, key=lambda a: a[0].started)


def _rank_records(d: Path) -> list[list[dict]]:
    files = sorted(d.glob("rank*.jsonl"), key=lambda p: int(p.stem[4:]))
    return [_jsonl(f) for f in files]


def read_attempts(root: str | Path) -> list[tuple[Attempt, dict[int, list[int]]]]:
    """Every attempt under ``root`` in start order, with its steps (ranks concatenated)."""
    out = []
    for attempt, d in _attempt_dirs(root):
        steps: dict[int, list[int]] = {}
        for records in _rank_records(d):
            for rec in records:
                steps.setdefault(rec["step"], []).extend(rec["ids"])
        out.append((attempt, steps))
    return out


def read_attempt_logs(root: str | Path) -> list[AttemptLog]:
    """Every attempt under ``root`` in start order, with per-step times and checkpoints."""
    out = []
    for attempt, d in _attempt_dirs(root):
        per_step: dict[int, list[dict]] = {}
        for records in _rank_records(d):
            for rec in records:
                per_step.setdefault(rec["step"], []).append(rec)
        steps = [StepRecord(s, max(r.get("t", 0.0) for r in recs),
                            sum(len(r["ids"]) for r in recs),
                            max(r.get("wait_s", 0.0) for r in recs))
                 for s, recs in sorted(per_step.items())]
        ckpt_file = d / CHECKPOINTS_FILE
        checkpoints = ([(c["step"], c["t"]) for c in _jsonl(ckpt_file)]
                       if ckpt_file.exists() else [])
        out.append(AttemptLog(attempt, steps, checkpoints))
    return out


def lineage(root: str | Path) -> list[list[int]]:
    """The global steps (1-based, in order) that the final model descends from."""
    effective: dict[int, list[int]] = {}
    for attempt, steps in read_attempts(root):
        effective = {s: ids for s, ids in effective.items() if s <= attempt.resumed_from_step}
        effective.update(steps)
    missing = [s for s in range(1, len(effective) + 1) if s not in effective]
    if missing:
        raise ValueError(f"the sample log has no record of global steps {missing[:10]}")
    return [effective[s] for s in sorted(effective)]
