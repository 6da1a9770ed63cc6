"""Cutting a rank's stream into read requests (pure, no table)."""

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lance_ray.plan.splits import PlanSpec, SplitPlan
from lance_ray.read.batching import requests_for, selected_batches
from lance_ray.read.requests import FIRST_READ_ROWS, ReadSizing, read_sizes
from lance_ray.stream.order import stream_for


@pytest.mark.parametrize("chunk_rows", [1, 300, FIRST_READ_ROWS, 65536])
def test_read_sizes_grow_from_the_first_read_to_the_read_size(chunk_rows):
    sizes = list(itertools.islice(read_sizes(chunk_rows), 12))
    assert sizes[0] == min(chunk_rows, FIRST_READ_ROWS)
    assert all(b in (2 * a, chunk_rows) and b <= chunk_rows for a, b in zip(sizes, sizes[1:]))
    assert sizes[-1] == chunk_rows


def _plan(num_splits: int, split_len: int) -> SplitPlan:
    spec = PlanSpec(1, num_splits, True, 0, 0)
    rows = np.random.default_rng(0).permutation(num_splits * split_len).astype(np.uint64)
    return SplitPlan(spec, split_len, num_splits * split_len, "f",
                     rows.reshape(num_splits, split_len))


@settings(deadline=None, max_examples=60)
@given(split_len=st.integers(0, 3000), batch_size=st.integers(8, 700),
       num_workers=st.integers(1, 4), chunk_rows=st.integers(16, 9000),
       consumed=st.integers(0, 3000))
def test_requests_cover_exactly_the_samples_of_a_workers_batches(
        split_len, batch_size, num_workers, chunk_rows, consumed):
    plan = _plan(4, split_len)
    done = [min(consumed, split_len)] * 4
    stream = stream_for(range(4), done, done, split_len)
    for worker in range(num_workers):
        wanted = selected_batches(len(stream), batch_size, worker, num_workers)
        requests = list(requests_for(plan, stream, [(lo, hi) for _, lo, hi in wanted],
                                     ReadSizing(chunk_rows)))
        spans = [s for r in requests for s in r.spans]
        assert [i for lo, hi in spans for i in range(lo, hi)] == [
            i for _, lo, hi in wanted for i in range(lo, hi)]
        for r in requests:  # each request's row ids are its spans' samples, in order
            splits, positions = zip(*(stream.slice(lo, hi) for lo, hi in r.spans)) or ((), ())
            expect = plan.row_ids[np.concatenate(splits), np.concatenate(positions)]
            assert np.array_equal(r.row_ids, expect)
        sizes = [len(r.row_ids) for r in requests]
        ramp = list(itertools.islice(read_sizes(chunk_rows), len(sizes)))
        # A batch that fits in a read is never split over two: reads end early or grow to
        # hold it (a ramp read only to hold its one batch; a full read to an eighth over at
        # most). Longer batches are split as the ramp goes.
        grown = ReadSizing(chunk_rows).batch_rows
        assert all(n <= (grown if r == chunk_rows else max(r, min(batch_size, grown)))
                   for n, r in zip(sizes, ramp))
        if batch_size > grown:  # only the last, short batch may change the last two reads
            assert sizes[:-2] == ramp[:len(sizes) - 2]
        ends = {r.spans[-1][1] for r in requests}
        for _, lo, hi in wanted:
            if hi - lo <= grown:
                assert not any(lo < e < hi for e in ends)


@settings(deadline=None, max_examples=200)
@given(max_rows=st.integers(1, 100_000), row_bytes=st.integers(1, 4 << 20),
       target=st.integers(1, 64 << 20))
def test_reads_sized_by_bytes_stay_under_the_target_and_the_row_bound(max_rows, row_bytes,
                                                                      target):
    sizing = ReadSizing(max_rows, row_bytes, target)
    sizes = list(itertools.islice(sizing.sizes(), 24))
    assert all(1 <= s <= max_rows for s in sizes)
    # A read holds one row at least, and never more bytes than the target otherwise.
    assert all(s == 1 or s * row_bytes <= target for s in sizes)
    assert sizes[0] <= FIRST_READ_ROWS and sizes[-1] == sizing.steady_rows
    assert all(b in (2 * a, sizing.steady_rows) for a, b in zip(sizes, sizes[1:]))


def test_wide_rows_read_a_few_rows_at_a_time_narrow_rows_up_to_the_row_bound():
    wide = ReadSizing(65536, row_bytes=1 << 20)  # 1 MB rows: 16 MB reads, 4 MB first
    assert (wide.first_rows, wide.steady_rows) == (4, 16)
    narrow = ReadSizing(65536, row_bytes=276)  # the benchmark table
    assert narrow.first_rows == FIRST_READ_ROWS and narrow.steady_rows == 60_787
    assert ReadSizing(65536).steady_rows == 65536  # width unknown (remote): rows alone


@settings(deadline=None, max_examples=100)
@given(max_rows=st.integers(1, 100_000), row_bytes=st.integers(1, 1 << 20),
       share=st.floats(0.001, 1.0))
def test_a_streams_share_of_the_first_read_is_that_share_then_it_grows_as_a_whole_stream(
        max_rows, row_bytes, share):
    """A mixture's source reads its share of one table's first read first (the first batch
    waits for no more rows than one table's would), and then reads as one table does."""
    whole = ReadSizing(max_rows, row_bytes)
    part = ReadSizing(max_rows, row_bytes, first_share=share)
    sizes, whole_sizes = (list(itertools.islice(s.sizes(), 20)) for s in (part, whole))
    assert 1 <= sizes[0] == part.first_rows <= whole_sizes[0]
    assert sizes[0] == max(1, math.ceil(whole_sizes[0] * share))
    assert sizes == whole_sizes if sizes[0] == whole_sizes[0] else \
        sizes[1:] == whole_sizes[:-1]
