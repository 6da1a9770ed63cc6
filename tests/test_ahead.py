"""``ahead``: results in order, each handed over as soon as it is done whatever the items do,
within its depth and byte budget, errors in their place, and nothing left running after it.

Pure threads (no Ray, no table): the items are generators the tests control. Waits have
timeouts, so a regression fails instead of hanging.
"""

from __future__ import annotations

import gc
import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lance_ray.read.ahead import THREAD_PREFIX, Held, Started, ahead

WAIT = 10.0  # seconds: far above any honest wait here, only a guard against hanging


def _ours() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)}


@pytest.fixture
def no_thread_left() -> Iterator[None]:
    before = _ours()
    yield
    deadline = time.monotonic() + WAIT
    while _ours() - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not [t.name for t in _ours() - before]


class Pulls:
    """Items 0, 1, ... (``count`` of them, or forever), recording how many were pulled and on
    which threads."""

    def __init__(self, count: int | None = None, sleeps: list[float] | None = None):
        self.count, self.sleeps = count, sleeps or []
        self.pulled = 0
        self.threads: set[int] = set()

    def __iter__(self) -> Iterator[int]:
        for i in itertools.count() if self.count is None else range(self.count):
            if self.sleeps:
                time.sleep(self.sleeps[i % len(self.sleeps)])
            self.threads.add(threading.get_ident())
            self.pulled += 1
            yield i


def test_a_ready_result_is_handed_over_before_more_items_arrive(no_thread_left) -> None:
    released = threading.Event()

    def items() -> Iterator[int]:
        yield 0
        # The next items arrive only once the consumer has the first result.
        if not released.wait(WAIT):
            raise TimeoutError("the first result was held back until more items arrived")
        yield from (1, 2, 3)

    results = ahead(lambda x: x * 10, items(), depth=2)
    assert next(results) == 0
    released.set()
    assert list(results) == [10, 20, 30]


@settings(max_examples=25, deadline=None)
@given(work=st.lists(st.sampled_from([0.0, 0.0005, 0.002]), min_size=0, max_size=12),
       arrivals=st.lists(st.sampled_from([0.0, 0.001]), max_size=4),
       depth=st.integers(0, 4), threads=st.integers(1, 3))
def test_results_keep_the_items_order_and_items_are_pulled_on_one_thread(
        work: list[float], arrivals: list[float], depth: int, threads: int) -> None:
    def fn(i: int) -> int:
        time.sleep(work[-1 - i])  # later items often finish first
        return i * i

    items = Pulls(len(work), arrivals)
    assert list(ahead(fn, items, depth, threads)) == [i * i for i in range(len(work))]
    assert len(items.threads) <= 1


@pytest.mark.parametrize("depth", [0, 1, 2, 5])
def test_items_are_pulled_at_most_one_beyond_depth_ahead_of_the_consumer(depth: int,
                                                              no_thread_left) -> None:
    items = Pulls(20)
    results = ahead(lambda x: x, items, depth, threads=2)
    for k, got in enumerate(results):
        assert got == k
        time.sleep(0.002)  # room for the producer to run as far ahead as it may
        # Holding result k, the consumer asked for k + 1: items up to k + depth are
        # submitted, and one more may be pulled, waiting for room.
        assert items.pulled <= k + 1 + depth + 1


class Counting(Held):
    """A ``Held`` that also counts the items it holds and notes every moment it held more
    than ``budget`` bytes in more than one item."""

    def __init__(self, budget: int):
        super().__init__()
        self.budget, self.items, self.over = budget, 0, []

    def add(self, nbytes: int) -> None:
        super().add(nbytes)
        self.items += (nbytes > 0) - (nbytes < 0)
        if self.nbytes > self.budget and self.items > 1:
            self.over.append((self.nbytes, self.items))


@settings(max_examples=30, deadline=None)
@given(costs=st.lists(st.integers(1, 100), min_size=1, max_size=15),
       budget=st.integers(1, 150), depth=st.integers(0, 4), threads=st.integers(1, 3),
       slow=st.booleans())
def test_bytes_held_stay_within_the_budget_except_for_a_single_item(
        costs: list[int], budget: int, depth: int, threads: int, slow: bool) -> None:
    held = Counting(budget)

    def fn(i: int) -> int:
        if slow:
            time.sleep(0.0005)
        return i

    got = list(ahead(fn, range(len(costs)), depth, threads, cost=lambda i: costs[i],
                     budget=budget, held=held))
    assert got == list(range(len(costs)))
    assert held.over == []
    assert held.nbytes == 0 and held.items == 0
    assert held.peak <= max(budget, max(costs))


@pytest.mark.parametrize("depth", [0, 2])
def test_an_error_from_fn_is_raised_in_place_of_its_result(depth: int,
                                                           no_thread_left) -> None:
    def fn(i: int) -> int:
        if i == 3:
            raise ValueError("bad item 3")
        return i

    results = ahead(fn, Pulls(10), depth, threads=2)
    assert [next(results) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(ValueError, match="bad item 3"):
        next(results)


@pytest.mark.parametrize(("k", "depth"), [(0, 2), (1, 0), (4, 2), (4, 9)])
def test_an_error_from_the_items_comes_after_the_results_of_the_items_before_it(
        k: int, depth: int, no_thread_left) -> None:
    def items() -> Iterator[int]:
        yield from range(k)
        raise OSError("the source broke")

    got: list[int] = []
    with pytest.raises(OSError, match="the source broke"):
        for x in ahead(lambda x: x + 1, items(), depth):
            got.append(x)
    assert got == [i + 1 for i in range(k)]


@pytest.mark.parametrize("arrival", [0.0, 0.003])
def test_close_mid_way_returns_promptly_and_pulls_no_further_items(
        arrival: float, no_thread_left) -> None:
    items = Pulls(None, [arrival])  # endless
    held = Held()
    results = ahead(lambda x: x, items, 2, threads=2, cost=lambda _: 10, held=held)
    assert [next(results) for _ in range(3)] == [0, 1, 2]
    started = time.monotonic()
    results.close()
    assert time.monotonic() - started < WAIT
    pulled = items.pulled
    assert pulled <= 3 + 2 + 1  # asked for 3, 2 ahead, 1 waiting for room
    time.sleep(0.05)
    assert items.pulled == pulled
    assert held.nbytes == 0  # what was never handed over is no longer held


def test_close_waits_for_a_pull_in_progress_so_the_items_can_be_closed_after(
        no_thread_left) -> None:
    release = threading.Event()
    inside = threading.Event()

    def items() -> Iterator[int]:
        yield 0
        inside.set()
        release.wait(WAIT)  # e.g. Ray Data's next block, still on its way
        yield 1

    source = items()
    results = ahead(lambda x: x, source, 2)
    assert next(results) == 0
    assert inside.wait(WAIT)
    threading.Timer(0.05, release.set).start()
    results.close()
    source.close()  # would raise "generator already executing" were the producer inside it


def test_an_abandoned_generator_is_collected_without_leaving_threads(no_thread_left) -> None:
    results = ahead(lambda x: x, Pulls(None), 2, threads=2)
    assert next(results) == 0
    del results
    gc.collect()


def test_a_generator_closed_on_its_own_pool_thread_does_not_hang(no_thread_left) -> None:
    got_first = threading.Event()
    closed = threading.Event()
    box: dict[str, Any] = {}

    def fn(i: int) -> int:
        if i == 1:
            # What a garbage collection run on this pool thread would do to an abandoned one.
            assert got_first.wait(WAIT)
            box["results"].close()
            closed.set()
        return i

    box["results"] = results = ahead(fn, Pulls(None), 2, threads=1)
    assert next(results) == 0
    got_first.set()
    assert closed.wait(WAIT)
    assert list(results) == []


def test_instant_items_are_all_computed_and_the_threads_stop(no_thread_left) -> None:
    assert list(ahead(str, itertools.repeat(7, 500), 2, threads=2)) == ["7"] * 500


def test_ctrl_c_while_the_first_item_is_made_closes_the_items_cleanly():
    """Ctrl-C in the wait for the first item is a KeyboardInterrupt, and close() waits for
    the start to leave the items before closing them (it raised "generator already
    executing" once an interrupted join let it through early)."""
    import os
    import signal

    release, closed = threading.Event(), []

    def items():
        try:
            release.wait()
            yield 1
        finally:
            closed.append(True)

    started = Started(items())
    threading.Timer(0.2, os.kill, (os.getpid(), signal.SIGINT)).start()  # the user's Ctrl-C
    with pytest.raises(KeyboardInterrupt):
        next(started)
    threading.Timer(0.2, release.set).start()
    started.close()
    assert closed == [True]
