"""RankStream against a brute-force model of lancedb.streaming's per-process iteration.

Pure: no Ray, no Lance. The model below transcribes ``StreamingDataset._iter_owned`` of
lancedb 0.40.0 (row mode): every owned split reads from its resume position; if the
owned splits' sample counts differ, a min-heap on ``(count, split)`` first yields the
lagging splits until each reaches the largest count (returning as soon as a popped split
has no row left); then plain round-robin cycles, one row per owned split in ascending
split order, each cycle run only if every owned split still has a row. The model was
checked against the real lancedb 0.40.0 iterator on 60 random states (with and without
skipped rows) when this file was written.
"""

from __future__ import annotations

import heapq
from collections import Counter

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from lance_ray.stream.order import RankStream, stream_for

Pair = tuple[int, int]


def reference_order(
    splits: list[int], samples: list[int], positions: list[int], split_len: int
) -> list[Pair]:
    """(split, position) of every row lancedb.streaming yields from this progress."""
    n = len(splits)
    available = [split_len - p for p in positions]
    taken = [0] * n
    out: list[Pair] = []

    def has_row(i: int) -> bool:
        return taken[i] < available[i]

    def take(i: int) -> None:
        out.append((splits[i], positions[i] + taken[i]))
        taken[i] += 1

    if len(set(samples)) > 1:
        catch_up_to = max(samples)
        pending = [(samples[i], splits[i], i) for i in range(n) if samples[i] < catch_up_to]
        heapq.heapify(pending)
        while pending:
            consumed, _, i = heapq.heappop(pending)
            if not has_row(i):
                return out
            take(i)
            if consumed + 1 < catch_up_to:
                heapq.heappush(pending, (consumed + 1, splits[i], i))
    while n and all(has_row(i) for i in range(n)):
        for i in range(n):
            take(i)
    return out


def pairs(stream: RankStream, start: int, stop: int) -> list[Pair]:
    splits, positions = stream.slice(start, stop)
    assert splits.dtype == positions.dtype == np.int64
    return list(zip(splits.tolist(), positions.tolist()))


@st.composite
def rank_progress(draw, *, skips: bool = False, max_splits: int = 6, max_len: int = 9):
    """(splits, samples, positions, split_len) of one rank; positions == samples unless skips."""
    split_len = draw(st.integers(0, max_len))
    splits = sorted(draw(st.sets(st.integers(0, 24), max_size=max_splits)))
    samples = [draw(st.integers(0, split_len)) for _ in splits]
    if skips:
        positions = [s + draw(st.integers(0, split_len - s)) for s in samples]
    else:
        positions = list(samples)
    return splits, samples, positions, split_len


def stream_of(progress) -> RankStream:
    splits, samples, positions, split_len = progress
    return RankStream(tuple(splits), tuple(samples), tuple(positions), split_len)


@settings(max_examples=150, deadline=None)
@given(rank_progress())
@example(([0, 1, 2], [5, 5, 4], [5, 5, 4], 9))  # a checkpoint taken mid-cycle
@example(([3, 7], [0, 0], [0, 0], 4))  # a fresh start: plain round-robin
@example(([1, 2, 5], [9, 2, 9], [9, 2, 9], 9))  # only one split left to catch up
def test_whole_stream_is_reference_catch_up_then_round_robin(progress):
    stream = stream_of(progress)
    expected = reference_order(*progress)
    assert pairs(stream, 0, len(stream)) == expected
    assert len(stream) == len(expected)


@settings(max_examples=150, deadline=None)
@given(rank_progress())
def test_every_remaining_row_of_every_split_is_yielded_exactly_once(progress):
    splits, samples, _, split_len = progress
    stream = stream_of(progress)
    got = pairs(stream, 0, len(stream))
    wanted = {(sp, p) for sp, s in zip(splits, samples) for p in range(s, split_len)}
    assert len(got) == len(set(got))
    assert set(got) == wanted


@settings(max_examples=150, deadline=None)
@given(rank_progress(), st.data())
def test_advanced_counts_are_the_counts_of_the_consumed_prefix(progress, data):
    splits, samples, positions, split_len = progress
    stream = stream_of(progress)
    whole = pairs(stream, 0, len(stream))
    n = data.draw(st.integers(0, len(whole)), label="n")
    taken = Counter(split for split, _ in whole[:n])
    after = stream.advanced(n)
    assert after.splits == stream.splits
    assert after.split_len == split_len
    assert after.samples == tuple(s + taken[sp] for sp, s in zip(splits, samples))
    assert after.positions == tuple(p + taken[sp] for sp, p in zip(splits, positions))


@settings(max_examples=150, deadline=None)
@given(rank_progress(), st.data())
def test_resuming_from_advanced_progress_yields_exactly_the_rest(progress, data):
    stream = stream_of(progress)
    whole = pairs(stream, 0, len(stream))
    n = data.draw(st.integers(0, len(whole)), label="n")
    rest = stream.advanced(n)
    assert len(rest) == len(whole) - n
    assert pairs(rest, 0, len(rest)) == whole[n:]
    # The rest, as lancedb.streaming would resume it from the saved counts.
    assert reference_order(list(rest.splits), list(rest.samples), list(rest.positions),
                           rest.split_len) == whole[n:]


@settings(max_examples=150, deadline=None)
@given(rank_progress(), st.data())
def test_slice_equals_the_sublist_of_the_whole_stream(progress, data):
    stream = stream_of(progress)
    total = len(stream)
    whole = pairs(stream, 0, total)
    a = data.draw(st.integers(0, total + 2), label="a")
    b = data.draw(st.integers(0, total + 2), label="b")
    assert pairs(stream, a, b) == whole[a:b]


@settings(max_examples=150, deadline=None)
@given(rank_progress(skips=True), st.data())
def test_advancing_in_two_steps_equals_advancing_once(progress, data):
    stream = stream_of(progress)
    total = len(stream)
    n1 = data.draw(st.integers(0, total), label="n1")
    n2 = data.draw(st.integers(0, total - n1), label="n2")
    assert stream.advanced(n1).advanced(n2) == stream.advanced(n1 + n2)


@settings(max_examples=100, deadline=None)
@given(rank_progress(skips=True), st.data())
def test_advancing_past_the_end_or_backwards_is_refused(progress, data):
    stream = stream_of(progress)
    total = len(stream)
    with pytest.raises(ValueError, match="only"):
        stream.advanced(total + data.draw(st.integers(1, 5)))
    with pytest.raises(ValueError, match="negative"):
        stream.advanced(-data.draw(st.integers(1, 5)))
    assert stream.advanced(total).advanced(0) == stream.advanced(total)
    assert len(stream.advanced(total)) == 0


@settings(max_examples=100, deadline=None)
@given(rank_progress(skips=True), st.integers(1, 7))
def test_batches_tile_the_stream_in_order(progress, batch_size):
    stream = stream_of(progress)
    bounds = list(stream.batches(batch_size))
    assert [lo for lo, _ in bounds] == list(range(0, len(stream), batch_size))
    assert all(0 < hi - lo <= batch_size for lo, hi in bounds)
    joined = [p for lo, hi in bounds for p in pairs(stream, lo, hi)]
    assert joined == pairs(stream, 0, len(stream))


@settings(max_examples=150, deadline=None)
@given(rank_progress(skips=True))
@example(([0, 1, 2], [0, 0, 5], [0, 9, 5], 10))
def test_skip_state_resumes_exactly_as_the_reference(progress):
    """States with skipped rows (positions ahead of samples) come only from lancedb.

    The reference ends the catch-up at the first *popped* split that has run dry, so a
    split ordered before it at the same level still yields that level's row. Minimal
    case, checked against lancedb 0.40.0 itself (30 rows, 3 splits, shuffle=False):
    samples [0,0,5], positions [0,9,5] -> lancedb yields ids [0, 19, 1].
    """
    stream = stream_of(progress)
    assert pairs(stream, 0, len(stream)) == reference_order(*progress)


def test_stream_for_picks_the_owned_entries_of_the_full_lists():
    samples = [5, 6, 7, 8]
    positions = [5, 9, 7, 8]
    stream = stream_for([1, 2], samples, positions, 10)
    assert stream == RankStream((1, 2), (6, 7), (9, 7), 10)


def test_mismatched_progress_lengths_are_refused():
    with pytest.raises(ValueError, match="same length"):
        RankStream((0, 1), (0,), (0, 0), 3)
    with pytest.raises(ValueError, match="same length"):
        RankStream((0, 1), (0, 0), (0, 0, 0), 3)


def test_a_rank_without_splits_yields_nothing():
    stream = RankStream((), (), (), 5)
    assert len(stream) == 0
    assert pairs(stream, 0, 3) == []
    assert stream.advanced(0) == stream
