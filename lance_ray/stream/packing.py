"""Sequence packing: token documents of one split cut into fixed-length blocks (pure numpy).

The semantics are ``lancedb.streaming``'s ``pack_sequences`` mode, restated as a closed form
so that many blocks are cut at once from Arrow list offsets instead of token by token:

* A split's *stream* is its carried-over buffer followed by its documents in permutation
  order, each followed by ``eos_id``. Block ``j`` (from the buffer's start, 0-based) is
  ``stream[j*L : (j+1)*L]``; once the split has no documents left the stream is padded with
  ``pad_id``.
* ``doc_ids[p]`` counts the documents that start at a position ``0 < s <= p`` of the block,
  so the block's first segment (a continuation or a document starting at 0) is 0 and
  padding keeps the id of the document before it.
* The reference fills a split's buffer document by document while it holds fewer than L
  tokens, so after block ``j`` the documents consumed are exactly those starting before
  ``(j+1)*L`` and the buffer is the stream from ``(j+1)*L`` to the end of the last of them
  (its ``starts`` are the document starts in it, shifted; empty for every state the
  reference itself produces).

Nothing here knows of Ray, torch or tables: callers feed documents as ``(values, offsets)``
and take :class:`Cut` results, whose per-block progress gives the exact checkpoint state
after any block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pyarrow as pa

from ..state.packed import PackConfig, SplitProgress

__all__ = ["PackConfig", "SplitProgress", "SplitPacker", "Cut", "documents", "token_count"]


def documents(column: pa.Array | pa.ChunkedArray, *, widen: bool = True
              ) -> tuple[np.ndarray, np.ndarray]:
    """``(values, offsets)`` of a list column of token ids, offsets int64 from 0, values
    int64 (``widen=False``: in the column's own integer type, zero-copy).

    Raises ``ValueError`` on null lists or null tokens, and on uint64 ids that int64 blocks
    cannot hold (the reference refuses them too).
    """
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    if pa.types.is_fixed_size_list(column.type):
        size = column.type.list_size
        offsets = np.arange(len(column) + 1, dtype=np.int64) * size
    else:
        raw = column.offsets.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)
        offsets = raw - raw[0]
    values = column.flatten()
    if column.null_count or values.null_count:
        raise ValueError("pack_sequences does not support null token lists or null tokens; "
                         "filter them out (e.g. filter='tokens IS NOT NULL') or fix the table")
    out = values.to_numpy(zero_copy_only=False)
    if out.dtype == np.uint64 and len(out) and int(out.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"token id {int(out.max())} does not fit in the int64 blocks "
                         "pack_sequences makes; token ids must be below 2**63")
    return (out.astype(np.int64, copy=False) if widen else out), offsets


def token_count(column: pa.Array | pa.ChunkedArray) -> int:
    """Tokens a packed stream holds for these documents: their lengths plus one ``eos`` each."""
    if isinstance(column, pa.ChunkedArray):
        return sum(token_count(c) for c in column.chunks)
    if column.null_count:
        raise ValueError("pack_sequences does not support null token lists")
    lengths = pa.compute.list_value_length(column)
    return int(pa.compute.sum(lengths).as_py() or 0) + len(column)


def join_documents(values: np.ndarray, offsets: np.ndarray, eos_id: int
                   ) -> tuple[np.ndarray, np.ndarray]:
    """The documents as one stream with ``eos_id`` after each, and each document's start."""
    n = len(offsets) - 1
    starts = offsets[:-1] + np.arange(n, dtype=np.int64)
    stream = np.empty(len(values) + n, dtype=np.int64)
    eos_at = offsets[1:] + np.arange(n, dtype=np.int64)
    is_value = np.ones(len(stream), dtype=bool)
    is_value[eos_at] = False
    stream[is_value] = values
    stream[eos_at] = eos_id
    return stream, starts


def join_runs(chunks: list[tuple[np.ndarray, np.ndarray]], rows: np.ndarray, eos_id: int
              ) -> tuple[np.ndarray, np.ndarray]:
    """``join_documents`` of the documents ``rows`` (in that order) of the ``(values,
    offsets)`` chunks, their rows numbered end to end: one copy per document, straight from
    its chunk, kept in the values' integer type when ``eos_id`` fits in it (a later copy
    widens it anyway)."""
    dtype = narrow_dtype(chunks[0][0].dtype, eos_id)
    eos = np.array([eos_id], dtype=dtype)
    bases = np.cumsum([0, *(len(offsets) - 1 for _, offsets in chunks)])
    which = np.searchsorted(bases, rows, side="right") - 1
    lo, hi = np.empty(len(rows), np.int64), np.empty(len(rows), np.int64)
    for k, (_, offsets) in enumerate(chunks):
        mine = which == k
        local = rows[mine] - bases[k]
        lo[mine], hi[mine] = offsets[local], offsets[local + 1]
    pieces: list[np.ndarray] = []
    for k, a, b in zip(which.tolist(), lo.tolist(), hi.tolist()):
        pieces += (chunks[k][0][a:b], eos)
    sizes = hi - lo + 1
    stream = np.concatenate(pieces, dtype=dtype) if pieces else np.empty(0, dtype)
    return stream, np.cumsum(sizes) - sizes


def narrow_dtype(dtype: np.dtype, *ids: int) -> np.dtype:
    """``dtype`` if it is an integer type under 64 bits that holds every one of ``ids``,
    else int64: the packer keeps the column's own type until the batch's one copy."""
    kind = np.iinfo(dtype)
    if kind.bits < 64 and all(kind.min <= i <= kind.max for i in ids):
        return np.dtype(dtype)
    return np.dtype(np.int64)


def doc_starts_of(starts: np.ndarray, blocks: int, block_len: int) -> np.ndarray:
    """``[blocks, block_len]`` int8 marks of ``blocks`` consecutive blocks whose document
    starts are ``starts`` (ascending stream positions from the first block's start; later ones
    are ignored): 1 where a document starts after a block's first token. A block's
    ``doc_ids`` are their running sum along it."""
    # int8: a quarter of the bytes of int32 ids; the batch's copy sums them into int64.
    marks = np.zeros(blocks * block_len, dtype=np.int8)
    inside = starts[: np.searchsorted(starts, blocks * block_len)]
    marks[inside[inside % block_len != 0]] = 1
    return marks.reshape(blocks, block_len)


# Blocks cut at once are capped near this many tokens, so a large read is not turned into
# one huge block array.
CUT_TOKENS = 1 << 20


@dataclass
class Cut:
    """Blocks cut at once from one split, with what the split's state is after each.

    ``input_ids``: ``[k, L]`` in the stream's integer type (the batch's copy widens them);
    ``doc_starts``: ``[k, L]`` marks whose running sum along a block is its ``doc_ids``
    (``doc_starts_of``). :meth:`progress_after` gives the exact state after the first ``j``
    of them.
    """

    input_ids: np.ndarray
    doc_starts: np.ndarray
    first_emitted: int  # blocks emitted before this cut
    consumed: np.ndarray  # [k] documents consumed after each block
    ends: np.ndarray  # [k] stream position where the buffer ends after each block
    stream: np.ndarray  # the packer's stream; the cut's first block starts at ``base``
    starts: np.ndarray  # document starts in ``stream`` (ascending)
    base: int
    block_len: int

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def doc_ids(self) -> np.ndarray:
        """``[k, L]`` int64 document ids of the cut's blocks."""
        return np.cumsum(self.doc_starts, axis=1, dtype=np.int64)

    def counts_after(self, j: int) -> tuple[int, int, int]:
        """``progress_after(j).counts()``, without copying the buffer."""
        lo, hi = self.base + j * self.block_len, int(self.ends[j - 1])
        return int(self.consumed[j - 1]), self.first_emitted + j, max(0, hi - lo)

    def progress_after(self, j: int) -> SplitProgress:
        """The split's state after the first ``j`` (``1 <= j <= len``) blocks of the cut."""
        lo, hi = self.base + j * self.block_len, int(self.ends[j - 1])
        tokens = self.stream[lo:hi].copy() if hi > lo else np.empty(0, np.int64)
        a, b = np.searchsorted(self.starts, [lo, hi])
        return SplitProgress(int(self.consumed[j - 1]), self.first_emitted + j, tokens,
                             self.starts[a:b] - lo)


@dataclass
class SplitPacker:
    """Packs one split: fed its documents in order, cuts the reference's blocks.

    ``stream[head:]`` holds the tokens after the last block cut: the reference buffer
    (documents already consumed) followed by fed documents not consumed yet, which start at
    ``starts[first_pending:]``.
    """

    config: PackConfig
    consumed: int = 0
    emitted: int = 0
    has_buffer: bool = False  # the state has a ``pack_buffers`` entry for this split
    exhausted: bool = False  # every document of the split has been fed
    stream: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    starts: np.ndarray = field(default_factory=lambda: np.empty(0, np.int64))
    head: int = 0
    first_pending: int = 0

    @classmethod
    def resume(cls, config: PackConfig, progress: SplitProgress) -> SplitPacker:
        """A packer continuing from ``progress`` (a state's entries for this split)."""
        has = progress.tokens is not None
        stream = np.asarray(progress.tokens if has else [], dtype=np.int64)
        starts = np.asarray(progress.starts if progress.starts is not None else [], np.int64)
        return cls(config, progress.consumed, progress.emitted, has, stream=stream,
                   starts=starts, first_pending=len(starts))

    @property
    def budget_left(self) -> int:
        return self.config.blocks_per_split - self.emitted

    @property
    def held(self) -> int:
        """Tokens held: the buffer and the documents fed but not consumed."""
        return len(self.stream) - self.head

    def feed(self, values: np.ndarray, offsets: np.ndarray, *, last: bool = False) -> None:
        """Append the split's next documents (``last``: no documents follow them)."""
        self.feed_joined(*join_documents(values, offsets, self.config.eos_id), last=last)

    def feed_joined(self, tokens: np.ndarray, starts: np.ndarray, *, last: bool = False
                    ) -> None:
        """:meth:`feed` of documents already joined (``join_documents``'s output)."""
        if len(starts):
            cut_starts = int(np.searchsorted(self.starts, self.head))
            self.first_pending -= cut_starts
            self.starts = np.concatenate([self.starts[cut_starts:] - self.head,
                                          starts + self.held])
            tail = self.stream[self.head:]
            # Nothing held: the stream is the fed run itself (never written, so a view).
            self.stream = np.concatenate([tail, tokens]) if len(tail) else tokens
            self.head = 0
        self.exhausted = self.exhausted or last

    def ready(self) -> int:
        """Blocks that can be cut now (without more documents), within the budget."""
        if self.exhausted:
            return self.budget_left
        return min(self.budget_left, self.held // self.config.block_len)

    def cut(self, count: int) -> Cut:
        """Cut the next ``count`` (``1 <= count <= ready()``) blocks."""
        if not 0 < count <= self.ready():
            raise ValueError(f"cannot cut {count} blocks: {self.ready()} are ready")
        L, head = self.config.block_len, self.head
        size = count * L
        if self.held >= size:  # a view: the stream is never written once fed
            ids = self.stream[head:head + size]
        else:
            dtype = narrow_dtype(self.stream.dtype, self.config.pad_id)
            ids = np.full(size, self.config.pad_id, dtype=dtype)
            ids[:self.held] = self.stream[head:]
        pending = self.starts[self.first_pending:]
        block_ends = head + np.arange(1, count + 1, dtype=np.int64) * L
        # The reference fills while its buffer is short of a block: after block j it has
        # consumed the documents starting before the block's end, and its buffer ends where
        # the first document not consumed starts.
        taken = np.searchsorted(pending, block_ends, side="left")
        ends = np.maximum(np.append(pending, len(self.stream))[taken], block_ends)
        lo = int(np.searchsorted(self.starts, head))
        cut = Cut(ids.reshape(count, L), doc_starts_of(self.starts[lo:] - head, count, L),
                  self.emitted, self.consumed + taken, ends, self.stream, self.starts, head, L)
        self.consumed += int(taken[-1])
        self.emitted += count
        self.first_pending += int(taken[-1])
        self.has_buffer = True
        self.head = min(head + size, len(self.stream))
        return cut

    def cut_ready(self, at_least: int) -> Cut:
        """Cut ``at_least`` blocks, or more (up to about ``CUT_TOKENS``) if ready."""
        cap = max(at_least, CUT_TOKENS // self.config.block_len)
        return self.cut(min(self.ready(), cap))

    def state(self) -> SplitProgress:
        """The split's state after the last block cut (documents fed since are not in it)."""
        if not self.has_buffer:
            return SplitProgress(self.consumed, self.emitted)
        pending = self.first_pending < len(self.starts)
        end = int(self.starts[self.first_pending]) if pending else len(self.stream)
        end = max(end, self.head)
        lo = int(np.searchsorted(self.starts, self.head))
        return SplitProgress(self.consumed, self.emitted, self.stream[self.head:end].copy(),
                             self.starts[lo:self.first_pending] - self.head)


def position_ids_of(doc_ids: np.ndarray) -> np.ndarray:
    """Positions that restart at 0 at each block's start and each document start."""
    k, L = doc_ids.shape
    new = np.ones_like(doc_ids, dtype=bool)
    new[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    flat = new.ravel()
    seg_start = np.flatnonzero(flat)
    index = np.cumsum(flat) - 1
    return (np.arange(k * L, dtype=np.int64) - seg_start[index]).reshape(k, L)


def cu_seqlens_of(doc_ids: np.ndarray) -> np.ndarray:
    """Segment boundaries of the flattened ``[k, L]`` blocks (int32, from 0 to ``k*L``), the
    form variable-length attention kernels take: a segment is one document's part of one
    block (padding belongs to the segment before it)."""
    k, L = doc_ids.shape
    new = np.ones_like(doc_ids, dtype=bool)
    new[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    return np.append(np.flatnonzero(new.ravel()), k * L).astype(np.int32)
