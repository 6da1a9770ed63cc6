"""The scalable plan (``plan="index"``): every row's shuffled position computed, never stored.

lancedb's permutation builder materialises and sorts every row id (about 80 bytes per row at
its peak, and it stops at about 2.5M shuffled rows). This mode computes the same kind of
plan from a seeded bijection instead:

* The table's rows, after the filter, are a dense *row space* ``0 .. N-1`` in row-id order.
  Without a filter or deletions a row space is only the fragments' ids and row counts, and
  position ``p`` is the row id ``(fragment_id << 32) | offset``. With a filter or deleted
  rows it also holds the matching rows' offsets (uint32, 4 bytes per matching row), listed
  once by scanning ``_rowid``.
* The shuffle is a keyed pseudo-random permutation of ``0 .. C-1`` over clumps (``C = N``
  without clumps): a Feistel network on the smallest power of two that is at least ``C``
  (halves of ``bits // 2`` and ``bits - bits // 2`` bits, trading widths every round when
  ``bits`` is odd), with cycle-walking (re-applying it until the value falls inside
  ``0 .. C-1``), which keeps it a bijection on ``0 .. C-1``. The round keys come from SHA-512
  of the epoch seed, so every process and platform computes the same order.
* As in the reference, the shuffled sequence is cut into ``num_splits`` equal runs (split k
  is shuffled indices ``k*q .. (k+1)*q-1``) and the last ``N mod num_splits`` are dropped.
  With clumps, the clumps are permuted and rows within a clump stay contiguous; the one
  short clump (when ``clump_size`` does not divide ``N``) sits wherever the permutation puts
  it.

So a plan is a few integers plus the row space: any slice of any split costs a few
vectorised numpy passes over the slice, and nothing per row is kept (except a filter's list).
"""

from __future__ import annotations

import functools
import hashlib
import weakref
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .splits import EPOCH_SEED_STRIDE, PlanSpec, SplitPlan

ROUNDS = 6
# A fixed name (not this module's path): it seeds the keys and every fingerprint, so it
# changes only when the order does.
ALGORITHM = "lance_ray.index_plan.feistel6.v1"
FINGERPRINT_POSITIONS = 8  # planned row ids of each split's first positions, hashed as a check
_C1 = np.uint64(0xBF58476D1CE4E5B9)
_C2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def _mask(bits: int) -> np.uint64:
    return np.uint64((1 << bits) - 1)


@dataclass(frozen=True)
class Feistel:
    """A keyed bijection of ``0 .. n-1`` (see the module docstring).

    The network works on ``bits = ceil(log2 n)`` bits split into halves of ``bits // 2``
    and ``bits - bits // 2`` bits; with an odd ``bits`` the halves trade widths every round
    (an alternating Feistel network, still a bijection). The domain is thus under ``2n``,
    so cycle-walking takes fewer than two passes on average.
    """

    n: int
    bits: int
    keys: tuple[int, ...]

    @classmethod
    def of(cls, n: int, seed: int) -> Feistel:
        if n < 1:
            raise ValueError(f"a permutation needs at least one element, got {n}")
        digest = hashlib.sha512(f"{ALGORITHM}:{seed}".encode()).digest()
        keys = tuple(int.from_bytes(digest[8 * i: 8 * i + 8], "little") for i in range(ROUNDS))
        return cls(n, max(2, (n - 1).bit_length()), keys)

    @staticmethod
    def _round(half: np.ndarray, key: int, width: int) -> np.ndarray:
        # splitmix64's finaliser of (half ^ key), cut to ``width`` bits: cheap and well mixed.
        x = half ^ np.uint64(key)
        x ^= x >> _S30
        x *= _C1
        x ^= x >> _S27
        x *= _C2
        x ^= x >> _S31
        x &= _mask(width)
        return x

    def _forward(self, x: np.ndarray) -> np.ndarray:
        wl, wr = self.bits // 2, self.bits - self.bits // 2
        left, right = x >> np.uint64(wr), x & _mask(wr)
        for key in self.keys:
            left ^= self._round(right, key, wl)
            left, right, wl, wr = right, left, wr, wl
        return (left << np.uint64(wr)) | right

    def _backward(self, y: np.ndarray) -> np.ndarray:
        wl, wr = self.bits // 2, self.bits - self.bits // 2
        if len(self.keys) % 2:
            wl, wr = wr, wl
        left, right = y >> np.uint64(wr), y & _mask(wr)
        for key in reversed(self.keys):
            right ^= self._round(left, key, wr)
            left, right, wl, wr = right, left, wr, wl
        return (left << np.uint64(wr)) | right

    def _walk(self, x: np.ndarray, step: Any) -> np.ndarray:
        out = step(np.asarray(x, dtype=np.uint64))
        n = np.uint64(self.n)
        outside = np.flatnonzero(out >= n)
        while outside.size:  # cycle-walking: each pass leaves under half of them behind
            out[outside] = step(out[outside])
            outside = outside[out[outside] >= n]
        return out

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """The images of ``x`` (values in ``0 .. n-1``), as uint64."""
        return self._walk(x, self._forward)

    def inverse(self, y: np.ndarray) -> np.ndarray:
        """The preimages of ``y``."""
        return self._walk(y, self._backward)


@dataclass(frozen=True)
class RowSpace:
    """The rows of a plan in row-id order: position ``p`` -> Lance row id.

    ``starts[i]`` is the first position in fragment ``fragment_ids[i]``; ``offsets`` (when
    not None) lists each position's offset inside its fragment (a filter or deletions),
    otherwise positions are dense offsets ``0 .. count-1``.
    """

    fragment_ids: np.ndarray  # int64, one per fragment with rows
    starts: np.ndarray  # int64, len(fragment_ids) + 1, starts[-1] == total
    offsets: np.ndarray | None = None  # uint32, one per position

    @property
    def total(self) -> int:
        return int(self.starts[-1])

    @functools.cached_property
    def _lookup(self) -> tuple[int, np.ndarray, np.ndarray]:
        """Buckets of ``2**shift`` positions (4 to 8 per fragment), the fragment where each
        bucket starts, and each fragment's row-id base (its id << 32)."""
        shift = max(0, (self.total // (4 * max(1, len(self.fragment_ids)))).bit_length() - 1)
        buckets = np.arange(0, self.total, 1 << shift, dtype=np.int64)
        first = np.searchsorted(self.starts, buckets, side="right") - 1
        return shift, first, self.fragment_ids.astype(np.uint64) << np.uint64(32)

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_lookup"}  # rebuilt on use

    def _fragments(self, pos: np.ndarray) -> np.ndarray:
        # A bucket lookup plus a step per fragment boundary inside the bucket: on shuffled
        # positions several times faster than a binary search (np.searchsorted).
        shift, first, _ = self._lookup
        frag = first[pos >> shift]
        late = np.flatnonzero(pos >= self.starts[frag + 1])
        while late.size:
            frag[late] += 1
            late = late[pos[late] >= self.starts[frag[late] + 1]]
        return frag

    def row_ids(self, positions: np.ndarray) -> np.ndarray:
        """Row ids (uint64) of ``positions``."""
        pos = np.asarray(positions, dtype=np.int64)
        frag = self._fragments(pos)
        if self.offsets is None:
            offset = (pos - self.starts[frag]).astype(np.uint64)
        else:
            offset = self.offsets[pos].astype(np.uint64)
        return self._lookup[2][frag] | offset

    def digest(self) -> bytes:
        h = hashlib.sha256()
        h.update(np.ascontiguousarray(self.fragment_ids, dtype="<i8").tobytes())
        h.update(np.ascontiguousarray(self.starts, dtype="<i8").tobytes())
        if self.offsets is not None:
            h.update(np.ascontiguousarray(self.offsets, dtype="<u4").tobytes())
        return h.digest()

    @property
    def nbytes(self) -> int:
        """Bytes held, the lookup tables included."""
        listed = 0 if self.offsets is None else self.offsets.nbytes
        _, first, bases = self._lookup
        return self.fragment_ids.nbytes + self.starts.nbytes + listed + first.nbytes + \
            bases.nbytes


@dataclass(frozen=True)
class ShuffledOrder:
    """Shuffled index ``j`` of the epoch -> row-space position (clumps kept contiguous)."""

    total: int
    clump: int  # 1 without clumps
    short_at: int  # shuffled clump index of the short clump (clumps when there is none)
    permutation: Feistel | None  # None: no shuffle (storage order)

    @classmethod
    def of(cls, total: int, spec: PlanSpec) -> ShuffledOrder:
        if not spec.shuffle:
            return cls(total, 1, total, None)
        clump = min(spec.shuffle_clump_size or 1, total)
        clumps = -(-total // clump)
        perm = Feistel.of(clumps, spec.shuffle_seed + spec.epoch * EPOCH_SEED_STRIDE)
        short = total % clump != 0
        short_at = int(perm.inverse(np.array([clumps - 1]))[0]) if short else clumps
        return cls(total, clump, short_at, perm)

    def positions(self, j: np.ndarray) -> np.ndarray:
        """Row-space positions (int64) of shuffled indices ``j``."""
        j = np.asarray(j, dtype=np.int64)
        if self.permutation is None:
            return j
        c = self.clump
        if c == 1:
            return self.permutation(j.astype(np.uint64)).astype(np.int64)
        # The clumps before the short one are full; after it, indices shift by its length.
        short_lo = self.short_at * c
        short_len = self.total - (self.total // c) * c
        after = j >= short_lo + short_len
        inside = (j >= short_lo) & ~after
        shifted = np.where(after, j - short_lo - short_len, j)
        u = np.where(after, self.short_at + 1 + shifted // c, j // c)
        offset = np.where(after, shifted % c, np.where(inside, j - short_lo, j % c))
        clump_ids = self.permutation(u.astype(np.uint64)).astype(np.int64)
        return clump_ids * c + offset


@dataclass(frozen=True)
class ComputedSplits:
    """Every split of a ``plan="index"`` plan, position -> row id on demand."""

    rows: RowSpace
    order: ShuffledOrder
    split_len: int

    def row_ids(self, splits: np.ndarray, positions: np.ndarray) -> np.ndarray:
        j = np.asarray(splits, dtype=np.int64) * self.split_len + np.asarray(positions,
                                                                               np.int64)
        return self.rows.row_ids(self.order.positions(j))

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes


def dense_row_space(fragments: list[tuple[int, int]]) -> RowSpace:
    """The row space of ``(fragment_id, rows)`` pairs with no deleted or filtered rows."""
    kept = [(f, n) for f, n in fragments if n > 0]
    ids = np.array([f for f, _ in kept], dtype=np.int64)
    starts = np.concatenate([[0], np.cumsum([n for _, n in kept], dtype=np.int64)])
    return RowSpace(ids, starts.astype(np.int64))


def listed_row_space(row_id_batches: Any) -> RowSpace:
    """The row space of the row ids yielded in uint64 arrays, in scan order.

    Holds 4 bytes per row (the offsets; one entry per run of a fragment), and twice that
    for a moment while the offsets are joined.
    """
    parts: list[np.ndarray] = []
    fragment_ids: list[int] = []
    starts: list[int] = []
    total = 0
    for batch in row_id_batches:
        ids = np.asarray(batch, dtype=np.uint64)
        if ids.size == 0:
            continue
        frag = (ids >> np.uint64(32)).astype(np.int64)
        changes = np.concatenate([[0], np.flatnonzero(np.diff(frag)) + 1])
        for at in changes.tolist():
            if at or not fragment_ids or fragment_ids[-1] != int(frag[0]):
                fragment_ids.append(int(frag[at]))
                starts.append(total + at)
        parts.append((ids & np.uint64(0xFFFFFFFF)).astype(np.uint32))
        total += ids.size
    offsets = np.concatenate(parts) if parts else np.empty(0, np.uint32)
    return RowSpace(np.array(fragment_ids, dtype=np.int64),
                    np.array([*starts, total], dtype=np.int64), offsets)


def row_space_of(dataset: Any, filter: str | None) -> RowSpace:
    """The row space of a ``lance.LanceDataset`` after ``filter``.

    Raises for tables with stable row ids, whose ``_rowid`` is not ``(fragment << 32) |
    offset``.
    """
    if getattr(dataset, "has_stable_row_ids", False):
        raise ValueError(
            "plan='index' maps positions to row addresses, but this table uses stable row "
            "ids; use plan='lancedb' (up to about 2.5M shuffled rows)"
        )
    fragments = dataset.get_fragments()
    if filter is None and not any(f.metadata.deletion_file is not None for f in fragments):
        return dense_row_space([(f.fragment_id, f.physical_rows) for f in fragments])
    scanner = dataset.scanner(columns=[], with_row_id=True, filter=filter, scan_in_order=True)
    return listed_row_space(b.column("_rowid").to_numpy() for b in scanner.to_batches())


def computed_plan(spec: PlanSpec, rows: RowSpace) -> SplitPlan:
    """The ``plan="index"`` plan of ``spec`` over ``rows``: O(num_splits) work and memory
    beyond ``rows`` itself."""
    total = rows.total
    if total < spec.num_splits:
        raise ValueError(
            f"num_splits ({spec.num_splits}) is larger than the number of rows ({total}); "
            "every split needs a row: use fewer splits"
        )
    split_len = total // spec.num_splits
    splits = ComputedSplits(rows, ShuffledOrder.of(total, spec), split_len)
    return SplitPlan(spec, split_len, total, index_fingerprint(spec, splits), None,
                     computed=splits)


def index_fingerprint(spec: PlanSpec, splits: ComputedSplits) -> str:
    """A hash of the plan's inputs, the algorithm, the row space and a sample of its rows."""
    h = hashlib.sha256(ALGORITHM.encode())
    h.update(repr(sorted(asdict(spec).items())).encode())
    h.update(splits.rows.digest())
    k = min(FINGERPRINT_POSITIONS, splits.split_len)
    s = np.repeat(np.arange(spec.num_splits, dtype=np.int64), k)
    p = np.tile(np.arange(k, dtype=np.int64), spec.num_splits)
    h.update(np.ascontiguousarray(splits.row_ids(s, p), dtype="<u8").tobytes())
    return h.hexdigest()[:16]


# The row spaces of the plans alive in this process, by dataset, version and filter: the
# next epoch's plan, built while this one's is read, shares its rows, instead of a second
# scan and a second array (4 bytes per matching row of a filtered table).
_row_spaces: weakref.WeakValueDictionary[tuple[str, int, str | None], RowSpace] = \
    weakref.WeakValueDictionary()


def build_index_plan(dataset: Any, spec: PlanSpec) -> SplitPlan:
    """The ``plan="index"`` plan of ``spec`` on a ``lance.LanceDataset`` at its version."""
    key = (dataset.uri, dataset.version, spec.filter)
    rows = _row_spaces.get(key)
    if rows is None:
        rows = _row_spaces[key] = row_space_of(dataset, spec.filter)
    return computed_plan(spec, rows)
