"""The one rule sizing how many reads run at once."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from lance_ray.read.concurrency import (
    FEWEST_TAKE_STREAMS,
    MOST_TAKE_STREAMS,
    take_streams,
    usable_cores,
)


def test_streams_follow_the_cores_within_bounds():
    assert take_streams(1, None, None) == FEWEST_TAKE_STREAMS
    assert take_streams(2, 16 << 20, 128 << 20) == 2  # the 2-core machine: as before
    assert take_streams(16, 16 << 20, 128 << 20) == 8  # the budget holds 8 reads
    assert take_streams(16, 4 << 20, 128 << 20) == 16
    assert take_streams(64, None, None) == MOST_TAKE_STREAMS


@given(cores=st.integers(1, 256), read=st.one_of(st.none(), st.integers(1, 1 << 30)),
       budget=st.one_of(st.none(), st.integers(1, 1 << 32)))
def test_streams_never_hold_more_than_the_budget_allows(cores, read, budget):
    n = take_streams(cores, read, budget)
    assert 1 <= n <= MOST_TAKE_STREAMS
    if read and budget:
        assert n == 1 or n * read <= budget
    else:
        assert n >= FEWEST_TAKE_STREAMS


def test_usable_cores_is_this_process_share():
    assert usable_cores() >= 1
