"""Packed reads arranged in the read task (``lance_ray.read.documents``): what the consumer
slices out of them is exactly each split's documents, joined, in the request's order."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from lance_ray.read.documents import DocumentReads, split_runs
from lance_ray.read.requests import ChunkRequest
from lance_ray.stream.packing import documents, join_documents

EOS = 1


def _docs(lengths: list[int], seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(2, 50, n).tolist() for n in lengths]


@settings(max_examples=60, deadline=None)
@given(lengths=hs.lists(hs.integers(0, 9) | hs.integers(30, 90), min_size=1, max_size=40),
       seed=hs.integers(0, 2**16), num_splits=hs.integers(1, 5), sliced=hs.booleans(),
       cuts=hs.lists(hs.integers(0, 40), max_size=3))
def test_each_split_run_is_its_documents_joined_in_request_order(lengths, seed, num_splits,
                                                                 sliced, cuts):
    # Short and long documents: both ways of joining them (Arrow take, one copy per run).
    rng = np.random.default_rng(seed)
    docs = _docs(lengths, seed)  # request order
    splits = rng.integers(0, num_splits, len(docs)).astype(np.int32)
    # The read comes back in address order; ``inverse`` puts it back in request order.
    address_order = rng.permutation(len(docs))
    inverse = np.empty_like(address_order)
    inverse[address_order] = np.arange(len(docs))
    column = pa.array([docs[i] for i in address_order], pa.list_(pa.int32()))
    if sliced:  # an Arrow slice: offsets that do not start at 0
        column = pa.concat_arrays([pa.array([[7, 7, 7]], pa.list_(pa.int32())), column])[1:]
    # A read comes in chunks, one per fragment.
    bounds = sorted({0, len(docs), *(min(c, len(docs)) for c in cuts)})
    batch = pa.Table.from_batches(
        [pa.RecordBatch.from_arrays([column.slice(a, b - a)], ["tokens"])
         for a, b in zip(bounds, bounds[1:])])
    request = ChunkRequest(((0, len(docs)),), np.arange(len(docs), dtype=np.uint64), splits)

    arranged = DocumentReads(EOS).arrange(batch, inverse, request)
    runs = list(split_runs(arranged))

    assert [r.split for r in runs] == sorted(set(splits.tolist()))
    assert runs[0].lo == 0 and runs[-1].hi == len(docs)
    for run in runs:
        mine = [docs[i] for i in np.flatnonzero(splits == run.split)]
        values, offsets = documents(pa.array(mine, pa.list_(pa.int32())))
        stream, starts = join_documents(values, offsets, EOS)
        assert run.hi - run.lo == len(mine)
        np.testing.assert_array_equal(run.stream, stream)
        np.testing.assert_array_equal(run.starts, starts)


def test_rows_already_in_request_order_need_no_inverse():
    batch = pa.RecordBatch.from_arrays([pa.array([[5], [6, 7]], pa.list_(pa.int64()))],
                                       ["tokens"])
    request = ChunkRequest(((3, 5),), np.array([0, 1], np.uint64), np.array([2, 2], np.int32))
    (run,) = split_runs(DocumentReads(EOS).arrange(batch, None, request))
    assert (run.split, run.stream.tolist(), run.starts.tolist()) == (2, [5, 1, 6, 7, 1], [0, 2])


@pytest.mark.parametrize("request_", [
    ChunkRequest(((0, 2),), np.array([0, 1], np.uint64)),  # no splits
    ChunkRequest(((0, 1), (4, 5)), np.array([0, 1], np.uint64), np.array([0, 1], np.int32)),
], ids=["without splits", "two spans"])
def test_a_read_that_cannot_be_regrouped_is_refused(request_):
    batch = pa.RecordBatch.from_arrays([pa.array([[5], [6]], pa.list_(pa.int64()))], ["tokens"])
    with pytest.raises(ValueError, match="one span and its rows' splits"):
        DocumentReads(EOS).arrange(batch, None, request_)


@pytest.mark.parametrize("kind,eos", [(pa.int32(), EOS), (pa.int16(), 40_000), (pa.uint64(), 3)],
                         ids=["int32 kept", "eos wider than int16", "uint64 widened"])
def test_long_documents_are_copied_run_by_run_and_widened_only_when_needed(kind, eos):
    docs = _docs([40, 0, 90, 35], seed=3)  # mean above RUN_COPY_MIN_TOKENS
    batch = pa.RecordBatch.from_arrays([pa.array(docs, pa.list_(kind))], ["tokens"])
    request = ChunkRequest(((0, 4),), np.arange(4, dtype=np.uint64),
                           np.array([1, 0, 1, 0], np.int32))
    runs = {r.split: r for r in split_runs(DocumentReads(eos).arrange(batch, None, request))}
    for split, picked in ((0, [1, 3]), (1, [0, 2])):
        want = [t for i in picked for t in (*docs[i], eos)]
        assert runs[split].stream.tolist() == want
        assert runs[split].starts.tolist() == [0, len(docs[picked[0]]) + 1]
    assert runs[0].stream.dtype == {"int32": np.int32}.get(str(kind), np.int64)
