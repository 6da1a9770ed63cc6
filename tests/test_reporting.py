"""Coalesced progress reports, without Ray: when a view's steps are sent, that none is lost,
and that a checkpoint waits for its own step.

The channel here stands in for the coordinator actor (it records what it is sent and
answers on demand); the real actor is exercised in tests/test_coordinator.py.
"""

from __future__ import annotations

import gc
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from lance_ray.state.ledger import RankReport, ReportBatch
from lance_ray.state.reporting import TICK_S, Reporter, ReportPolicy


class Recorder:
    """A channel that records batches and answers a call once asked for its result."""

    def __init__(self, fail: set[int] | None = None):
        self.sent: list = []
        self.answered: set[int] = set()
        self.fail = fail or set()

    def send(self, batch):
        self.sent.append(batch)
        return len(self.sent) - 1

    def finished(self, replies):
        return [r for r in replies if r in self.answered]

    def result(self, reply):
        self.answered.add(reply)
        if reply in self.fail:
            raise ValueError(f"call {reply} failed")
        return None

    def steps(self) -> list[int]:
        return [s for b in self.sent for s in b.steps]

    def unanswered(self) -> int:
        return len(self.sent) - len(self.answered)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def add(reporter: Reporter, step: int, *, epoch: int = 0, final: bool = False) -> None:
    reporter.add(RankReport(0, 1, epoch, step, (step,), (step,)), final=final)


def test_steps_go_out_every_k_batches_in_one_call():
    channel = Recorder()
    reporter = Reporter(channel, ReportPolicy(every_batches=4, every_s=60), Clock())
    for step in range(1, 10):
        add(reporter, step)
    assert [list(b.steps) for b in channel.sent] == [[1, 2, 3, 4], [5, 6, 7, 8]]
    assert [list(s) for s in channel.sent[0].samples] == [[1], [2], [3], [4]]
    assert reporter.buffered_steps == 1


def test_a_buffer_older_than_every_s_goes_out_with_the_next_commit():
    channel, clock = Recorder(), Clock()
    reporter = Reporter(channel, ReportPolicy(every_batches=128, every_s=2.0), clock)
    add(reporter, 1)
    clock.now += 1.9
    add(reporter, 2)
    assert channel.sent == []
    clock.now += 0.2
    add(reporter, 3)
    assert channel.steps() == [1, 2, 3]


def test_the_end_of_an_epoch_and_a_new_epoch_are_sent_at_once():
    channel = Recorder()
    reporter = Reporter(channel, ReportPolicy(every_batches=128, every_s=60), Clock())
    add(reporter, 1)
    add(reporter, 2, final=True)
    assert channel.steps() == [1, 2]
    add(reporter, 1, epoch=1)
    add(reporter, 1, epoch=2)  # a batch never mixes epochs
    assert [b.epoch for b in channel.sent] == [0, 1]


def test_a_checkpoint_flush_returns_only_once_every_report_is_acknowledged():
    channel = Recorder()
    reporter = Reporter(channel, ReportPolicy(every_batches=2, every_s=60), Clock())
    for step in range(1, 6):
        add(reporter, step)
    assert channel.unanswered() == 2
    reporter.flush(wait=True)
    assert channel.steps() == [1, 2, 3, 4, 5]
    assert channel.unanswered() == 0 and reporter.buffered_steps == 0


def test_at_most_max_in_flight_calls_are_unanswered():
    channel = Recorder()
    reporter = Reporter(channel, ReportPolicy(every_batches=1, every_s=60, max_in_flight=3),
                        Clock())
    for step in range(1, 50):
        add(reporter, step)
        assert channel.unanswered() <= 3
    assert channel.steps() == list(range(1, 50))


def test_a_failed_report_is_raised_in_the_views_thread():
    channel = Recorder(fail={0})
    reporter = Reporter(channel, ReportPolicy(every_batches=1, every_s=60, max_in_flight=1),
                        Clock())
    add(reporter, 1)
    with pytest.raises(ValueError, match="call 0 failed"):
        add(reporter, 2)  # waits for call 0 to free the only slot, and sees its error
    channel = Recorder(fail={0})
    reporter = Reporter(channel, ReportPolicy(every_batches=128, every_s=60), Clock())
    add(reporter, 1)
    with pytest.raises(ValueError, match="call 0 failed"):
        reporter.flush(wait=True)


def test_a_stalled_view_is_heard_within_every_s_by_the_background_thread():
    channel = Recorder()
    reporter = Reporter(channel, ReportPolicy(every_batches=128, every_s=0.05))
    add(reporter, 1)
    deadline = time.monotonic() + 10
    while not channel.sent and time.monotonic() < deadline:
        time.sleep(TICK_S)
    assert channel.steps() == [1]


def test_a_dropped_view_still_sends_its_last_steps():
    channel = Recorder()
    reporter = Reporter(channel, ReportPolicy(every_batches=128, every_s=0.05))
    add(reporter, 1)
    add(reporter, 2)
    del reporter
    gc.collect()
    deadline = time.monotonic() + 10
    while not channel.sent and time.monotonic() < deadline:
        time.sleep(TICK_S)
    assert channel.steps() == [1, 2]


@settings(max_examples=100, deadline=None)
@given(every_batches=hs.integers(1, 6), every_s=hs.sampled_from([0.5, 1.0, 3.0]),
       max_in_flight=hs.integers(1, 3),
       actions=hs.lists(hs.sampled_from(["commit", "wait", "tick", "flush", "epoch"]),
                        max_size=60))
def test_every_committed_step_is_sent_exactly_once_in_order(every_batches, every_s,
                                                            max_in_flight, actions):
    channel, clock = Recorder(), Clock()
    policy = ReportPolicy(every_batches=every_batches, every_s=every_s,
                          max_in_flight=max_in_flight)
    reporter = Reporter(channel, policy, clock)
    committed, epoch, step = [], 0, 0
    for action in actions:
        if action == "commit":
            step += 1
            add(reporter, step, epoch=epoch)
            committed.append((epoch, step))
        elif action == "wait":
            clock.now += 0.4
        elif action == "tick":
            reporter.tick()
        elif action == "flush":
            reporter.flush(wait=True)
            assert channel.unanswered() == 0
        else:
            epoch, step = epoch + 1, 0
        assert reporter.buffered_steps <= every_batches
        assert channel.unanswered() <= max_in_flight
    reporter.flush(wait=True)
    assert [(b.epoch, s) for b in channel.sent for s in b.steps] == committed
    assert all(len(b.steps) <= every_batches for b in channel.sent)


def test_the_actor_channel_never_starts_ray_to_send_a_report(monkeypatch):
    """An actor call auto-starts Ray; after the driver's ray.shutdown() the reports' thread
    must fail instead (a stand-in handle records any call)."""
    from types import SimpleNamespace

    from lance_ray.coordinator import client

    calls = []
    handle = SimpleNamespace(report_batch=SimpleNamespace(remote=calls.append))
    monkeypatch.setattr(client, "ray_is_up", lambda: False)
    with pytest.raises(RuntimeError, match="Ray is not connected"):
        client._ActorChannel(handle).send(ReportBatch(0, 1, 0, [1], [[1]], [[1]]))
    assert not calls


def test_reports_since_the_last_confirmed_checkpoint_are_sent_again_and_no_older():
    # A coordinator that Ray restarted may have lost reports it acknowledged: a view sends
    # again what it sent since its last confirmed checkpoint, at most PENDING_WINDOW steps
    # (older ones could not seal any more).
    from lance_ray.state.ledger import PENDING_WINDOW

    channel = Recorder()
    reporter = Reporter(channel, ReportPolicy(every_batches=4, every_s=60), Clock())
    for step in range(1, 9):
        add(reporter, step)
    reporter.flush(wait=True)
    reporter.confirm(reporter.sent)  # durable: nothing to send again
    for step in range(9, 15):
        add(reporter, step)
    reporter.flush(wait=True)
    sent = len(channel.sent)
    reporter.resend()
    assert [s for b in channel.sent[sent:] for s in b.steps] == list(range(9, 15))
    assert channel.unanswered() == 0  # resend waits for every acknowledgement
    for step in range(15, 15 + 3 * PENDING_WINDOW):
        add(reporter, step)
    sent = len(channel.sent)
    reporter.resend()
    again = [s for b in channel.sent[sent:] for s in b.steps]
    assert len(again) <= PENDING_WINDOW and again[-1] == 14 + 3 * PENDING_WINDOW


def test_a_report_sent_while_a_checkpoint_was_written_stays_to_send_again():
    # confirm() forgets only the reports the durable write held: those sent before it.
    channel = Recorder()
    reporter = Reporter(channel, ReportPolicy(every_batches=1, every_s=60), Clock())
    add(reporter, 1)
    held = reporter.sent  # the checkpoint asks for a durable write now ...
    add(reporter, 2)  # ... and another thread reports meanwhile
    reporter.confirm(held)
    sent = len(channel.sent)
    reporter.resend()
    assert [s for b in channel.sent[sent:] for s in b.steps] == [2]
