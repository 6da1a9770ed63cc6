"""Sample audit logs: which sample ids each rank trained on at each global step.

A training attempt (one start of the worker group) writes ``attempt.json`` (which step it
resumed from), one JSON-lines file per rank, and the steps whose checkpoint it committed,
and when (``checkpoints.jsonl``). :func:`lineage` rebuilds the steps that the
final model descends from: an attempt that resumed from step ``c`` replaces everything the
earlier attempts logged after ``c`` (those steps died with the crashed attempt). The logs
live under a local path or a URI (``s3://...``), through :mod:`lance_ray.storage`.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
from dataclasses import dataclass
from typing import IO, Any

from .. import storage
from ..storage import StorageOptionsFactory

logger = logging.getLogger(__name__)

CHECKPOINTS_FILE = "checkpoints.jsonl"


@dataclass(frozen=True)
class Attempt:
    """One start of the worker group. ``view_s``: how long rank 0 took to build its view
    (the data path's share of a start, before the first read). ``model_step``: the step
    the restored model was saved at, as the trainer recorded it with the model (0: a new
    model; None: not recorded); the data must have resumed from the same step."""

    attempt: str
    resumed_from_step: int
    world_size: int
    started: float
    view_s: float = 0.0
    model_step: int | None = None


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
    """Append-only log of one rank's samples per global step in one attempt.

    ``root`` is a local path or a URI. Locally each step is one appended line; on an object
    store (no appends) every ``flush_every`` steps become one new object
    ``rank<r>.<part>.jsonl`` written in one PUT. Call :meth:`flush` before reporting a
    checkpoint if ``flush_every > 1``: a restore must find every step up to it.
    """

    def __init__(self, root: str | os.PathLike[str], attempt: Attempt, rank: int, *,
                 storage_options: StorageOptionsFactory | None = None, flush_every: int = 1):
        self.dir = storage.join(root, attempt.attempt)
        self._rank, self._flush_every, self._parts = rank, max(1, flush_every), 0
        self._options = storage_options
        self._pending: list[str] = []
        if rank == 0:
            storage.write_json_atomic(storage.join(self.dir, "attempt.json"),
                                      attempt.__dict__, storage_options=storage_options)
        self._file: IO[str] | None = None
        if not storage.is_remote(root):
            _, local = storage.resolve(self.dir)
            os.makedirs(local, exist_ok=True)
            self._file = open(os.path.join(local, f"rank{rank}.jsonl"), "a")  # noqa: SIM115

    def write(self, step: int, ids: list[Any], *, wait_s: float = 0.0) -> None:
        """Log the samples trained on at ``step`` (their ids: any JSON values, such as a
        mixture's ``[source, id]`` pairs), when, and how long data took."""
        record = {"step": step, "ids": ids, "t": time.time(), "wait_s": round(wait_s, 6)}
        line = json.dumps(record) + "\n"
        if self._file is not None:
            self._file.write(line)
            self._file.flush()
            return
        self._pending.append(line)
        if len(self._pending) >= self._flush_every:
            self.flush()

    def flush(self) -> None:
        """Make every logged step durable (one object on an object store)."""
        if self._file is not None or not self._pending:
            return
        name = f"rank{self._rank}.{self._parts:08d}.jsonl"
        storage.write_bytes_atomic(storage.join(self.dir, name),
                                   "".join(self._pending).encode("utf-8"),
                                   storage_options=self._options)
        self._parts += 1
        self._pending.clear()

    def checkpoint(self, step: int) -> None:
        """Log that the checkpoint of ``step`` is committed (call it on one rank)."""
        line = json.dumps({"step": step, "t": time.time()}) + "\n"
        if self._file is not None:
            with open(os.path.join(storage.resolve(self.dir)[1], CHECKPOINTS_FILE), "a") as f:
                f.write(line)
            return
        # No appends on an object store: one small object per checkpoint.
        storage.write_bytes_atomic(storage.join(self.dir, f"checkpoints.{step:012d}.jsonl"),
                                   line.encode("utf-8"), storage_options=self._options)

    def close(self) -> None:
        self.flush()
        if self._file is not None:
            self._file.close()


_LOG_RE = re.compile(r"^rank(\d+)(?:\.(\d+))?\.jsonl$")
_CHECKPOINTS_RE = re.compile(r"^checkpoints(?:\.\d+)?\.jsonl$")


def _attempt_dirs(root: str | os.PathLike[str],
                  storage_options: StorageOptionsFactory | None) -> list[str]:
    return [d for d in storage.list_dirs(root, storage_options=storage_options)
            if storage.exists(storage.join(d, "attempt.json"), storage_options=storage_options)]


def read_jsonl(path: str, storage_options: StorageOptionsFactory | None) -> list[dict[str, Any]]:
    """The records of a JSON-lines log. A last line cut short (no newline: its writer died
    mid-append) is dropped: its step never reached a checkpoint, and a lineage that needs
    it says so. Any other line that does not parse is an error naming the file."""
    text = storage.read_bytes(path, storage_options=storage_options).decode("utf-8")
    lines = text.split("\n")
    out = []
    for k, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            if k == len(lines) - 1:  # after the last newline: a torn append
                logger.warning("%s: dropped its last line, cut short: %.60r", path, line)
                continue
            raise ValueError(f"{path}: line {k + 1} is not JSON ({e}); the sample log is "
                             "damaged, not just cut short") from e
    return out


def _records(attempt_dir: str,
             storage_options: StorageOptionsFactory | None) -> list[dict[str, Any]]:
    """Every logged step record of one attempt, rank by rank, parts in order."""
    logs = []
    for path in storage.list_files(attempt_dir, storage_options=storage_options):
        m = _LOG_RE.match(storage.basename(path))
        if m:
            logs.append((int(m.group(1)), int(m.group(2) or -1), path))
    return [rec for _, _, path in sorted(logs) for rec in read_jsonl(path, storage_options)]


def _checkpoints(attempt_dir: str,
                 storage_options: StorageOptionsFactory | None) -> list[tuple[int, float]]:
    paths = sorted(p for p in storage.list_files(attempt_dir, storage_options=storage_options)
                   if _CHECKPOINTS_RE.match(storage.basename(p)))
    return [(c["step"], c["t"]) for p in paths for c in read_jsonl(p, storage_options)]


def _attempts(root: str | os.PathLike[str],
              storage_options: StorageOptionsFactory | None) -> list[tuple[Attempt, str]]:
    """Every attempt under ``root`` with its directory, in start order."""
    out = [(Attempt(**storage.read_json(storage.join(d, "attempt.json"),
                                        storage_options=storage_options)), d)
           for d in _attempt_dirs(root, storage_options)]
    out.sort(key=lambda a: a[0].started)
    return out


def _steps(attempt_dir: str,
           storage_options: StorageOptionsFactory | None) -> dict[int, list[Any]]:
    steps: dict[int, list[Any]] = {}
    for rec in _records(attempt_dir, storage_options):
        steps.setdefault(rec["step"], []).extend(rec["ids"])
    return steps


def read_attempts(root: str | os.PathLike[str], *,
                  storage_options: StorageOptionsFactory | None = None
                  ) -> list[tuple[Attempt, dict[int, list[Any]]]]:
    """Every attempt under ``root`` in start order, with its steps (ranks concatenated)."""
    return [(a, _steps(d, storage_options)) for a, d in _attempts(root, storage_options)]


def read_attempt_logs(root: str | os.PathLike[str], *,
                      storage_options: StorageOptionsFactory | None = None
                      ) -> list[AttemptLog]:
    """Every attempt under ``root`` in start order, with per-step times and checkpoints."""
    out = []
    for attempt, d in _attempts(root, storage_options):
        per_step: dict[int, list[dict]] = {}
        for rec in _records(d, storage_options):
            per_step.setdefault(rec["step"], []).append(rec)
        steps = [StepRecord(s, max(r.get("t", 0.0) for r in recs),
                            sum(len(r["ids"]) for r in recs),
                            max(r.get("wait_s", 0.0) for r in recs))
                 for s, recs in sorted(per_step.items())]
        out.append(AttemptLog(attempt, steps, _checkpoints(d, storage_options)))
    return out


def lineage(root: str | os.PathLike[str], *,
            storage_options: StorageOptionsFactory | None = None,
            committed_only: bool = False) -> list[list[Any]]:
    """The global steps (1-based, in order) that the final model descends from.

    ``committed_only``: end at the last attempt's last committed checkpoint (or, if it
    committed none, at the step it resumed from): steps it trained after that died with it,
    as the saved model never saw them (a job whose last checkpoint failed to commit)."""
    attempts = _attempts(root, storage_options)
    effective = _descended(attempts, storage_options)
    if committed_only and attempts:
        last, d = attempts[-1]
        saved = max([s for s, _ in _checkpoints(d, storage_options)],
                    default=last.resumed_from_step)
        if any(s > saved for s in effective):
            logger.warning("steps after %d have no committed checkpoint: left out", saved)
        effective = {s: ids for s, ids in effective.items() if s <= saved}
    missing = [s for s in range(1, len(effective) + 1) if s not in effective]
    if missing:
        raise ValueError(f"the sample log has no record of global steps {missing[:10]}")
    return [effective[s] for s in sorted(effective)]


def logged_steps(root: str | os.PathLike[str], *,
                 storage_options: StorageOptionsFactory | None = None) -> int:
    """How many global steps the attempts logged, saved or not (the last attempt's steps
    after its last checkpoint included)."""
    return len(_descended(_attempts(root, storage_options), storage_options))


def _descended(attempts: list[tuple[Attempt, str]],
               storage_options: StorageOptionsFactory | None) -> dict[int, list[Any]]:
    """Each logged step's samples, an attempt that resumed from step ``c`` replacing what
    the earlier ones logged after ``c``. Raises where the log shows that what an attempt
    trained does not follow from its restored checkpoint: its model saved at another step
    than its data resumed from, or a step at or before the resume logged again."""
    effective: dict[int, list[Any]] = {}
    for attempt, d in attempts:
        resumed = attempt.resumed_from_step
        if attempt.model_step is not None and attempt.model_step != resumed:
            raise ValueError(
                f"attempt {attempt.attempt} resumed its data from global step {resumed} but "
                f"its model from step {attempt.model_step}: the steps between were trained "
                "twice or never reached the model")
        steps = _steps(d, storage_options)
        again = sorted(s for s in steps if s <= resumed)
        if again:
            raise ValueError(f"attempt {attempt.attempt} resumed from global step {resumed} "
                             f"but trained steps {again[:10]} again")
        effective = {s: ids for s, ids in effective.items() if s <= resumed}
        effective.update(steps)
    return effective
