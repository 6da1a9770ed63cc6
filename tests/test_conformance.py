"""One stateful contract for every way of iterating a view: ``conformance.check_resumes_exactly``
(save at any boundary, resume exactly, next epoch, end-of-epoch roll-over, one state shape)
over every path: direct iteration, ``iter_batches``, the loader with 0 and 2 workers, the
local and Ray readers, coordinator views, the transform error policies, ``plan="index"``,
and the packed mode on each reader, the loader and the coordinator. Remote tables run it in
``test_remote.py`` (beside their server); ``test_dropin``, ``test_transform`` and
``test_packing`` run it on their own configurations.

Every stateful object also satisfies ``lance_ray.state.contract``'s Protocols."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import pyarrow as pa
import pytest
import torch
from conformance import Path, batch_ids, check_resumes_exactly

from lance_ray import Coordinator, StreamingDataLoader, StreamingDataset
from lance_ray.state.contract import ResumableIterable, Stateful

SPLITS, WORLD, RANK, BATCH = 4, 2, 1, 7


PATHS = [
    Path("__iter__", iter, lambda row: [row["id"]]),
    Path("iter_batches", lambda v: v.iter_batches(BATCH), batch_ids),
    Path("loader, 0 workers", lambda v: iter(StreamingDataLoader(v, BATCH)), batch_ids),
    Path("loader, 2 workers", lambda v: iter(StreamingDataLoader(v, BATCH, num_workers=2)),
         batch_ids, boundaries=3),
    Path("iter_batches, Ray reader", lambda v: v.iter_batches(BATCH), batch_ids,
         reader="ray", boundaries=3),
]


def view_of(table: Any, path: Path, **kw: Any) -> StreamingDataset:
    return StreamingDataset(table, **{"num_splits": SPLITS, "rank": RANK, "world_size": WORLD,
                                      "shuffle": True, "shuffle_seed": 3,
                                      "reader": path.reader, "columns": ["id"], **kw})


@pytest.mark.parametrize("path", PATHS, ids=[p.name for p in PATHS])
def test_every_iteration_path_resumes_exactly_from_every_boundary(path, table_1k, request):
    if path.reader == "ray":
        request.getfixturevalue("ray_session")
    check_resumes_exactly(lambda: view_of(table_1k, path), path)


@pytest.mark.parametrize("path", PATHS[:3], ids=[p.name for p in PATHS[:3]])
def test_the_index_plan_resumes_exactly_from_every_boundary(path, table_factory):
    table = table_factory(250, 2)
    check_resumes_exactly(lambda: view_of(table, path, plan="index", filter="id % 3 != 0"),
                          path)


def ids_unless_bad(batch: pa.RecordBatch) -> list[int]:
    """Fails on any read batch holding an id with id % 7 == 3 (deterministic)."""
    ids = batch.column("id").to_pylist()
    if any(i % 7 == 3 for i in ids):
        raise ValueError("bad row")
    return ids


POLICY_PATHS = [
    Path("iter_batches", lambda v: v.iter_batches(BATCH, collate_fn=list), list),
    Path("__iter__", iter, lambda i: [i]),
]


@pytest.mark.parametrize("policy", ["skip", "keep_slot", "fill"])
@pytest.mark.parametrize("path", POLICY_PATHS, ids=[p.name for p in POLICY_PATHS])
def test_transform_error_policies_resume_exactly_from_every_boundary(policy, path,
                                                                     table_factory):
    table = table_factory(250, 2)
    check_resumes_exactly(lambda: view_of(table, path, columns=None, transform=ids_unless_bad,
                                          on_transform_error=policy, fill_value=-1,
                                          read_batch_size=10), path)


def _coordinator(table: Any, tmp_path: Any, **kw: Any) -> Coordinator:
    return Coordinator.create(table, f"conformance-{uuid.uuid4().hex[:8]}",
                              storage_path=str(tmp_path / "store"), world_size=WORLD,
                              num_splits=SPLITS, shuffle=True, shuffle_seed=3, **kw)


def test_coordinator_views_resume_exactly_from_every_boundary(table_1k, ray_session, tmp_path):
    coord = _coordinator(table_1k, tmp_path)
    try:
        path = Path("coordinator view", lambda v: v.iter_batches(BATCH), batch_ids,
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


PACKED = dict(pack_sequences=8, eos_id=1, pad_id=0, columns=["tokens"])
PACKED_PATHS = [
    Path("packed __iter__", _cycles, _block_ids),
    Path("packed iter_batches", lambda v: v.iter_batches(4), _block_ids),
    Path("packed loader, 0 workers", lambda v: iter(StreamingDataLoader(v, 4)), _block_ids),
    Path("packed loader, 2 workers", lambda v: iter(StreamingDataLoader(v, 4, num_workers=2)),
         _block_ids, boundaries=3),
    Path("packed iter_batches, Ray reader", lambda v: v.iter_batches(4), _block_ids,
         reader="ray", boundaries=3),
]


@pytest.mark.parametrize("path", PACKED_PATHS, ids=[p.name for p in PACKED_PATHS])
def test_every_packed_path_resumes_exactly_from_every_boundary(path, token_table, request):
    if path.reader == "ray":
        request.getfixturevalue("ray_session")
    check_resumes_exactly(lambda: view_of(token_table[0], path, **PACKED, blocks_per_epoch=40,
                                          read_batch_size=8), path)


def test_coordinator_packed_views_resume_exactly_from_every_boundary(token_table, ray_session,
                                                                    tmp_path):
    coord = _coordinator(token_table[0], tmp_path, **PACKED, blocks_per_epoch=40)
    try:
        path = Path("packed coordinator view", lambda v: v.iter_batches(4), _block_ids,
                    boundaries=3)
        check_resumes_exactly(lambda: coord.view(RANK, WORLD, reader="local",
                                                 read_batch_size=8), path)
    finally:
        coord.kill()


def test_every_stateful_object_keeps_the_contract(table_1k, token_table, ray_session,
                                                  tmp_path):
    view = view_of(table_1k, PATHS[0])
    packed = view_of(token_table[0], PACKED_PATHS[0], **PACKED, blocks_per_epoch=40)
    coord = _coordinator(table_1k, tmp_path)
    try:
        iterables = [view, packed, StreamingDataLoader(view, BATCH),
                     StreamingDataLoader(packed, 4), coord.view(RANK, WORLD, reader="local")]
        assert all(isinstance(o, ResumableIterable) for o in iterables)
        assert isinstance(coord, Stateful) and not isinstance(coord, ResumableIterable)
    finally:
        coord.kill()


class ListView:
    """A correct stateful view over 10 samples per epoch (epoch e yields e*10 .. e*10+9),
    and, by ``bug``, one broken way: the helper must catch each."""

    def __init__(self, bug: str = "") -> None:
        self.bug, self.epoch, self.done = bug, 0, 0

    def __iter__(self) -> Iterator[int]:
        while self.done < 10:
            self.done += 1
            yield self.epoch * 10 + self.done - 1

    def set_epoch(self, epoch: int) -> None:
        self.epoch, self.done = epoch, 0
        if self.bug == "epoch" and getattr(self, "resumed", False):
            self.done = 1  # the next epoch after a resume loses a sample

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"epoch": self.epoch, "done": self.done}
        if self.bug == "shape" and self.done:
            state["extra"] = 1
        if self.bug == "json":
            state["pair"] = (1, 2)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.done, self.resumed = state["epoch"], state["done"], True
        if self.bug == "resume" and 0 < self.done < 10:
            self.done += 1
        if self.bug == "end" and self.done == 10:
            self.epoch, self.done = self.epoch + 1, 0  # an end state starts the next epoch


@pytest.mark.parametrize("bug, message", [("resume", "resuming after"),
                                          ("end", "resuming after 10 units"),
                                          ("epoch", "the epoch after a resume"),
                                          ("shape", "shape changes"), ("json", "plain JSON")])
def test_the_helper_catches_each_broken_contract(bug, message):
    path = Path("list", iter, lambda i: [i])
    check_resumes_exactly(ListView, path)
    with pytest.raises(AssertionError, match=message):
        check_resumes_exactly(lambda: ListView(bug), path)
