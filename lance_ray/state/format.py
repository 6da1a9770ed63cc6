"""Checkpoint state: the plain-data format, its validation, and the merge of rank states.

A state is a JSON-serialisable dict. Its top-level keys are exactly those of
``lancedb.streaming.StreamingDataset.state_dict()`` (so either library loads the other's
states); what makes it self-describing lives under the extra key ``"lance_ray"``, which the
reference ignores. Everything here is pure: no Ray, no torch, no I/O except the explicit
JSON file helpers.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from ..checks import is_int
from ..topology import Topology, rank_splits

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
# No plan has more splits than this; a larger count in a state is corruption, and refusing it
# early keeps a bad state from allocating huge lists.
MAX_NUM_SPLITS = 1 << 24
EXTRA_KEY = "lance_ray"
MIX_KEY = "lance_ray_mixture"  # a MixtureDataset's state (see lance_ray.state.mixture)
PLAN_KEYS = ("shuffle_seed", "num_splits", "epoch")  # the top-level keys that name a plan
REFERENCE_KEYS = (*PLAN_KEYS, "samples_consumed_per_split")
# The identity keys under EXTRA_KEY a state must agree on with a plan, and how to fix each.
IDENTITY_FIXES = {
    "table_version": "open the table at the checkpoint's version (table_version=...)",
    "shuffle": "construct the dataset with the checkpoint's shuffle setting",
    "filter": "construct the dataset with the checkpoint's filter",
    "shuffle_clump_size": "construct the dataset with the checkpoint's shuffle_clump_size",
    "split_len": "the table or filter changed since the checkpoint",
    "plan_fingerprint": "the table's rows at this version differ from the checkpoint's",
}


@dataclass(frozen=True)
class PlanIdentity:
    """What a state must agree with before it may be applied to a plan."""

    num_splits: int
    shuffle_seed: int
    epoch: int
    split_len: int
    table_version: int
    plan_fingerprint: str
    shuffle: bool
    filter: str | None
    shuffle_clump_size: int | None
    plan: str = "lancedb"  # the plan mode; states record it only when it is not the default
    # The commit that made the table version (plan.table.table_commit): a table dropped and
    # re-created reaches the same version number with other rows. None: not known.
    table_commit: str | None = None



@dataclass(frozen=True)
class Progress:
    """Validated per-split progress plus who produced it."""

    samples: tuple[int, ...]
    positions: tuple[int, ...]
    world_size: int | None = None  # None: unknown (reference-format state)
    rank: int | None = None  # None: a merged state that covers every split
    global_step: int | None = None
    # A rank's state whose other splits follow from its own (every rank delivered as many
    # samples); it names no rank, as every rank of the run writes the same one.
    lockstep: bool = False

    @property
    def is_complete(self) -> bool:
        """True when every split's entry is exact (merged, or a 1-rank state)."""
        return self.rank is None or self.world_size == 1

    @property
    def loadable_anywhere(self) -> bool:
        """True when any rank of any valid world size may resume from this state alone."""
        return self.is_complete or self.lockstep

    @property
    def exact_everywhere(self) -> bool:
        """Whether every split's entry is exact, so that a view may derive any rank's
        progress from it (a lockstep origin). A reference-format state does not say: one
        rank's holds only lower bounds for the other ranks' splits. It counts only at one
        count on every split with nothing skipped, where ranks in lockstep all are."""
        if self.world_size is None:
            return len(set(self.samples)) <= 1 and self.samples == self.positions
        return self.loadable_anywhere


def make_state(
    identity: PlanIdentity,
    samples: list[int],
    positions: list[int],
    *,
    world_size: int,
    rank: int | None,
    global_step: int | None,
    lockstep: bool = False,
) -> dict[str, Any]:
    """Build a state dict. ``rank=None`` marks a merged state covering every split."""
    extra = {
        "format_version": FORMAT_VERSION,
        "table_version": identity.table_version,
        "plan_fingerprint": identity.plan_fingerprint,
        "split_len": identity.split_len,
        "shuffle": identity.shuffle,
        "filter": identity.filter,
        "shuffle_clump_size": identity.shuffle_clump_size,
        "world_size": world_size,
        "rank": rank,
        "owned_splits": (
            None if rank is None else rank_splits(rank, world_size, identity.num_splits)
        ),
        "global_step": global_step,
    }
    if lockstep:  # only when set, so lockstep-free states stay exactly format version 1
        extra["lockstep"] = True
    if identity.plan != "lancedb":  # lancedb-mode states keep the format unchanged
        extra["plan"] = identity.plan
    if identity.table_commit is not None:
        extra["table_commit"] = identity.table_commit
    return {
        "shuffle_seed": identity.shuffle_seed,
        "num_splits": identity.num_splits,
        "epoch": identity.epoch,
        "samples_consumed_per_split": [int(x) for x in samples],
        "positions_consumed_per_split": [int(x) for x in positions],
        EXTRA_KEY: extra,
    }


def _int_field(state: dict, key: str, *, minimum: int = 0) -> int:
    value = state[key]
    if not is_int(value) or value < minimum:
        raise ValueError(
            f"checkpoint field {key!r} must be an integer >= {minimum}, got {value!r}; "
            "pass the dict returned by state_dict() unchanged"
        )
    return value


def _counts(state: dict, key: str, num_splits: int, split_len: int | None) -> tuple[int, ...]:
    raw = state[key]
    if is_int(raw):
        # The reference's legacy format: one scalar counter shared by every split.
        logger.warning("checkpoint field %r is a legacy scalar; applying it to every split", key)
        raw = [raw] * num_splits
    if not isinstance(raw, list | tuple):
        raise ValueError(
            f"checkpoint field {key!r} must be a list of {num_splits} integers, got "
            f"{type(raw).__name__}; pass the dict returned by state_dict() unchanged"
        )
    if len(raw) != num_splits:
        raise ValueError(
            f"checkpoint field {key!r} has {len(raw)} entries but num_splits is {num_splits}; "
            "the state is truncated or belongs to another plan"
        )
    for k, v in enumerate(raw):
        if not is_int(v) or v < 0:
            raise ValueError(
                f"checkpoint field {key!r}[{k}] must be a non-negative integer, got {v!r}; "
                "the state is corrupt: restore an earlier checkpoint"
            )
        if split_len is not None and v > split_len:
            raise ValueError(
                f"checkpoint field {key!r}[{k}] is {v}, beyond the split length {split_len}; "
                "the state belongs to a different table, filter or num_splits"
            )
    return tuple(raw)


def refuse_mixture(state: dict[str, Any]) -> None:
    """Refuse a MixtureDataset's state where one table's is due, saying where it loads."""
    if MIX_KEY in state:
        raise ValueError("this is a MixtureDataset's state, not a single table's: load it into "
                         "a MixtureDataset (or the mixture's Coordinator) with the same "
                         "sources, weights and stop")


def parse_state(state: object, split_len: int | None = None, *, packed: bool = False
                ) -> Progress:
    """Validate the structure of ``state`` and return its progress.

    ``split_len`` bounds the counts when the plan is known (always, when loading).
    ``packed``: the caller validates a packed state's own fields (``state.packed``).
    """
    if not isinstance(state, dict):
        raise TypeError(f"a checkpoint state must be a dict, got {type(state).__name__}")
    refuse_mixture(state)
    if "pack_buffers" in state and not packed:
        raise ValueError(f"pack_sequences mismatch: checkpoint has "
                         f"{state.get('pack_sequences')!r}, dataset has None; this is a packed "
                         "state: load it into a dataset constructed with the same "
                         "pack_sequences, eos_id, pad_id and blocks_per_epoch")
    missing = [k for k in REFERENCE_KEYS if k not in state]
    if missing:
        raise ValueError(
            f"checkpoint is missing required field(s) {missing}; pass the dict returned "
            "by state_dict() (or merge_state_dicts()) unchanged"
        )
    num_splits = _int_field(state, "num_splits", minimum=1)
    if num_splits > MAX_NUM_SPLITS:
        raise ValueError(
            f"checkpoint field 'num_splits' is {num_splits}, more than any plan can have "
            f"({MAX_NUM_SPLITS}); the state is corrupt: restore an earlier checkpoint"
        )
    _int_field(state, "shuffle_seed")
    _int_field(state, "epoch")
    extra = state.get(EXTRA_KEY)
    if extra is not None and not isinstance(extra, dict):
        raise ValueError(f"checkpoint field {EXTRA_KEY!r} must be a dict, got {extra!r}")
    if extra:
        version = extra.get("format_version")
        if type(version) is not int or version != FORMAT_VERSION:
            raise ValueError(
                f"checkpoint format_version {version!r} is not supported (this lance_ray "
                f"reads version {FORMAT_VERSION}); upgrade lance_ray to load it"
            )
        if split_len is None:
            split_len = extra.get("split_len")
    samples = _counts(state, "samples_consumed_per_split", num_splits, split_len)
    if "positions_consumed_per_split" in state:
        positions = _counts(state, "positions_consumed_per_split", num_splits, split_len)
    else:
        positions = samples
    for k, (s, p) in enumerate(zip(samples, positions)):
        if p < s:
            raise ValueError(
                f"checkpoint positions_consumed_per_split[{k}] ({p}) is behind "
                f"samples_consumed_per_split[{k}] ({s}); a split cannot yield more samples "
                "than it read: the state is corrupt, restore an earlier checkpoint"
            )
    if not extra:
        return Progress(samples, positions)
    world_size, rank, step = extra.get("world_size"), extra.get("rank"), extra.get("global_step")
    if not is_int(world_size) or world_size < 1 or num_splits % world_size:
        raise ValueError(
            f"checkpoint world_size {world_size!r} is invalid for {num_splits} splits"
        )
    if rank is not None and (not is_int(rank) or not 0 <= rank < world_size):
        raise ValueError(f"checkpoint rank {rank!r} is not in [0, {world_size})")
    if step is not None and (not is_int(step) or step < 0):
        raise ValueError(f"checkpoint global_step {step!r} must be a non-negative integer")
    if not isinstance(lockstep := extra.get("lockstep", False), bool):
        raise ValueError(f"checkpoint lockstep {lockstep!r} must be true or false")
    return Progress(samples, positions, world_size, rank, step, lockstep)


def check_compatible(state: dict, identity: PlanIdentity) -> None:
    """Raise unless ``state`` was taken on the plan described by ``identity``."""
    for key in ("num_splits", "shuffle_seed", "epoch"):
        theirs, ours = state[key], getattr(identity, key)
        if theirs != ours:
            fix = (
                "call set_epoch() with the checkpoint's epoch before loading it"
                if key == "epoch"
                else f"construct the dataset with {key}={theirs}"
            )
            raise ValueError(f"{key} mismatch: checkpoint has {theirs}, dataset has {ours}; {fix}")
    extra = state.get(EXTRA_KEY)
    theirs = (extra or {}).get("plan", "lancedb")  # the modes order rows differently
    if theirs != identity.plan:
        raise ValueError(f"plan mode mismatch: checkpoint was taken with plan={theirs!r}"
                         f"{'' if extra else ' (it has no lance_ray identity)'}, dataset uses "
                         f"plan={identity.plan!r}; construct it with plan={theirs!r}")
    if not extra:
        logger.warning(
            "checkpoint has no lance_ray identity (a lancedb.streaming state?): its table "
            "version, filter and shuffle settings cannot be verified"
        )
        return
    for key, fix in IDENTITY_FIXES.items():
        theirs, ours = extra.get(key), getattr(identity, key)
        if theirs != ours:
            raise ValueError(
                f"{key} mismatch: checkpoint has {theirs!r}, dataset has {ours!r}; {fix}"
            )
    theirs, ours = extra.get("table_commit"), identity.table_commit
    if None not in (theirs, ours) and theirs != ours:  # a state without it is not checked
        raise ValueError(
            f"table_commit mismatch: checkpoint has {theirs!r}, dataset has {ours!r}: version "
            f"{identity.table_version} of this table was made by another commit than the "
            "checkpoint's (was the table dropped and created again?), so its rows are not "
            "the checkpoint's; resume on the table the checkpoint was taken on")


def check_loadable_on(progress: Progress, topology: Topology) -> None:
    """Raise unless one rank's view may resume from ``progress`` without a merge."""
    rank, world_size = topology.rank, topology.world_size
    if progress.loadable_anywhere or progress.rank is None:
        return
    if (progress.rank, progress.world_size) != (rank, world_size):
        raise ValueError(
            f"this checkpoint is rank {progress.rank}'s own state of a "
            f"{progress.world_size}-rank run, but it is being loaded by rank {rank} of "
            f"{world_size}; merge every rank's state with merge_state_dicts() and load the "
            "merged state on every rank"
        )
