"""The exactly-once report counts a multiset: identical blocks (all padding) must appear as
often as planned, and unique ids keep their set semantics."""

from __future__ import annotations

from collections import Counter

from hypothesis import given
from hypothesis import strategies as st

from lance_ray.proof.verify import compare_steps, coverage

ids = st.lists(st.integers(0, 30), max_size=60)


@given(st.sets(st.integers(0, 30)), ids, ids)
def test_unique_planned_ids_are_counted_as_a_set(planned, before, after):
    report = coverage(planned, before, after)
    seen = Counter(before + after)
    assert report.planned == len(planned)
    assert report.duplicates == sum(c - 1 for c in seen.values())
    assert report.lost == len(planned - seen.keys())
    assert report.unexpected == len(seen.keys() - planned)


@given(ids, st.randoms(use_true_random=False))
def test_a_permutation_of_the_planned_multiset_is_exactly_once(planned, rnd):
    consumed = list(planned)
    rnd.shuffle(consumed)
    cut = rnd.randint(0, len(consumed))
    report = coverage(planned, consumed[:cut], consumed[cut:])
    assert report.exactly_once and report.before + report.after == report.planned


def test_a_repeated_block_missing_once_is_one_loss_and_one_extra_is_a_duplicate():
    planned = [7, 7, 7, 1]
    assert coverage(planned, [], [7, 7, 1]).lost == 1
    report = coverage(planned, [7, 7], [7, 7, 1])
    assert (report.duplicates, report.lost) == (1, 0)


def test_steps_compare_as_multisets():
    report = compare_steps(coverage([1, 1, 2], [], [1, 2, 1]), [[1, 1], [2]], [[1, 1], [2]])
    assert report.steps_identical
    report = compare_steps(coverage([1, 1, 2], [], [1, 2, 1]), [[1, 1], [2]], [[1, 2], [1]])
    assert report.steps_matching == 0
