"""A split's pack buffer rebuilt from the documents it came from (pure numpy, no I/O).

After any block, a split's buffer is the tail of its stream up to the end of the last
document consumed (see :mod:`lance_ray.stream.packing`), so its length alone says which
tokens it holds. The coordinator therefore keeps one integer per split, never the tokens,
and reads the last consumed documents back when it hands out a state. The stream starts
with the buffer of the state the epoch resumed from (``base``), then the split's documents
from ``base.consumed`` on, each followed by ``eos_id``.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..state.packed import SplitProgress
from .packing import join_documents

# ``read(lo, hi)``: the split's documents ``[lo, hi)`` in permutation order, as
# ``(values, offsets)`` (``packing.documents``).
ReadDocuments = Callable[[int, int], tuple[np.ndarray, np.ndarray]]

FIRST_READ = 4  # documents read back first; a buffer usually lies within the last one


def rebuild_buffer(base: SplitProgress, consumed: int, emitted: int, length: int,
                   read: ReadDocuments, eos_id: int) -> SplitProgress:
    """The split's state with ``consumed`` documents and ``emitted`` blocks whose buffer
    holds ``length`` tokens (-1: no buffer), its tokens and starts read back with ``read``.

    Raises ``ValueError`` if the stream since ``base`` holds fewer than ``length`` tokens:
    the progress did not come from this split's stream.
    """
    if length < 0:
        return SplitProgress(consumed, emitted)
    if consumed < base.consumed:
        raise ValueError(f"a split reported {consumed} documents consumed, fewer than the "
                         f"{base.consumed} of the state its epoch resumed from")
    pieces: list[tuple[np.ndarray, np.ndarray]] = []  # (tokens, starts), newest first
    have, hi, count = 0, consumed, FIRST_READ
    while have < length and hi > base.consumed:
        lo = max(base.consumed, hi - count)
        pieces.append(join_documents(*read(lo, hi), eos_id))
        have += len(pieces[-1][0])
        hi, count = lo, count * 2
    if have < length and base.tokens is not None:
        starts = base.starts if base.starts is not None else np.empty(0, np.int64)
        pieces.append((np.asarray(base.tokens, np.int64), np.asarray(starts, np.int64)))
        have += len(base.tokens)
    if have < length:
        raise ValueError(f"a split reported a pack buffer of {length} tokens, but its stream "
                         f"holds {have} after the resumed state; the progress is corrupt")
    pieces.reverse()
    at = np.cumsum([0] + [len(t) for t, _ in pieces])
    stream = np.concatenate([t for t, _ in pieces] or [np.empty(0, np.int64)])
    starts = np.concatenate([s + a for (_, s), a in zip(pieces, at)] or [np.empty(0, np.int64)])
    lo = len(stream) - length
    return SplitProgress(consumed, emitted, stream[lo:].astype(np.int64),
                         starts[starts >= lo] - lo)
