"""Pure bookkeeping of the drop-in: the survivor order when failed rows drop out of their
splits, and what one rank's progress says about every other rank's (lockstep states)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from lance_ray.stream.cursor import lockstep_progress
from lance_ray.stream.order import stream_for
from lance_ray.stream.survivors import Interleaver


def survivor_model(samples, positions, split_len, survives):
    """The order spelled out directly: lagging splits catch up one sample at a time (lowest
    count, then lowest split), then whole cycles while every split has a survivor left."""
    queues = [[p for p in range(positions[i], split_len) if survives[i][p]]
              for i in range(len(samples))]
    counts, out = list(samples), []
    top = max(counts)
    while True:
        lagging = [(counts[i], i) for i in range(len(counts)) if counts[i] < top]
        if not lagging:
            break
        _, i = min(lagging)
        if not queues[i]:
            return out
        out.append((i, queues[i].pop(0)))
        counts[i] += 1
    while all(queues):
        for i, q in enumerate(queues):
            out.append((i, q.pop(0)))
    return out


@st.composite
def split_progress(draw):
    splits = draw(st.integers(1, 5))
    split_len = draw(st.integers(1, 12))
    positions = [draw(st.integers(0, split_len)) for _ in range(splits)]
    samples = [draw(st.integers(0, p)) for p in positions]
    survives = [[draw(st.booleans()) if draw(st.integers(0, 3)) == 0 else True
                 for _ in range(split_len)] for _ in range(splits)]
    return samples, positions, split_len, survives


@settings(max_examples=400, deadline=None)
@given(progress=split_progress(), data=st.data())
def test_survivor_order_is_the_model_whatever_order_and_grouping_rows_arrive_in(
        progress, data):
    samples, positions, split_len, survives = progress
    pending = [[(i, p) for p in range(positions[i], split_len)] for i in range(len(samples))]
    order = Interleaver(range(len(samples)), samples, positions, split_len)
    got = []
    while any(pending):
        i = data.draw(st.sampled_from([k for k, rows in enumerate(pending) if rows]))
        split, position = pending[i].pop(0)  # each split's rows arrive in position order
        order.feed(split, position, (split, position), not survives[split][position])
        if data.draw(st.booleans()):
            got += [item for _, _, item in order.ready()]
    got += [item for _, _, item in order.ready()]
    assert order.finished
    assert got == survivor_model(samples, positions, split_len, survives)
    for split, position in got:  # progress: samples yielded, one past the last position
        assert order.positions[split] >= position + 1
    assert order.samples == [samples[i] + sum(1 for s, _ in got if s == i)
                             for i in range(len(samples))]


def test_progress_of_a_lockstep_run_follows_from_any_one_rank():
    # 8 splits, 2 ranks of 4, from the epoch's start, 6 samples delivered by each rank.
    zeros = [0] * 8
    derived = lockstep_progress((zeros, zeros), [4, 5, 6, 7], 8, 10, 6)
    assert derived == ([2, 2, 1, 1, 2, 2, 1, 1], [2, 2, 1, 1, 2, 2, 1, 1])
    assert lockstep_progress((zeros, zeros), [0, 1, 2, 3], 8, 10, 6) == derived


@settings(max_examples=200, deadline=None)
@given(data=st.data())
def test_lockstep_progress_is_each_ranks_own_progress_after_as_many_samples(data):
    width = data.draw(st.sampled_from([1, 2, 3]))
    ranks = data.draw(st.integers(1, 4))
    split_len = data.draw(st.integers(1, 8))
    n = width * ranks
    origin = [data.draw(st.integers(0, split_len)) for _ in range(n)]
    unit = data.draw(st.integers(0, ranks - 1))
    streams = [stream_for(range(r * width, (r + 1) * width), origin, origin, split_len)
               for r in range(ranks)]
    delivered = data.draw(st.integers(0, len(streams[unit])))
    derived = lockstep_progress((origin, origin), range(unit * width, (unit + 1) * width), n,
                                split_len, delivered)
    lengths = [len(s) for s in streams]
    if delivered < min(lengths) or len(set(lengths)) == 1:
        assert derived is not None
        for s in streams:  # every rank's splits are where that rank would be
            done = s.advanced(delivered)
            assert [derived[0][k] for k in s.splits] == list(done.samples)
    else:  # some rank ran out earlier: equal deliveries are not implied
        assert derived is None


def test_progress_of_a_layout_that_is_not_contiguous_blocks_is_not_derived():
    zeros = [0] * 6
    assert lockstep_progress((zeros, zeros), [0, 2], 6, 5, 1) is None
    assert lockstep_progress((zeros, zeros), [1, 2], 6, 5, 1) is None
