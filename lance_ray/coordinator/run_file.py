"""Which run a coordinator's ledger belongs to: where it is kept, and what a ledger found
there (or a live actor) must match before a coordinator takes it as its own.

A ledger names its table, plan and packing, and the commit that made the pinned version
(Lance's transaction uuid): a table dropped and created again reaches the same version
number with other rows, and a run must never resume that table's steps from the old one's
progress.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from .. import storage
from ..plan.pack_args import PackOptions
from ..plan.splits import PlanSpec
from ..plan.table import TableRef

COMMIT_KEY = "table_commit"


def ledger_path(storage_path: str, name: str) -> str:
    """Where coordinator ``name`` keeps its ledger under ``storage_path``."""
    return storage.join(storage.join(storage_path, name), "coordinator.json")


def run_config(table: TableRef, spec: PlanSpec, packing: PackOptions | None,
               commit: str | None = None) -> dict[str, Any]:
    """What a run's ledger must have been written for: the table (and the ``commit`` of
    its version, when known), the plan (any epoch) and the packing."""
    return {"uri": table.uri, "spec": {**spec.config(), "epoch": 0},
            **({} if packing is None else {"packing": asdict(packing)}),
            **({} if commit is None else {COMMIT_KEY: commit})}


def run_identity(table: TableRef, spec: PlanSpec, packing: PackOptions | None,
                 commit: str | None = None) -> dict[str, Any]:
    """:func:`run_config` and the pinned version: a live coordinator serves a ``create``
    only if both match (its storage path may differ: a job's relative paths move with the
    copy of its working directory)."""
    return {**run_config(table, spec, packing, commit), "table_version": table.version}


def check_saved_config(saved: dict[str, Any], config: dict[str, Any], path: str,
                       name: str) -> None:
    """Raise unless the ledger ``saved`` at ``path`` is coordinator ``name``'s of the run
    ``config``. Where either commit is unknown (a ledger written before commits were
    recorded; a table whose commit cannot be read now) the rest must match."""
    differ = same_run(saved, config)
    if not differ:
        return
    if set(differ) == {COMMIT_KEY}:
        raise ValueError(
            f"{path} holds coordinator {name!r} of another table at the same version (the "
            f"table was dropped and created again since: commit {differ[COMMIT_KEY][0]!r}, "
            f"now {differ[COMMIT_KEY][1]!r}); its progress is not this table's: use another "
            "coordinator name or storage_path")
    seed = drawn_seed(differ)
    if seed is not None:
        raise ValueError(f"{path} holds coordinator {name!r} of the same table and plan with "
                         f"shuffle_seed={seed}: pass shuffle_seed={seed} to resume that run "
                         "(shuffle_seed=None draws a new seed at every create), or use "
                         "another coordinator name or storage_path for a new run")
    raise ValueError(f"{path} holds coordinator {name!r} of a different table or plan; use "
                     "another coordinator name or storage_path")


def same_run(live: dict[str, Any], asked: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """How a live coordinator's identity differs from what a ``create`` asks for (a side
    whose commit is unknown does not compare commits)."""
    keys = live.keys() | asked.keys()
    if COMMIT_KEY not in live or COMMIT_KEY not in asked:
        keys -= {COMMIT_KEY}
    return {k: (live.get(k), asked.get(k)) for k in keys if live.get(k) != asked.get(k)}


def drawn_seed(differ: dict[str, tuple[Any, Any]]) -> int | None:
    """The first side's ``shuffle_seed`` where the runs ``differ`` (:func:`same_run`'s)
    only in it: a run created with ``shuffle_seed=None``, resumed by passing its seed."""
    if set(differ) != {"spec"}:
        return None
    theirs, ours = differ["spec"]
    seedless = {"shuffle_seed": None}
    return theirs["shuffle_seed"] if {**theirs, **seedless} == {**ours, **seedless} else None
