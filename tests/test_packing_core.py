"""The numpy packer cuts exactly the blocks (and states) of the packing semantics.

The oracle here is a token-by-token model written from the reference's documented
semantics (fill a split's buffer document by document while it is short of a block, then
emit one block); the dataset-level tests compare with ``lancedb.streaming`` itself.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from lance_ray.stream.packing import (
    PackConfig,
    SplitPacker,
    SplitProgress,
    cu_seqlens_of,
    documents,
    position_ids_of,
    token_count,
)
from lance_ray.stream.rebuild import rebuild_buffer


def model_blocks(docs, L, eos, pad, budget, consumed=0, emitted=0, tokens=(), starts=()):
    """(input_ids, doc_ids, consumed, buffer tokens, buffer starts) after each block."""
    tokens, starts, pos, out = list(tokens), list(starts), consumed, []
    for _ in range(budget - emitted):
        while len(tokens) < L and pos < len(docs):
            starts.append(len(tokens))
            tokens.extend(list(docs[pos]) + [eos])
            pos += 1
        tokens.extend([pad] * (L - len(tokens)))
        doc_ids, current = [], 0
        for p in range(L):
            current += p > 0 and p in starts
            doc_ids.append(current)
        tokens, block = tokens[L:], tokens[:L]
        starts = [s - L for s in starts if s >= L]
        out.append((block, doc_ids, pos, list(tokens), list(starts)))
    return out


docs_st = hs.lists(hs.lists(hs.integers(2, 99), max_size=12), max_size=25)


@settings(max_examples=300, deadline=None)
@given(docs=docs_st, L=hs.integers(1, 9), budget=hs.integers(0, 30), data=hs.data())
def test_packer_matches_the_token_by_token_model(docs, L, budget, data):
    cfg = PackConfig(L, 1, 0, budget)
    start = data.draw(hs.integers(0, len(docs)))
    carried = data.draw(hs.lists(hs.integers(2, 99), max_size=2 * L))
    starts = sorted(data.draw(hs.sets(hs.integers(0, max(0, len(carried) - 1)), max_size=3))
                    ) if carried else []
    expected = model_blocks(docs, L, 1, 0, budget, consumed=start, tokens=carried,
                            starts=starts)
    packer = SplitPacker.resume(cfg, SplitProgress(start, 0, np.array(carried, np.int64),
                                                   np.array(starts, np.int64)))
    got, fed = [], start
    while len(got) < budget:
        ready = packer.ready()
        if ready == 0:
            n = data.draw(hs.integers(1, 5))
            chunk = docs[fed:fed + n]
            values = np.array([t for d in chunk for t in d], np.int64)
            offsets = np.cumsum([0] + [len(d) for d in chunk]).astype(np.int64)
            fed += len(chunk)
            packer.feed(values, offsets, last=fed >= len(docs))
            continue
        cut = packer.cut(data.draw(hs.integers(1, ready)))
        for j in range(len(cut)):
            p = cut.progress_after(j + 1)
            assert cut.counts_after(j + 1) == p.counts()  # what views report, uncopied
            got.append((cut.input_ids[j].tolist(), cut.doc_ids[j].tolist(), p.consumed,
                        p.tokens.tolist(), p.starts.tolist()))
        s = packer.state()
        assert (s.consumed, s.tokens.tolist(), s.starts.tolist()) == got[-1][2:]
        assert s.emitted == len(got)
    assert got == expected


def test_documents_reads_list_offsets_of_sliced_and_fixed_size_columns():
    col = pa.array([[5, 6], [], [7], [8, 9, 10]], pa.list_(pa.int32())).slice(1, 3)
    values, offsets = documents(col)
    assert values.tolist() == [7, 8, 9, 10] and offsets.tolist() == [0, 0, 1, 4]
    fixed = pa.array([[1, 2], [3, 4]], pa.list_(pa.int64(), 2))
    assert documents(fixed)[1].tolist() == [0, 2, 4]
    assert token_count(col) == 4 + 3


def test_null_token_lists_are_refused_with_the_fix():
    import pytest

    with pytest.raises(ValueError, match="null token"):
        documents(pa.array([[1], None], pa.list_(pa.int64())))


def test_position_ids_and_cu_seqlens_follow_doc_ids():
    doc_ids = np.array([[0, 0, 1, 1, 1], [0, 1, 2, 2, 2]])
    assert position_ids_of(doc_ids).tolist() == [[0, 1, 0, 1, 2], [0, 0, 0, 1, 2]]
    assert cu_seqlens_of(doc_ids).tolist() == [0, 2, 5, 6, 7, 10]


@settings(max_examples=200, deadline=None)
@given(split_docs=hs.lists(docs_st, min_size=1, max_size=4), L=hs.integers(1, 7),
       per_split=hs.integers(0, 12), data=hs.data())
def test_rank_packer_yields_one_block_per_split_per_cycle_with_exact_states(
        split_docs, L, per_split, data):
    from lance_ray.stream.packed_order import RankPacker

    split_len = min(len(d) for d in split_docs)
    split_docs = [d[:split_len] for d in split_docs]
    models = [model_blocks(d, L, 1, 0, per_split) for d in split_docs]
    expected = [models[t % len(models)][t // len(models)]
                for t in range(per_split * len(models))]
    rp = RankPacker(PackConfig(L, 1, 0, per_split), list(range(len(split_docs))),
                    [SplitProgress() for _ in split_docs], split_len)
    got = []
    while len(rp):
        count = data.draw(hs.integers(1, 5))
        while (i := rp.wants(count)) is not None:
            # Level-order reads: a few documents of every split at once.
            n = data.draw(hs.integers(1, 4))
            for k, docs in enumerate(split_docs):
                lo = rp.fed[k]
                chunk = docs[lo:lo + n]
                values = np.array([t for d in chunk for t in d], np.int64)
                offsets = np.cumsum([0] + [len(d) for d in chunk]).astype(np.int64)
                rp.feed(k, np.arange(lo, lo + len(chunk)), values, offsets)
            assert rp.fed[i] <= split_len
        blocks = rp.take(count)
        for j in range(len(blocks)):
            got.append((blocks.input_ids[j].tolist(), blocks.doc_ids[j].tolist()))
        if rp.aligned and rp.delivered:
            cycle = rp.delivered // len(split_docs) - 1
            for k, p in enumerate(rp.progress()):
                _, _, consumed, tokens, starts = models[k][cycle]
                assert (p.consumed, p.emitted, p.tokens.tolist(), p.starts.tolist()) == (
                    consumed, cycle + 1, tokens, starts)
    assert got == [(ids, doc) for ids, doc, *_ in expected]


def test_blocks_of_hundreds_of_documents_number_them_all():
    """Document starts are kept as int8 marks; their sum (the doc_ids) is never int8."""
    from lance_ray.stream.packed_order import RankPacker

    docs = [[5]] * 1500  # with eos, 2 tokens each: 1,024 documents per 2,048-token block
    L, split_len = 2048, len(docs)
    rp = RankPacker(PackConfig(L, 1, 0, 2), [0, 1], [SplitProgress()] * 2, split_len)
    values = np.full(split_len, 5, np.int64)
    offsets = np.arange(split_len + 1, dtype=np.int64)
    for k in (0, 1):
        rp.feed(k, np.arange(split_len), values, offsets)
    assert rp.wants(4) is None
    blocks = rp.take(4)  # rows: each split's first block, then each split's second
    full = np.repeat(np.arange(L // 2), 2)
    assert blocks.doc_ids.dtype == np.int64
    for j in (0, 1):
        assert blocks.doc_ids[j].tolist() == full.tolist()
    for j in (2, 3):  # the other 476 documents, then padding (keeping the last id)
        assert blocks.doc_ids[j, :952].tolist() == full[:952].tolist()
        assert set(blocks.doc_ids[j, 952:].tolist()) == {475}


def test_rank_packer_refuses_splits_at_different_blocks():
    import pytest

    from lance_ray.stream.packed_order import RankPacker

    with pytest.raises(ValueError, match="merge_state_dicts"):
        RankPacker(PackConfig(4, 1, 0, 3), [0, 1], [SplitProgress(2, 1), SplitProgress(1, 0)], 5)


@settings(max_examples=300, deadline=None)
@given(docs=docs_st, L=hs.integers(1, 9), budget=hs.integers(1, 30), data=hs.data())
def test_every_buffer_is_rebuilt_from_its_length_and_the_documents_consumed(docs, L, budget,
                                                                           data):
    start = data.draw(hs.integers(0, len(docs)))
    carried = data.draw(hs.lists(hs.integers(2, 99), max_size=2 * L))
    starts = sorted(data.draw(hs.sets(hs.integers(0, max(0, len(carried) - 1)), max_size=3))
                    ) if carried else []
    base = SplitProgress(start, 0, np.array(carried, np.int64), np.array(starts, np.int64))
    reads = []

    def read(lo, hi):
        reads.append((lo, hi))
        chunk = docs[lo:hi]
        return (np.array([t for d in chunk for t in d], np.int64),
                np.cumsum([0] + [len(d) for d in chunk]).astype(np.int64))

    blocks = model_blocks(docs, L, 1, 0, budget, consumed=start, tokens=carried,
                          starts=starts)
    for emitted, (_, _, consumed, tokens, token_starts) in enumerate(blocks, 1):
        got = rebuild_buffer(base, consumed, emitted, len(tokens), read, eos_id=1)
        assert (got.consumed, got.emitted, got.tokens.tolist(), got.starts.tolist()) == (
            consumed, emitted, tokens, token_starts)
    assert all(start <= lo < hi <= len(docs) for lo, hi in reads)  # only consumed documents
    assert rebuild_buffer(base, start, 0, -1, read, 1).tokens is None
    with pytest.raises(ValueError, match="corrupt"):
        rebuild_buffer(base, start, 0, len(carried) + 1, read, eos_id=1)
