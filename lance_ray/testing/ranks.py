"""One data-parallel rank as a Ray actor: a view in its own process, stepped batch by batch by
a driver. Used by ``jobs/elastic_resume.py``, the fault trials and the tests that need ranks
in other processes or on other nodes."""

from __future__ import annotations

from typing import Any

import ray

import lance_ray


@ray.remote(num_cpus=0)
class Rank:
    """Rank ``rank`` of ``world_size``, reading ``batch_size`` samples per step (the sample
    ids of the ``id`` column). The view is either its own plan over ``table`` (``plan``: the
    plan arguments of ``StreamingDataset``) or the plan of the coordinator ``coordinator``;
    ``state`` (a checkpoint) is loaded before the first step."""

    def __init__(self, rank: int, world_size: int, batch_size: int, *, table: Any = None,
                 plan: dict | None = None, coordinator: str | None = None,
                 state: dict | None = None, reader: str = "ray", read_batch_size: int = 512):
        if coordinator is not None:
            self.ds = lance_ray.StreamingDataset.from_coordinator(
                coordinator, rank=rank, world_size=world_size, reader=reader,
                read_batch_size=read_batch_size)
        else:
            self.ds = lance_ray.StreamingDataset(table, rank=rank, world_size=world_size,
                                                 columns=["id"], reader=reader,
                                                 read_batch_size=read_batch_size, **(plan or {}))
        if state is not None:  # a restart resumes from its checkpoint, not the live state
            self.ds.load_state_dict(state)
        self.batches = self.ds.iter_batches(batch_size)

    def next(self) -> list[int] | None:
        """The sample ids of the next batch, or None at the end of the epoch."""
        batch = next(self.batches, None)
        return None if batch is None else batch["id"].tolist()

    def state(self) -> dict:
        return self.ds.state_dict()

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()
