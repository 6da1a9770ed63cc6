"""Packed token blocks for ``jobs/train_lm.py`` and ``jobs/verify.py``: one rank's view,
from lance_ray or from the reference (``lancedb.streaming``), and what identifies a block.

A block is identified by its content: a 63-bit hash of its ``input_ids`` and ``doc_ids``.
Random documents make two real blocks alike only by a hash collision; all-padding blocks
(a split that ran out before its budget) are alike, so the proof counts blocks as a
multiset (``lance_ray.verify.coverage``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch

READERS = ("lance_ray", "lance_ray-ray", "coordinator", "reference")


@dataclass(frozen=True)
class PackSpec:
    """Everything that fixes an epoch of packed blocks and its global steps."""

    db: str
    table: str
    table_version: int
    num_splits: int
    shuffle_seed: int
    block_len: int
    eos_id: int
    pad_id: int
    blocks_per_epoch: int
    global_batch: int  # blocks per global step, a multiple of num_splits
    column: str = "tokens"

    def dataset_kwargs(self) -> dict[str, Any]:
        """The arguments both ``StreamingDataset`` classes take for this epoch."""
        return {"num_splits": self.num_splits, "shuffle_seed": self.shuffle_seed,
                "columns": [self.column], "pack_sequences": self.block_len,
                "eos_id": self.eos_id, "pad_id": self.pad_id,
                "blocks_per_epoch": self.blocks_per_epoch}

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def block_ids(batch: dict[str, torch.Tensor]) -> list[int]:
    """One content id per block (row) of a ``[b, L]`` batch."""
    ids = batch["input_ids"].to(torch.int64).numpy()
    docs = batch["doc_ids"].to(torch.int64).numpy()
    out = []
    for tokens, doc in zip(ids, docs):
        digest = hashlib.blake2b(tokens.tobytes() + doc.tobytes(), digest_size=8).digest()
        out.append(int.from_bytes(digest, "big") >> 1)
    return out


def open_table(spec: PackSpec) -> Any:
    """The spec's table at its pinned version (a LanceDB table, as both readers accept)."""
    import lancedb

    table = lancedb.connect(spec.db).open_table(spec.table)
    table.checkout(spec.table_version)
    return table


def merge_for(reader: str) -> Callable[[list[dict]], dict]:
    """How ``reader``'s rank states are merged into one that resumes any world size."""
    if reader == "reference":
        from lancedb.streaming import StreamingDataset as Reference

        return Reference.merge_state_dicts
    import lance_ray

    return lance_ray.merge_state_dicts


class PackedView:
    """One rank's packed blocks in global steps of ``spec.global_batch`` blocks, with what
    ``lance_ray.train.report`` needs (``rank``, ``global_step``, ``state_dict()``)."""

    def __init__(self, spec: PackSpec, reader: str, rank: int, world_size: int,
                 state: dict | None = None, coordinator: str | None = None):
        if reader not in READERS:
            raise ValueError(f"reader must be one of {READERS}, got {reader!r}")
        if spec.global_batch % (spec.num_splits) or spec.num_splits % world_size:
            raise ValueError(f"the global batch ({spec.global_batch}) must be a multiple of "
                             f"num_splits ({spec.num_splits}), which world size {world_size} "
                             "must divide: then every global step holds whole cycles of "
                             "blocks and is the same at every world size")
        self.spec, self.reader, self.rank, self.world_size = spec, reader, rank, world_size
        table = open_table(spec)
        kwargs = {**spec.dataset_kwargs(), "rank": rank, "world_size": world_size}
        if reader == "coordinator":  # the run's packing lives in the coordinator actor
            from lance_ray.driver.handle import Coordinator

            if coordinator is None:
                raise ValueError("reader='coordinator' needs the coordinator's name")
            coord = Coordinator.get(coordinator)
            coord.load_state_dict(state or coord.initial_state())  # the same on every rank
            self.ds = coord.view(rank, world_size, reader="local")
        elif reader == "reference":
            from lancedb.streaming import StreamingDataset as Reference

            self.ds: Any = Reference(table, **kwargs)
        else:
            import lance_ray

            self.ds = lance_ray.StreamingDataset(
                table, table_version=spec.table_version,
                reader="ray" if reader == "lance_ray-ray" else "local", **kwargs)
        self.global_step = 0
        if state is not None:
            self.ds.load_state_dict(state)
            self.global_step = resumed_step(state, spec)

    @property
    def per_rank(self) -> int:
        return self.spec.global_batch // self.world_size

    def state_dict(self) -> dict[str, Any]:
        return self.ds.state_dict()

    def iter_batches(self) -> Iterator[dict[str, torch.Tensor]]:
        """``{"input_ids", "doc_ids"}`` of ``[per_rank, L]``; ``global_step`` counts them."""
        if hasattr(self.ds, "iter_batches"):
            batches: Any = self.ds.iter_batches(self.per_rank)
        else:
            from torch.utils.data import DataLoader

            batches = DataLoader(self.ds, batch_size=self.per_rank, num_workers=0)
        for batch in batches:
            self.global_step += 1
            yield batch


def resumed_step(state: dict, spec: PackSpec) -> int:
    """The global step a packed state was taken at (every split emitted as many blocks)."""
    emitted = state["blocks_emitted_per_split"]  # both libraries' packed format
    if len(set(emitted)) != 1:
        raise ValueError(f"a packed state taken mid-cycle (blocks emitted per split "
                         f"{emitted}) cannot start a global step; checkpoint at a step")
    return emitted[0] * spec.num_splits // spec.global_batch


def uninterrupted_block_steps(spec: PackSpec) -> list[list[int]]:
    """The epoch's global steps (block ids) as one rank of the reference reads them: the
    oracle every run is compared with, whichever reader trained."""
    return [block_ids(b) for b in PackedView(spec, "reference", 0, 1).iter_batches()]
