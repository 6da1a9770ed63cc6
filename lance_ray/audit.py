"""Sample audit logs: which sample ids each rank trained on at each global step.

A training attempt (one start of the worker group) writes ``attempt.json`` (which step it
resumed from) and one JSON-lines file per rank. :func:`lineage` rebuilds the steps that the
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

from .jsonio import read_json, write_json_atomic


@dataclass(frozen=True)
class Attempt:
    """One start of the worker group."""

    attempt: str
    resumed_from_step: int
    world_size: int
    started: float


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

    def close(self) -> None:
        self._file.close()


def read_attempts(root: str | Path) -> list[tuple[Attempt, dict[int, list[int]]]]:
    """Every attempt under ``root`` in start order, with its steps (ranks concatenated)."""
    out = []
    for d in sorted(p for p in Path(root).iterdir() if (p / "attempt.json").exists()):
        attempt = Attempt(**read_json(d / "attempt.json"))
        steps: dict[int, list[int]] = {}
        for rank_file in sorted(d.glob("rank*.jsonl"), key=lambda p: int(p.stem[4:])):
            for line in rank_file.read_text().splitlines():
                if line.strip():
                    rec = json.loads(line)
                    steps.setdefault(rec["step"], []).extend(rec["ids"])
        out.append((attempt, steps))
    out.sort(key=lambda a: a[0].started)
    return out


def timeline(root: str | Path) -> list[tuple[float, int, float]]:
    """``(time, samples, max data wait over ranks)`` of every logged step of every attempt."""
    out = []
    for d in sorted(p for p in Path(root).iterdir() if (p / "attempt.json").exists()):
        per_step: dict[int, list[dict]] = {}
        for rank_file in d.glob("rank*.jsonl"):
            for line in rank_file.read_text().splitlines():
                if line.strip():
                    rec = json.loads(line)
                    per_step.setdefault(rec["step"], []).append(rec)
        for recs in per_step.values():
            out.append((max(r.get("t", 0.0) for r in recs), sum(len(r["ids"]) for r in recs),
                        max(r.get("wait_s", 0.0) for r in recs)))
    return sorted(out)


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
