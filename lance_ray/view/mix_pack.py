"""Sequence packing over a mixture: each rank's documents, in the mixture's order (so of every
source in its proportion), joined with ``eos_id`` and cut into blocks of ``pack_sequences``
tokens; a block holds documents of several sources.

The state after a block is the mixture's state after the documents fed so far plus the
tokens not yet in a block (this rank's *carry*). Merged states keep every rank's carry; on
``W'`` ranks, rank ``r'`` emits the carries of old ranks ``r`` with ``r % W' == r'`` (in rank
order) before its own documents, so every token is delivered exactly once across a resize.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..plan import pack_args
from ..read.transform import Transform


def pack_config(kwargs: dict[str, Any], columns: list[str] | None,
                transform: Transform | None) -> dict[str, Any] | None:
    """A packed mixture's configuration, taken out of ``kwargs`` (None: not packed);
    refuses, naming the fix, what a packed mixture cannot do."""
    length = kwargs.pop("pack_sequences", None)
    eos_id, pad_id = kwargs.pop("eos_id", None), kwargs.pop("pad_id", None)
    refused = {"blocks_per_epoch", "pack_position_ids", "pack_cu_seqlens"} & set(kwargs)
    if length is None:
        return None
    if refused:
        raise NotImplementedError(f"{sorted(refused)} are not implemented for a packed "
                                  "mixture (docs/mixing.md)")
    pack_args.check_token_ids(length, eos_id, pad_id)
    if transform is not None or not columns or len(columns) != 1:
        raise ValueError("a packed mixture reads one token column: pass columns=[name] "
                         "(a list of token ids in every source) and no transform")
    return {"pack_sequences": length, "eos_id": eos_id, "pad_id": pad_id,
            "column": columns[0]}


@dataclass
class TokenPacker:
    """Documents in, blocks of ``length`` tokens out (pure numpy)."""

    length: int
    eos_id: int
    pad_id: int
    tokens: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)  # where documents start in ``tokens``
    sources: list[int] = field(default_factory=list)  # each token's source

    def feed(self, doc: list[int], source: int) -> None:
        self.starts.append(len(self.tokens))
        self.tokens += [*doc, self.eos_id]
        self.sources += [source] * (len(doc) + 1)

    def ready(self) -> bool:
        return len(self.tokens) >= self.length

    def cut(self) -> dict[str, np.ndarray]:
        """The next block (padded with ``pad_id``, source -1, when the carry is short)."""
        n = self.length
        short = max(0, n - len(self.tokens))
        ids = np.array(self.tokens[:n] + [self.pad_id] * short, dtype=np.int64)
        src = np.array(self.sources[:n] + [-1] * short, dtype=np.int64)
        starts = np.array([s for s in self.starts if 0 < s < n], dtype=np.int64)
        doc_ids = np.searchsorted(starts, np.arange(n), side="right")
        self.tokens, self.sources = self.tokens[n:], self.sources[n:]
        self.starts = [s - n for s in self.starts if s >= n]
        return {"input_ids": ids, "doc_ids": doc_ids.astype(np.int64), "source_ids": src}

    def carry(self) -> dict[str, list[int]]:
        return {"tokens": list(self.tokens), "starts": list(self.starts),
                "sources": list(self.sources)}

    def restore(self, carries: list[dict[str, list[int]]]) -> None:
        """Start from ``carries`` laid end to end (each begins a document or continues one
        only at its own start)."""
        self.tokens, self.starts, self.sources = [], [], []
        for c in carries:
            base = len(self.tokens)
            # A carry that continues a document of its own rank still starts a new segment
            # here: it is not the document before it in this rank's stream.
            lead = [base] if c["tokens"] and (not c["starts"] or c["starts"][0] != 0) else []
            self.starts += lead + [base + s for s in c["starts"]]
            self.tokens += [int(t) for t in c["tokens"]]
            self.sources += [int(s) for s in c["sources"]]


def blocks(packer: TokenPacker, items: Iterator[dict[str, Any]], column: str
           ) -> Iterator[dict[str, np.ndarray]]:
    """Blocks from the carry and then ``items``; the last is padded."""
    for item in items:
        packer.feed(list(item[column]), int(item["source"]))
        while packer.ready():
            yield packer.cut()
    while packer.tokens:
        yield packer.cut()


def pack_state(packer: TokenPacker, config: dict[str, Any], rank: int, world_size: int
               ) -> dict[str, Any]:
    return {**config, "world_size": world_size, "carries": {str(rank): packer.carry()}}


def carries_for(pack: dict[str, Any], config: dict[str, Any], rank: int, world_size: int
                ) -> list[dict[str, list[int]]]:
    """The carries rank ``rank`` of ``world_size`` starts from; refuses, naming the fix, a
    state of another packing or one that lacks carries it needs."""
    for key, value in config.items():
        if pack.get(key) != value:
            raise ValueError(f"{key} mismatch: the checkpoint packed with {pack.get(key)!r}, "
                             f"this mixture with {value!r}; construct it with "
                             f"{key}={pack.get(key)!r}")
    old = pack["world_size"]
    have = pack["carries"]
    if old == world_size and str(rank) in have:
        return [have[str(rank)]]
    if len(have) != old:
        raise ValueError(f"this packed mixture state holds the carries of ranks "
                         f"{sorted(have, key=int)} of {old}, not every rank's; merge every "
                         "rank's state with merge_state_dicts() and load the merged state")
    return [have[str(r)] for r in range(old) if r % world_size == rank]
