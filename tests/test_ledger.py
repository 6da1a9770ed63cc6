"""The coordinator's bookkeeping, without Ray: sealing, idempotence, staleness, resize."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from lance_ray import ledger as lg
from lance_ray.order import stream_for
from lance_ray.plan import rank_splits, valid_world_sizes
from lance_ray.state import PlanIdentity, make_state, merge_state_dicts

IDENTITY = PlanIdentity(8, 0, 0, 50, 1, "f", True, None, None)


def report_at(rank: int, world_size: int, consumed: int, step: int, epoch: int = 0):
    """Rank ``rank``'s report after ``consumed`` samples of its own stream from zero."""
    splits = rank_splits(rank, world_size, 8)
    zeros = [0] * 8
    done = stream_for(splits, zeros, zeros, 50).advanced(consumed)
    return lg.RankReport(rank, world_size, epoch, step, done.samples, done.positions)


def test_a_step_seals_only_when_every_rank_reported_it():
    ledger = lg.Ledger(8, 2)
    assert lg.record(ledger, report_at(0, 2, 6, 1)) is None
    sealed = lg.record(ledger, report_at(1, 2, 6, 1))
    assert sealed is not None and sealed.step == 1
    assert sealed.samples == (2, 2, 1, 1, 2, 2, 1, 1)


def test_repeated_reports_are_idempotent_and_contradictions_are_refused():
    ledger = lg.Ledger(8, 2)
    lg.record(ledger, report_at(0, 2, 6, 1))
    assert lg.record(ledger, report_at(0, 2, 6, 1)) is None
    with pytest.raises(ValueError, match="two different progresses"):
        lg.record(ledger, report_at(0, 2, 7, 1))
    lg.record(ledger, report_at(1, 2, 6, 1))
    assert lg.record(ledger, report_at(1, 2, 6, 1)) is None  # late retry of a sealed step
    assert ledger.sealed.step == 1


def test_out_of_order_reports_seal_the_newest_complete_step():
    ledger = lg.Ledger(8, 2)
    lg.record(ledger, report_at(0, 2, 8, 2))
    lg.record(ledger, report_at(1, 2, 8, 2))
    assert lg.record(ledger, report_at(0, 2, 4, 1)) is None  # older than the sealed step
    assert lg.record(ledger, report_at(1, 2, 4, 1)) is None
    assert ledger.sealed.step == 2


def test_reports_from_a_stale_world_size_are_rejected_after_resize():
    ledger = lg.Ledger(8, 2)
    lg.resize(ledger, 4)
    with pytest.raises(lg.StaleReport, match="resized to 4"):
        lg.record(ledger, report_at(0, 2, 4, 1))


def test_resize_rejects_world_sizes_that_do_not_divide_the_splits_and_lists_valid_ones():
    with pytest.raises(ValueError, match=r"valid world sizes for 8 splits are \[1, 2, 4, 8\]"):
        lg.resize(lg.Ledger(8, 2), 3)


def test_slow_rank_reports_for_a_finished_epoch_are_ignored():
    ledger = lg.Ledger(8, 2)
    lg.advance_epoch(ledger, 1)
    assert lg.record(ledger, report_at(0, 2, 4, 9, epoch=0)) is None
    with pytest.raises(lg.StaleReport):
        lg.record(ledger, report_at(0, 2, 4, 1, epoch=2))


@settings(max_examples=60, deadline=None)
@given(world_size=hs.sampled_from(valid_world_sizes(8)), batch=hs.integers(1, 12),
       steps=hs.integers(1, 15))
def test_sealed_progress_equals_merge_state_dicts_of_the_ranks_states(world_size, batch, steps):
    ledger = lg.Ledger(8, world_size)
    states = []
    for rank in range(world_size):
        consumed = min(batch * steps, 50 * 8 // world_size)
        rep = report_at(rank, world_size, consumed, steps)
        lg.record(ledger, rep)
        samples = [0] * 8
        for k, split in enumerate(rank_splits(rank, world_size, 8)):
            samples[split] = rep.samples[k]
        states.append(make_state(IDENTITY, samples, samples, world_size=world_size,
                                 rank=None if world_size == 1 else rank, global_step=steps))
    merged = merge_state_dicts(states)
    assert list(ledger.sealed.samples) == merged["samples_consumed_per_split"]
    assert list(ledger.sealed.positions) == merged["positions_consumed_per_split"]
