"""The split plan: which rows belong to which split, in which order, for one epoch.

The plan is a pure function of (table version, filter, shuffle, num_splits, shuffle_seed,
epoch, clump size, plan mode). In the default mode (``plan="lancedb"``) rows are assigned
exactly as ``lancedb.streaming.StreamingDataset`` assigns them, by calling lancedb's own
permutation builder on the pinned table version, so checkpoints and sample order are
interchangeable with the reference. ``plan="index"`` (``plan.index``) computes each row's
shuffled position instead, for tables past the builder's limit.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np

from ..checks import non_negative_int, positive_int
from ..state.format import PlanIdentity

logger = logging.getLogger(__name__)

# The reference derives the per-epoch seed as ``shuffle_seed + epoch * 100003``; keeping the
# same formula is what makes our order identical to lancedb.streaming's.
EPOCH_SEED_STRIDE = 100003
PLAN_MODES = ("lancedb", "index")
# lancedb 0.40 sorts the permutation in a fixed 100 MB DataFusion pool (LANCE_MEM_POOL_SIZE
# does not reach it): 2.5M shuffled rows build and 3M fail (full or clumped, 1 to 64 splits).
# Above 3M we refuse at once rather than let the builder spend long on failing (docs/plans.md).
BUILDER_SHUFFLE_LIMIT = "about 2.5M rows"
BUILDER_SHUFFLE_MAX_ROWS = 3_000_000


class RowIdMap(Protocol):
    """Row ids computed for any (split, position); ``index.ComputedSplits`` is one."""

    def row_ids(self, splits: np.ndarray, positions: np.ndarray) -> np.ndarray: ...


@dataclass(frozen=True)
class PlanSpec:
    """Everything the split plan depends on. Two equal specs give the same plan."""

    table_version: int
    num_splits: int
    shuffle: bool
    shuffle_seed: int
    epoch: int
    shuffle_clump_size: int | None = None
    filter: str | None = None
    plan: str = "lancedb"  # one of PLAN_MODES

    def for_epoch(self, epoch: int) -> PlanSpec:
        """The same plan inputs for another epoch."""
        return PlanSpec(**{**asdict(self), "epoch": epoch})

    def config(self) -> dict[str, Any]:
        """The fields as a dict, without ``plan`` in the default mode (as before modes)."""
        return {k: v for k, v in asdict(self).items() if k != "plan" or v != "lancedb"}


@dataclass(frozen=True)
class SplitPlan:
    """Row ids of every split of one epoch: ``row_ids[k]`` is split k in yield order.

    ``row_ids`` may hold only a subset of the splits (``first_split`` onwards), which is
    how a rank keeps just its own part of the plan. A ``plan="index"`` plan stores no row
    ids (``row_ids is None``): ``computed`` maps any (split, position) to its row id, so it
    holds every split at O(num_splits + fragments) cost (plus the matching rows' offsets
    under a filter or deletions).
    """

    spec: PlanSpec
    split_len: int
    total_rows: int
    fingerprint: str
    row_ids: np.ndarray | None  # shape (len(owned), split_len), uint64
    first_split: int = 0
    computed: RowIdMap | None = None

    @property
    def dropped_rows(self) -> int:
        """Rows left out of this epoch so that every split has the same length."""
        return self.total_rows - self.split_len * self.spec.num_splits

    def splits(self, first: int, count: int) -> SplitPlan:
        """The part of this plan holding splits ``first .. first+count-1``."""
        if self.row_ids is None:
            return self  # computed: every split costs nothing to hold
        lo = first - self.first_split
        if lo < 0 or lo + count > self.row_ids.shape[0]:
            raise ValueError(
                f"splits {first}..{first + count - 1} are not held by this plan "
                f"(it holds {self.first_split}..{self.first_split + self.row_ids.shape[0] - 1})"
            )
        return SplitPlan(
            self.spec,
            self.split_len,
            self.total_rows,
            self.fingerprint,
            self.row_ids[lo : lo + count],
            first,
        )

    def rows(self, split: int, positions: np.ndarray) -> np.ndarray:
        """Row ids at ``positions`` of global ``split``."""
        positions = np.asarray(positions, dtype=np.int64)
        return self.rows_at(np.full(positions.shape, split, dtype=np.int64), positions)

    def identity(self, table_commit: str | None = None) -> PlanIdentity:
        """What a state must agree with before it may be applied to this plan (of the table
        version made by commit ``table_commit``, where known)."""
        s = self.spec
        return PlanIdentity(
            s.num_splits,
            s.shuffle_seed,
            s.epoch,
            self.split_len,
            s.table_version,
            self.fingerprint,
            s.shuffle,
            s.filter,
            s.shuffle_clump_size,
            s.plan,
            table_commit,
        )

    def rows_at(self, splits: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """Row ids of the samples at ``positions`` of global ``splits`` (element-wise)."""
        if self.row_ids is None:
            assert self.computed is not None
            return self.computed.row_ids(splits, positions)
        return self.row_ids[np.asarray(splits) - self.first_split, positions]


def check_epoch_seed(shuffle_seed: int, epoch: object) -> None:
    """Raise unless ``epoch`` is valid and its seed fits the shuffler's 64-bit seed."""
    epoch = non_negative_int("epoch", epoch)
    if shuffle_seed + epoch * EPOCH_SEED_STRIDE >= 2**64:
        raise ValueError(
            f"shuffle_seed + {EPOCH_SEED_STRIDE} * epoch must be below 2**64 (the shuffler's "
            f"seed), got shuffle_seed={shuffle_seed}, epoch={epoch}: use a smaller seed"
        )


def check_plan_args(*, num_splits: object, shuffle_seed: object, epoch: object,
                    shuffle_clump_size: object, filter: object, plan: object = "lancedb") -> int:
    """Validate the plan arguments; returns the seed (drawn at random when None)."""
    if plan not in PLAN_MODES:
        raise ValueError(f"plan must be one of {PLAN_MODES}, got {plan!r}")
    positive_int("num_splits", num_splits)
    positive_int("shuffle_clump_size", shuffle_clump_size, allow_none=True)
    if shuffle_seed is None:
        shuffle_seed = int(np.random.SeedSequence().entropy % 2**32)  # type: ignore[operator]
    shuffle_seed = non_negative_int("shuffle_seed", shuffle_seed)
    check_epoch_seed(shuffle_seed, epoch)
    if shuffle_clump_size is not None and shuffle_clump_size >= 2**63:  # type: ignore[operator]
        raise ValueError(f"shuffle_clump_size must be below 2**63, got {shuffle_clump_size}")
    if filter is not None and (not isinstance(filter, str) or not filter.strip()):
        raise ValueError(f"filter must be a non-empty SQL string, got {filter!r}")
    return shuffle_seed


def plan_fingerprint(spec: PlanSpec, row_ids: np.ndarray) -> str:
    """A short, stable hash of the plan's inputs and of every planned row id."""
    h = hashlib.sha256()
    h.update(repr(sorted(spec.config().items())).encode())  # as before plan modes
    h.update(np.ascontiguousarray(row_ids, dtype="<u8").tobytes())
    return h.hexdigest()[:16]


def plan_from_permutation(spec: PlanSpec, row_ids: np.ndarray, split_ids: np.ndarray) -> SplitPlan:
    """Build a plan from a permutation table (rows ordered by split, then position)."""
    total = int(row_ids.shape[0])
    counts = np.bincount(split_ids.astype(np.int64), minlength=spec.num_splits)
    if counts.shape[0] != spec.num_splits or len(set(counts.tolist())) != 1:
        raise RuntimeError(f"permutation has unequal or missing splits: {counts.tolist()}")
    split_len = int(counts[0])
    if np.any(np.diff(split_ids.astype(np.int64)) < 0):
        raise RuntimeError("permutation rows are not ordered by split")
    matrix = np.ascontiguousarray(row_ids, dtype=np.uint64).reshape(spec.num_splits, split_len)
    # The builder drops the N mod S surplus rows; recover N for reporting.
    return SplitPlan(spec, split_len, total, plan_fingerprint(spec, matrix), matrix)


def build_plan(table: Any, spec: PlanSpec, total_rows: int) -> SplitPlan:
    """Run lancedb's permutation builder on ``table`` (already at ``spec.table_version``).

    ``total_rows`` is the row count after the filter, used to report the dropped tail.
    """
    from lancedb.permutation import permutation_builder

    if spec.shuffle and total_rows > BUILDER_SHUFFLE_MAX_ROWS:
        raise _too_large(spec, total_rows)
    builder = permutation_builder(table)
    if spec.filter is not None:
        builder = builder.filter(spec.filter)
    if spec.shuffle:
        builder = builder.split_random(
            fixed=spec.num_splits,
            seed=spec.shuffle_seed + spec.epoch * EPOCH_SEED_STRIDE,
            clump_size=spec.shuffle_clump_size,
        )
    else:
        builder = builder.split_sequential(fixed=spec.num_splits)
    try:
        perm = builder.execute().to_arrow()
    except RuntimeError as e:
        if "Not enough memory" not in str(e) and "Resources exhausted" not in str(e):
            raise
        logger.debug("lancedb's permutation builder failed: %s", e)
        raise _too_large(spec, total_rows) from None
    plan = plan_from_permutation(
        spec, perm["row_id"].to_numpy(), perm["split_id"].to_numpy()
    )
    return SplitPlan(plan.spec, plan.split_len, total_rows, plan.fingerprint, plan.row_ids)


class PlanTooLargeError(ValueError):
    """The lancedb-compatible plan cannot be built for this many rows: use ``plan="index"``."""


def _too_large(spec: PlanSpec, total_rows: int) -> PlanTooLargeError:
    return PlanTooLargeError(
        f"lancedb's permutation builder cannot plan {total_rows:,} rows"
        f"{' shuffled' if spec.shuffle else ''}: lancedb 0.40 sorts the permutation in a "
        f"fixed 100 MB memory pool ({BUILDER_SHUFFLE_LIMIT} shuffled; LANCE_MEM_POOL_SIZE "
        "does not change it). Use plan='index', which computes each row's shuffled position "
        "(O(num_splits + fragments) memory, any table size)"
    )
