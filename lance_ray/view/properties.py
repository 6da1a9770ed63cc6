"""The read-only properties of a view: where it stands and what it reads."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..plan.pack_args import PackOptions
    from ..plan.splits import PlanSpec, SplitPlan
    from ..plan.table import TableRef
    from ..state import format as st
    from ..stream.cursor import Cursor


class ViewProperties:
    """Properties of :class:`~lance_ray.view.dataset.StreamingDataset`."""

    _spec: PlanSpec
    _rank: int
    _world_size: int
    _cursor: Cursor
    _table: TableRef
    _plan: SplitPlan
    _identity: st.PlanIdentity
    _packing: PackOptions | None

    @property
    def packed(self) -> bool:
        """Whether this view yields packed token blocks (``pack_sequences``)."""
        return self._packing is not None

    @property
    def epoch(self) -> int:
        """The epoch whose plan this view reads."""
        return self._spec.epoch

    @property
    def num_splits(self) -> int:
        return self._spec.num_splits

    @property
    def shuffle_seed(self) -> int:
        """The resolved shuffle seed (``shuffle_seed=None`` picks one at construction)."""
        return self._spec.shuffle_seed

    # lancedb.streaming's private names for the two, which its users read (migrating.md).
    _num_splits = num_splits
    _shuffle_seed = shuffle_seed

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def global_step(self) -> int:
        """Batches delivered in this epoch (resumed states continue their count)."""
        return self._cursor.batches

    @property
    def table_version(self) -> int:
        """The pinned table version every read goes to."""
        return self._table.version

    @property
    def plan(self) -> SplitPlan:
        """This rank's part of the current epoch's plan."""
        return self._plan

    @property
    def identity(self) -> st.PlanIdentity:
        return self._identity
