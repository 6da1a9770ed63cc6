"""The coordinator's bookkeeping, without Ray: sealing, idempotence, staleness, resize,
coalesced reports and the memory bound."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from lance_ray.state import ledger as lg
from lance_ray.state.format import PlanIdentity, make_state
from lance_ray.state.merge import merge_state_dicts
from lance_ray.stream.order import stream_for
from lance_ray.topology import rank_splits, valid_world_sizes

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


def rank_state(identity: PlanIdentity, start: tuple[list[int], list[int]], rank: int,
               world_size: int, consumed: int, step: int) -> tuple[lg.RankReport, dict]:
    """Rank ``rank``'s report and its own state dict after ``consumed`` samples from
    ``start`` (full per-split samples and positions), as a view would make them."""
    n = identity.num_splits
    splits = rank_splits(rank, world_size, n)
    stream = stream_for(splits, start[0], start[1], identity.split_len)
    done = stream.advanced(min(consumed, len(stream)))
    samples, positions = list(start[0]), list(start[1])
    for k, split in enumerate(splits):
        samples[split], positions[split] = done.samples[k], done.positions[k]
    state = make_state(identity, samples, positions, world_size=world_size,
                       rank=None if world_size == 1 else rank, global_step=step)
    return lg.RankReport(rank, world_size, 0, step, done.samples, done.positions), state


@hs.composite
def runs(draw):
    """A topology, a start point, and every rank's reports of steps 1..steps, delivered
    as coalesced batches in a random order, with retries and late duplicates."""
    num_splits = draw(hs.sampled_from([1, 2, 4, 6, 8, 12, 16]))
    world_size = draw(hs.sampled_from(valid_world_sizes(num_splits)))
    split_len = draw(hs.integers(1, 30))
    start_samples = draw(hs.lists(hs.integers(0, split_len), min_size=num_splits,
                                  max_size=num_splits))
    skips = draw(hs.lists(hs.integers(0, split_len), min_size=num_splits, max_size=num_splits))
    start = (start_samples, [min(split_len, s + k) for s, k in zip(start_samples, skips)])
    identity = PlanIdentity(num_splits, 0, 0, split_len, 1, "f", True, None, None)
    batch = draw(hs.integers(1, 5))
    steps = draw(hs.integers(1, 25))
    states: dict[int, list[dict]] = {}
    batches = []
    for rank in range(world_size):
        reports = []
        for step in range(1, steps + 1):
            report, state = rank_state(identity, start, rank, world_size, batch * step, step)
            states.setdefault(step, []).append(state)
            reports.append(report)
        cuts = sorted(draw(hs.sets(hs.integers(1, steps), max_size=steps)) | {steps})
        lo = 0
        for hi in cuts:
            part = reports[lo:hi]
            batches.append(lg.ReportBatch(rank, world_size, 0, [r.step for r in part],
                                          [r.samples for r in part],
                                          [r.positions for r in part]))
            lo = hi
    order = draw(hs.permutations(batches))
    retried = draw(hs.lists(hs.sampled_from(batches), max_size=6))
    return num_splits, world_size, states, list(order) + retried, steps


@settings(max_examples=150, deadline=None)
@given(run=runs())
def test_every_sealed_step_equals_merge_state_dicts_under_any_batching_and_report_order(run):
    num_splits, world_size, states, batches, steps = run
    ledger = lg.Ledger(num_splits, world_size)
    sealed_steps = []
    for batch in batches:
        for sealed in lg.record_batch(ledger, batch):
            merged = merge_state_dicts(states[sealed.step])
            assert list(sealed.samples) == merged["samples_consumed_per_split"]
            assert list(sealed.positions) == merged["positions_consumed_per_split"]
            sealed_steps.append(sealed.step)
        assert len(ledger.pending) <= lg.PENDING_WINDOW + 1
    assert sealed_steps == sorted(set(sealed_steps))  # each step seals once, in order
    assert ledger.sealed is not None and ledger.sealed.step == steps
    assert not ledger.pending


def test_pending_steps_stay_within_the_window_when_a_rank_stops_reporting():
    ledger = lg.Ledger(8, 2)
    for step in range(1, 3 * lg.PENDING_WINDOW):
        lg.record(ledger, report_at(0, 2, step % 200, step))  # rank 1 is dead
    assert len(ledger.pending) == lg.PENDING_WINDOW + 1
    late = report_at(1, 2, 1, 1)
    assert lg.record(ledger, late) is None and 1 not in ledger.pending  # too late to seal
    step = 3 * lg.PENDING_WINDOW - 1
    assert lg.record(ledger, report_at(1, 2, step % 200, step)).step == step
    assert not ledger.pending


def test_a_malformed_batch_is_refused_before_anything_is_recorded():
    ledger = lg.Ledger(8, 2)
    good = report_at(0, 2, 4, 1)
    with pytest.raises(ValueError, match="reported 3 splits, but owns 4"):
        lg.record_batch(ledger, lg.ReportBatch(0, 2, 0, [1, 2], [good.samples, (1, 1, 1)],
                                               [good.positions, (1, 1, 1)]))
    with pytest.raises(ValueError, match="2 steps with 1 sample"):
        lg.record_batch(ledger, lg.ReportBatch(0, 2, 0, [1, 2], [good.samples],
                                               [good.positions] * 2))
    assert not ledger.pending


def test_one_batch_can_seal_several_steps():
    ledger = lg.Ledger(8, 2)
    reports = [report_at(1, 2, 2 * s, s) for s in (1, 2, 3)]
    lg.record_batch(ledger, lg.ReportBatch(1, 2, 0, [1, 2, 3], [r.samples for r in reports],
                                           [r.positions for r in reports]))
    mine = [report_at(0, 2, 2 * s, s) for s in (1, 2, 3)]
    sealed = lg.record_batch(ledger, lg.ReportBatch(0, 2, 0, [1, 2, 3],
                                                    [r.samples for r in mine],
                                                    [r.positions for r in mine]))
    assert [s.step for s in sealed] == [1, 2, 3]


def test_history_holds_a_bounded_number_of_integers_and_names_what_it_still_has():
    history = lg.History(max_steps=100, max_values=64)
    zeros = (0,) * 8
    for step in range(1, 20):
        history.add(lg.Sealed(0, step, 2, zeros, zeros))
    assert [s for _, s in history.steps] == [16, 17, 18, 19]  # 4 steps x 2 x 8 integers
    assert history.get(0, 17).step == 17
    with pytest.raises(ValueError, match=r"step 3 of epoch 0 is not sealed or no longer kept; "
                                         r"sealed steps held: \[16, 19\]"):
        history.get(0, 3)


def test_packed_progress_seals_blocks_and_buffer_lengths_per_split():
    ledger = lg.Ledger(num_splits=4, world_size=2, packed=True)
    assert ledger.start().buffered == (-1,) * 4  # no split has a buffer yet
    lg.record_batch(ledger, lg.ReportBatch(0, 2, 0, [1], [[3, 2]], [[3, 2]], [[1, 1]],
                                           [[5, 0]]))
    sealed = lg.record_batch(ledger, lg.ReportBatch(1, 2, 0, [1], [[1, 4]], [[1, 4]],
                                                    [[1, 1]], [[-1, 7]]))
    assert sealed[0].columns() == ((3, 2, 1, 4), (3, 2, 1, 4), (1, 1, 1, 1), (5, 0, -1, 7))
    with pytest.raises(ValueError, match="one sample, position, block and buffer list"):
        lg.record_batch(ledger, lg.ReportBatch(0, 2, 0, [2], [[4, 2]], [[4, 2]]))
    with pytest.raises(ValueError, match="two different progresses"):
        lg.record_batch(ledger, lg.ReportBatch(0, 2, 0, [2, 2], [[4, 2]] * 2, [[4, 2]] * 2,
                                               [[2, 1], [2, 2]], [[0, 0]] * 2))
    rows = lg.Ledger(num_splits=2, world_size=1)
    with pytest.raises(ValueError, match="one sample and position list"):
        lg.record_batch(rows, lg.ReportBatch(0, 1, 0, [1], [[1, 1]], [[1, 1]], [[1, 1]],
                                             [[0, 0]]))


def test_restoring_where_the_ledger_starts_keeps_reports_after_a_resize():
    """Every rank of a group restarted on another world size restores the same checkpoint;
    once the first has resized the ledger, the others' restores must not wipe its reports
    (the sealed step still says the old world size, the checkpoint's may say either)."""
    ledger = lg.Ledger(8, 2)
    for rank in (0, 1):
        lg.record(ledger, report_at(rank, 2, 8, 2))
    checkpoint = ledger.sealed
    assert checkpoint is not None and checkpoint.world_size == 2
    assert lg.restore(ledger, checkpoint) is False
    lg.resize(ledger, 4)
    ahead = tuple(checkpoint.samples[k] + 1 for k in rank_splits(0, 4, 8))
    lg.record(ledger, lg.RankReport(0, 4, 0, 3, ahead, ahead))
    for restored in (checkpoint, replace(checkpoint, world_size=4)):
        assert lg.restore(ledger, restored) is False
        assert 3 in ledger.pending  # rank 0's report of step 3 is still there


def test_pending_steps_survive_a_json_round_trip_and_still_seal():
    """A restarted coordinator takes back the reports of steps that had not sealed: the
    ranks that sent them were acknowledged and never send them again."""
    import json

    ledger = lg.Ledger(8, 2)
    lg.record(ledger, report_at(0, 2, 6, 1))
    lg.record(ledger, report_at(0, 2, 8, 2))
    again = lg.ledger_from_json(json.loads(json.dumps(lg.ledger_json(ledger))), packed=False)
    assert again == ledger
    for led in (ledger, again):
        lg.record(led, report_at(1, 2, 6, 1))
        assert lg.record(led, report_at(1, 2, 8, 2)).step == 2
    assert again.sealed == ledger.sealed
    older = {k: v for k, v in lg.ledger_json(ledger).items() if k != "pending"}
    old = lg.ledger_from_json(older, packed=False)  # written before pending steps were kept
    assert (old.sealed, old.pending) == (ledger.sealed, {})
