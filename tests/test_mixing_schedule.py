"""The mixture schedule (pure): exact proportions at every prefix, seekable, periodic."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lance_ray.stream.mixing import Schedule, end_step, integer_weights

weights_st = st.lists(st.integers(1, 40), min_size=1, max_size=7)


@settings(max_examples=200, deadline=None)
@given(weights_st, st.integers(0, 400))
def test_every_prefix_holds_each_source_within_one_sample_of_its_share(weights, extra):
    s = Schedule(weights)
    w = s.weights
    total = sum(w)
    seq = s.sources(0, s.period + extra).tolist()
    counts = [0] * len(w)
    for k, i in enumerate(seq, 1):
        counts[i] += 1
        for j, c in enumerate(counts):
            assert abs(c - Fraction(k * w[j], total)) < 1, (weights, k, counts)


@settings(max_examples=100, deadline=None)
@given(weights_st, st.integers(0, 3000), st.integers(0, 300))
def test_any_step_is_reachable_without_replaying_the_prefix(weights, start, n):
    s = Schedule(weights)
    whole = s.sources(0, start + n).tolist()
    assert Schedule(weights).sources(start, start + n).tolist() == whole[start:]
    assert s.counts(start) == [whole[:start].count(i) for i in range(len(weights))]


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(0.01, 10.0, allow_nan=False), min_size=2, max_size=4),
       st.integers(0, 500), st.integers(1, 200))
def test_long_periods_step_through_the_same_rule(weights, start, n):
    s = Schedule(weights)  # float weights: periods far above the tabulated size
    whole = s.sources(0, start + n).tolist()
    t = Schedule(weights)
    assert t.sources(start, start + n).tolist() == whole[start:]
    assert t.counts(start + n) == [whole.count(i) for i in range(len(weights))]
    w, total = s.weights, sum(s.weights)
    counts = [0] * len(w)
    for k, i in enumerate(whole, 1):
        counts[i] += 1
        assert all(abs(c - Fraction(k * w[j], total)) < 1 for j, c in enumerate(counts))


@settings(max_examples=100, deadline=None)
@given(weights_st, st.data())
def test_first_exhausted_ends_where_the_first_source_would_run_dry(weights, data):
    s = Schedule(weights)
    remaining = [data.draw(st.integers(0, 60)) for _ in weights]
    end = end_step(s, remaining, stop="first_exhausted")
    counts = s.counts(end)
    assert all(c <= r for c, r in zip(counts, remaining))
    nxt = int(s.sources(end, end + 1)[0])
    assert counts[nxt] == remaining[nxt]  # the next step's source has nothing left
    end_all = end_step(s, remaining, stop="all_exhausted")
    counts = s.counts(end_all)
    assert all(c >= r for c, r in zip(counts, remaining))
    if end_all:
        before = s.counts(end_all - 1)
        assert any(c < r for c, r in zip(before, remaining))


def test_weights_are_exact_and_bad_ones_are_named():
    assert integer_weights([0.7, 0.2, 0.1]) == (7, 2, 1)
    assert integer_weights([14, 4, 2]) == (7, 2, 1)
    # Computed floats are their 12-digit decimals; numpy numbers are numbers.
    assert integer_weights([0.1 + 0.2, 0.7]) == (3, 7)
    assert integer_weights([np.float32(0.3), np.int64(7) / 10]) == (3, 7)
    assert integer_weights([np.int64(14), np.uint8(4), Fraction(2)]) == (7, 2, 1)
    for bad in ([0, 1], [-1.0], [float("nan")], [float("inf")], ["3"], [True], [np.bool_(True)],
                []):
        with pytest.raises(ValueError):
            integer_weights(bad)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=2, max_size=4), st.integers(1, 300),
       st.integers(1, 5), st.integers(0, 2**31 - 1))
def test_a_mixed_batch_puts_every_row_at_its_step_joined_or_part_by_part(weights, size,
                                                                         cuts, seed):
    """Small columns are joined before one scatter, large ones scattered part by part: both
    put row k of source i at the k-th step that takes source i."""
    import numpy as np
    import torch

    from lance_ray.read.convert import Columns
    from lance_ray.view import mix_batches

    sources = Schedule(integer_weights(weights)).sources(seed % 1000, seed % 1000 + size)
    rng = np.random.default_rng(seed)
    parts: list[list[Columns]] = []
    for i in range(len(weights)):
        n = int((sources == i).sum())
        bounds = sorted({0, n, *rng.integers(0, n + 1, cuts).tolist()})
        parts.append([Columns({"id": torch.arange(lo, hi) * 10 + i,
                               "v": torch.full((hi - lo, 3), float(i))}, hi - lo, 0)
                      for lo, hi in zip(bounds[:-1], bounds[1:]) if hi > lo])
    want = np.empty(size, dtype=np.int64)
    for i in range(len(weights)):
        want[sources == i] = np.arange(int((sources == i).sum())) * 10 + i
    for join_bytes in (0, 1 << 20):
        mix_batches.JOIN_BYTES = join_bytes
        try:
            out = mix_batches.scattered(parts, sources)
        finally:
            mix_batches.JOIN_BYTES = 1 << 20
        assert out is not None
        assert out["id"].tolist() == want.tolist()
        assert out["v"][:, 0].tolist() == sources.astype(float).tolist()


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 9), min_size=2, max_size=4), st.integers(1, 40),
       st.integers(1, 6), st.integers(1, 200), st.booleans(), st.integers(0, 2**31 - 1))
def test_a_run_of_batches_assembled_at_once_gives_the_batches_made_one_by_one(
        weights, batch, n_batches, run_rows, ragged, seed):
    """Narrow rows: consecutive batches are put in step order with one scatter and cut
    into views; the batches equal those made one at a time (and with a list column, which
    the run assembles batch by batch). ``runs`` keeps every batch once, in order, within
    ``run_rows`` samples a run, and never runs a batch that changes a source's pass."""
    import numpy as np
    import torch

    from lance_ray.read.convert import Columns
    from lance_ray.view import mix_batches

    schedule = Schedule(integer_weights(weights))
    left = [int(x) for x in np.random.default_rng(seed).integers(1, 30, len(weights))]
    plan = list(mix_batches.plan_batches(schedule, 0, batch * n_batches, batch, left,
                                         [30] * len(weights), [0] * len(weights)))
    groups = list(mix_batches.runs(iter(plan), run_rows))
    assert [mb for g in groups for mb in g] == plan
    for g in groups:
        if len(g) > 1:
            assert sum(len(mb.sources) for mb in g) <= run_rows
            assert all(len(s) <= 1 for mb in g for s in mb.segments)
            passes = {(i, s[0][0]) for mb in g for i, s in enumerate(mb.segments) if s}
            assert len(passes) == len({i for i, _ in passes})

    def rows(i: int, pass_no: int, lo: int, hi: int) -> Columns:
        ids = torch.arange(lo, hi) + 1000 * i + 100 * pass_no
        data = {"id": ids, "v": ids[:, None].float().repeat(1, 2)}
        if ragged:
            data["name"] = [f"{i}:{x}" for x in ids.tolist()]
        return Columns(data, hi - lo, 0)

    def parts_of(batches: list) -> tuple[list[list[Columns]], list[list[int]]]:
        parts: list[list[Columns]] = [[] for _ in weights]
        counts = [[0] * len(batches) for _ in weights]
        for k, mb in enumerate(batches):
            for i, segments in enumerate(mb.segments):
                for pass_no, lo, hi in segments:
                    # cut at an arbitrary point, as reads are
                    mid = (lo + hi) // 2
                    parts[i] += [rows(i, pass_no, a, b) for a, b in ((lo, mid), (mid, hi))
                                 if b > a]
                    counts[i][k] += hi - lo
        return parts, counts

    for g in groups:
        parts, counts = parts_of(g)
        got = mix_batches.mixed_run(parts, counts, [mb.sources for mb in g])
        assert len(got) == len(g)
        for mb, out in zip(g, got):
            one, _ = parts_of([mb])
            want = mix_batches.mixed_batch(one, mb.sources, None)
            assert out.keys() == want.keys()
            for key in want:
                a, b = out[key], want[key]
                assert (a.tolist() if isinstance(a, torch.Tensor) else a) == \
                    (b.tolist() if isinstance(b, torch.Tensor) else b), key


@settings(max_examples=200, deadline=None)
@given(weights_st, st.integers(1, 300))
def test_step_bounds_hold_every_draw(weights, count):
    s = Schedule(weights)
    for i in range(len(s.weights)):
        lo, hi = s.step_bounds(i, count)
        assert lo <= s.step_of(i, count) <= hi


def test_a_tiny_weight_far_from_the_end_is_never_walked_to():
    """A source drawn once in a billion steps, with many samples left, cannot end a phase
    that another source ends within 100 steps: the end is found without walking the
    schedule to that source's next draw (a billion steps)."""
    s = Schedule(integer_weights([1e-9, 1]))
    assert s.period == 10**9 + 1
    assert end_step(s, [10**6, 100], stop="first_exhausted") == s.step_of(1, 101) == 100
    assert end_step(s, [0, 100], stop="all_exhausted") == 100
