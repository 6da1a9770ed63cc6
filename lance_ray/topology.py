"""Who owns which splits: the reference's contiguous assignment of splits to ranks, and the
world sizes a plan can be read on."""

from __future__ import annotations

from dataclasses import dataclass

from .checks import is_int, positive_int


def splits_per_rank(num_splits: int, world_size: int) -> int:
    """How many splits each rank owns; raises if ``world_size`` does not divide them."""
    if world_size <= 0 or num_splits % world_size != 0:
        raise ValueError(
            f"num_splits ({num_splits}) must be divisible by world_size ({world_size}); "
            f"valid world sizes for {num_splits} splits are {valid_world_sizes(num_splits)}"
        )
    return num_splits // world_size


def rank_splits(rank: int, world_size: int, num_splits: int) -> list[int]:
    """The contiguous block of splits rank ``rank`` owns (the reference's assignment)."""
    per_rank = splits_per_rank(num_splits, world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank ({rank}) must be in [0, {world_size}) for world_size {world_size}")
    return list(range(rank * per_rank, (rank + 1) * per_rank))


def valid_world_sizes(num_splits: int) -> list[int]:
    """Every world size a plan with ``num_splits`` splits can be read on."""
    return [w for w in range(1, num_splits + 1) if num_splits % w == 0]


@dataclass(frozen=True)
class Topology:
    """A view's place in the data-parallel group: its rank of ``world_size`` ranks."""

    rank: int
    world_size: int

    def __post_init__(self) -> None:
        positive_int("world_size", self.world_size)
        if not is_int(self.rank):
            raise ValueError(f"rank must be an integer in [0, {self.world_size}), "
                             f"got {self.rank!r}")

    def owned(self, num_splits: int) -> list[int]:
        """The splits this rank owns in a plan of ``num_splits`` splits."""
        return rank_splits(self.rank, self.world_size, num_splits)
