"""Grouped takes (several batches per hand-off) give exactly the one-at-a-time batches and
states, and a group never holds a made batch while it waits for a read."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from lance_ray.read.requests import ChunkResult
from lance_ray.stream.packed_order import RankPacker, progress_of
from lance_ray.stream.packing import PackConfig, SplitProgress
from lance_ray.view import packed_takes

docs_st = hs.lists(hs.lists(hs.integers(2, 99), max_size=12), min_size=1, max_size=25)


def make_packer(split_docs, L, per_split):
    split_len = min(len(d) for d in split_docs)
    return RankPacker(PackConfig(L, 1, 0, per_split), list(range(len(split_docs))),
                      [SplitProgress() for _ in split_docs], split_len), split_len


def feed_some(rp, split_docs, n):
    """Feed up to ``n`` more documents of every split (a level-order read)."""
    for k, docs in enumerate(split_docs):
        lo = rp.fed[k]
        chunk = docs[lo:min(lo + n, rp.split_len)]
        values = np.array([t for d in chunk for t in d], np.int64)
        offsets = np.cumsum([0] + [len(d) for d in chunk]).astype(np.int64)
        rp.feed(k, np.arange(lo, lo + len(chunk)), values, offsets)


def progress_key(lasts):
    """Every split's whole state (buffer tokens and document starts included)."""
    def listed(a):
        return None if a is None else np.asarray(a).tolist()

    out = []
    for last in lasts:
        p = progress_of(last)
        out.append((p.consumed, p.emitted, listed(p.tokens), listed(p.starts)))
    return out


@settings(max_examples=150, deadline=None)
@given(split_docs=hs.lists(docs_st, min_size=1, max_size=4), L=hs.integers(1, 7),
       per_split=hs.integers(1, 12), count=hs.integers(1, 5), group=hs.integers(1, 6),
       read=hs.integers(1, 4))
def test_grouped_takes_equal_single_takes_and_never_wait_holding_a_batch(
        split_docs, L, per_split, count, group, read):
    # The one-at-a-time sequence: batches and the state after each.
    single, _ = make_packer(split_docs, L, per_split)
    expected = []
    while len(single):
        while single.wants(count) is not None:
            feed_some(single, split_docs, read)
        blocks = single.take(count)
        expected.append((blocks.input_ids.tolist(), blocks.doc_ids.tolist(),
                         progress_key(single.last)))

    rp, _ = make_packer(split_docs, L, per_split)
    reads_at = []  # batches delivered when each read was made

    def fake_feed(packer, rows, chunk):
        reads_at.append(packer.delivered)
        feed_some(packer, split_docs, read)

    chunks = iter(lambda: ChunkResult(0, []), None)
    got = []
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(packed_takes, "feed_chunk", fake_feed)
        while True:
            before = rp.delivered
            made = packed_takes.take_group(rp, None, chunks, count, group)
            if not made:
                break
            assert len(made) <= group
            # This group's reads all came before its first batch was made.
            assert all(at == before for at in reads_at)
            reads_at.clear()
            got += [(b.input_ids.tolist(), b.doc_ids.tolist(), progress_key(snap))
                    for b, snap, _ in made]
    assert got == expected
