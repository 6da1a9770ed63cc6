"""One stateful contract for every way of iterating a view: save at any batch boundary, load
the state into a fresh view, and the rest of the epoch follows exactly (in the spirit of
torchdata's single save/load conformance test).

Each iteration path is a ``Path``: how to iterate a view and read sample ids off what it
yields. ``test_every_iteration_path_resumes_exactly_from_every_boundary`` runs the same check
on each."""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from lance_ray import Coordinator, StreamingDataLoader, StreamingDataset

SPLITS, WORLD, RANK, BATCH = 4, 2, 1, 7


@dataclass(frozen=True)
class Path:
    """One way to iterate a view: ``iterate(view)`` yields units (a sample or a batch) and
    ``ids(unit)`` reads their sample ids."""

    name: str
    iterate: Callable[[StreamingDataset], Iterator[Any]]
    ids: Callable[[Any], list[int]]
    reader: str = "local"
    boundaries: int = 6  # how many boundaries to resume from (the slower paths check fewer)


def _batch_ids(batch: Any) -> list[int]:
    return batch["id"].tolist()


PATHS = [
    Path("__iter__", iter, lambda row: [row["id"]]),
    Path("iter_batches", lambda v: v.iter_batches(BATCH), _batch_ids),
    Path("loader, 0 workers", lambda v: iter(StreamingDataLoader(v, BATCH)), _batch_ids),
    Path("loader, 2 workers", lambda v: iter(StreamingDataLoader(v, BATCH, num_workers=2)),
         _batch_ids, boundaries=3),
    Path("iter_batches, Ray reader", lambda v: v.iter_batches(BATCH), _batch_ids,
         reader="ray", boundaries=3),
]


def _boundaries(units: int, wanted: int) -> list[int]:
    """``wanted`` boundaries spread over 0..units, always with both ends."""
    step = max(1, units // max(1, wanted - 1))
    return sorted({0, units, 1, *range(0, units, step)})[:wanted] + [units]


def check_resumes_exactly(make_view: Callable[[], StreamingDataset], path: Path) -> None:
    """Resuming ``path`` from any boundary yields exactly the rest of the uninterrupted run."""
    whole = [path.ids(u) for u in path.iterate(make_view())]
    assert whole, "the view yields nothing: the check would prove nothing"
    for k in sorted(set(_boundaries(len(whole), path.boundaries))):
        view = make_view()
        it = path.iterate(view)
        before = [path.ids(u) for u in itertools.islice(it, k)]
        state = view.state_dict()
        close = getattr(it, "close", None)
        if close is not None:
            close()
        resumed = make_view()
        resumed.load_state_dict(state)
        after = [path.ids(u) for u in path.iterate(resumed)]
        assert before + after == whole, f"{path.name}: resuming after {k} units"


@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_every_iteration_path_resumes_exactly_from_every_boundary(path, table_1k, request):
    if path.reader == "ray":
        request.getfixturevalue("ray_session")

    def make_view() -> StreamingDataset:
        return StreamingDataset(table_1k, num_splits=SPLITS, rank=RANK, world_size=WORLD,
                                shuffle=True, shuffle_seed=3, reader=path.reader,
                                columns=["id"])

    check_resumes_exactly(make_view, path)


def test_coordinator_views_resume_exactly_from_every_boundary(table_1k, ray_session, tmp_path):
    coord = Coordinator.create(table_1k, f"conformance-{uuid.uuid4().hex[:8]}",
                               storage_path=str(tmp_path / "store"), world_size=WORLD,
                               num_splits=SPLITS, shuffle=True, shuffle_seed=3)
    try:
        path = Path("coordinator view", lambda v: v.iter_batches(BATCH), _batch_ids,
                    boundaries=3)
        check_resumes_exactly(lambda: coord.view(RANK, WORLD, reader="local", columns=["id"]),
                              path)
    finally:
        coord.kill()


def _block_ids(batch: Any) -> list[tuple[int, ...]]:
    return [tuple(ids) for ids in batch["input_ids"].tolist()]


def _cycles(view: StreamingDataset) -> Iterator[dict[str, Any]]:
    """``__iter__``'s blocks a cycle at a time: a packed state exists only between cycles."""
    k = len(view._owned)
    for cycle in zip(*[iter(view)] * k):
        yield {"input_ids": torch.stack([b["input_ids"] for b in cycle])}


PACKED_PATHS = [
    Path("packed __iter__", _cycles, _block_ids),
    Path("packed iter_batches", lambda v: v.iter_batches(4), _block_ids),
    Path("packed loader, 0 workers", lambda v: iter(StreamingDataLoader(v, 4)), _block_ids),
    Path("packed iter_batches, Ray reader", lambda v: v.iter_batches(4), _block_ids,
         reader="ray", boundaries=3),
]


@pytest.mark.parametrize("path", PACKED_PATHS, ids=[p.name for p in PACKED_PATHS])
def test_every_packed_path_resumes_exactly_from_every_boundary(path, token_table, request):
    if path.reader == "ray":
        request.getfixturevalue("ray_session")

    def make_view() -> StreamingDataset:
        return StreamingDataset(token_table[0], num_splits=SPLITS, rank=RANK, world_size=WORLD,
                                shuffle=True, shuffle_seed=3, reader=path.reader,
                                columns=["tokens"], pack_sequences=8, eos_id=1, pad_id=0,
                                blocks_per_epoch=40, read_batch_size=8)

    check_resumes_exactly(make_view, path)
