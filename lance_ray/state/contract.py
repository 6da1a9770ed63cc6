"""The one stateful contract every resumable piece keeps: state out, state in, iterate.

Anchors: torchdata nodes (``get_state`` / ``reset(initial_state)`` / ``next``), Grain's
``DatasetIterator.get_state`` / ``set_state`` and Energon's savables. lance_ray spells it as
torch's ``Stateful`` does (``state_dict`` / ``load_state_dict``), so ``torch.distributed``
checkpointing takes any of them as is. States are plain JSON values.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Stateful(Protocol):
    """Saves its progress as a plain-JSON dict and resumes from one (a coordinator handle)."""

    def state_dict(self) -> dict[str, Any]:
        """The progress so far: loading it into a fresh, equal object resumes exactly."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (made by ``state_dict`` of an equal object)."""


@runtime_checkable
class ResumableIterable(Stateful, Protocol):
    """A stateful iterable (the views and the loader): iterating yields the rest of the
    current epoch, from the progress saved so far or loaded."""

    def __iter__(self) -> Iterator[Any]:
        """The rest of the current epoch."""
