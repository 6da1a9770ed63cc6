"""MixtureDataset states at their edges, over real Lance tables: a state saved at an epoch's
end on another world size, the refusal of uneven shares and what it suggests, and a
mixture's state or coordinator given to a single table's API. A sample is ``(source, id)``.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import Counter

import pytest

import lance_ray
from lance_ray import Coordinator, MixtureDataset, Source, StreamingDataset
from lance_ray.state.format import parse_state
from lance_ray.state.packed import parse_packed_state
from lance_ray.state.reporting import ReportPolicy
from lance_ray.topology import valid_world_sizes

# Shares that leave the sources' partly read next passes (all_exhausted) uneven on 3 and 4
# ranks at the end of an epoch read on 2.
SIZES = (216, 60, 36)
WEIGHTS = (7, 2, 1)
NUM_SPLITS = 12
GLOBAL_BATCH = 12


@pytest.fixture
def tables(table_factory):
    return [table_factory(n) for n in SIZES]


def mixture(tables, world_size, rank=0, *, stop="all_exhausted", epoch=0):
    return MixtureDataset([Source(t, weight=w) for t, w in zip(tables, WEIGHTS)],
                          num_splits=NUM_SPLITS, shuffle_seed=3, rank=rank,
                          world_size=world_size, stop=stop, epoch=epoch, columns=["id"],
                          reader="local")


def group(tables, world_size, **kw):
    return [mixture(tables, world_size, r, **kw) for r in range(world_size)]


def lockstep(views, steps=None):
    """One iteration of ranks in lockstep: per global step, each rank's samples."""
    its = [v.iter_batches(GLOBAL_BATCH // len(views)) for v in views]
    out = []
    while steps is None or len(out) < steps:
        batches = [next(it, None) for it in its]
        if all(b is None for b in batches):
            break
        assert all(b is not None for b in batches), "ranks ended at different steps"
        out.append([list(zip(b["source"].tolist(), b["id"].tolist())) for b in batches])
    return out


def flat(steps):
    return [s for per_rank in steps for rank in per_rank for s in rank]


@pytest.mark.parametrize(("stop", "new_ws"), [
    ("all_exhausted", 4), ("all_exhausted", 3), ("all_exhausted", 1), ("first_exhausted", 1)])
def test_an_epoch_end_state_resumes_on_any_world_size_ended_then_next_epoch(
        tables, stop, new_ws):
    """A state saved once epoch 0 was read to its end loads on another world size: epoch 0
    stays ended (each of its samples delivered once, all by the run that saved it), and the
    next iteration is epoch 1 as a fresh run on the new world size reads it."""
    old = group(tables, 2, stop=stop)
    head = lockstep(old)
    assert all(ds.samples_remaining == 0 for ds in old)
    merged = json.loads(json.dumps(lance_ray.merge_state_dicts([ds.state_dict() for ds in old])))
    assert merged["lance_ray_mixture"]["step"] == merged["lance_ray_mixture"]["end"]
    new = group(tables, new_ws, stop=stop)
    for ds in new:
        ds.load_state_dict(merged)
    assert [ds.samples_remaining for ds in new] == [0] * new_ws
    rest = lockstep(new)
    assert rest == [] and all(ds.epoch == 0 for ds in new)
    # exactly once: the two runs together deliver epoch 0 as an uninterrupted run does
    whole = flat(lockstep(group(tables, 2, stop=stop)))
    assert Counter(flat(head) + flat(rest)) == Counter(whole)
    assert {s for s, _ in whole} == {0, 1, 2}
    # a state saved by the ended view loads again, on its world size and on the old one
    again = lance_ray.merge_state_dicts([ds.state_dict() for ds in new])
    for ds in group(tables, new_ws, stop=stop) + group(tables, 2, stop=stop):
        ds.load_state_dict(again)
        assert ds.samples_remaining == 0
    nxt = lockstep(new)
    assert all(ds.epoch == 1 for ds in new)
    assert nxt == lockstep(group(tables, new_ws, stop=stop, epoch=1)) and nxt


def uneven_state(tables, steps=3):
    """An all_exhausted state of 2 ranks after ``steps`` global steps, and the world sizes
    that load it."""
    old = group(tables, 2)
    lockstep(old, steps)
    merged = lance_ray.merge_state_dicts([ds.state_dict() for ds in old])
    loads = []
    for ws in valid_world_sizes(NUM_SPLITS):
        try:
            for ds in group(tables, ws):
                ds.load_state_dict(merged)
            loads.append(ws)
        except ValueError as e:
            assert "unequal samples" in str(e)
    assert 2 in loads and len(loads) < len(valid_world_sizes(NUM_SPLITS))
    return merged, loads


def test_uneven_shares_name_exactly_the_world_sizes_that_load(tables):
    """A mid-epoch all_exhausted state refused on a world size whose ranks would hold
    unequal shares names the world sizes at which it loads (computed, not every divisor),
    and does not offer a stop that loading refuses."""
    merged, loads = uneven_state(tables)
    for ws in set(valid_world_sizes(NUM_SPLITS)) - set(loads):
        with pytest.raises(ValueError, match="unequal samples") as refusal:
            mixture(tables, ws).load_state_dict(merged)
        assert f"world sizes {loads}," in str(refusal.value)
        assert "new run only" in str(refusal.value)  # first_exhausted: not for this state


def test_a_refused_load_restores_the_views_without_warnings(tables, caplog):
    """A refused load leaves a mixture read part way as it was, and says nothing of samples
    left unread: neither the sources' passes the state moves to nor the restore read any."""
    merged, loads = uneven_state(tables, steps=27)  # sources 0 and 1 are in their pass 1
    assert merged["lance_ray_mixture"]["passes"][:2] == [1, 1]
    refused = next(ws for ws in valid_world_sizes(NUM_SPLITS) if ws not in loads)
    ds = mixture(tables, refused)
    it = ds.iter_batches(2)
    head = [next(it) for _ in range(2)]
    del it
    before = ds.state_dict()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="lance_ray"), \
            pytest.raises(ValueError, match="unequal samples"):
        ds.load_state_dict(merged)
    assert [r.getMessage() for r in caplog.records if "unread" in r.getMessage()] == []
    assert ds.state_dict() == before
    rest = [list(zip(b["source"].tolist(), b["id"].tolist())) for b in ds.iter_batches(2)]
    fresh = mixture(tables, refused)
    whole = [list(zip(b["source"].tolist(), b["id"].tolist())) for b in fresh.iter_batches(2)]
    assert [list(zip(b["source"].tolist(), b["id"].tolist())) for b in head] + rest == whole


def test_a_mixture_state_given_to_a_single_table_names_the_mixture(tables):
    ds = mixture(tables, 1, stop="first_exhausted")
    lockstep([ds], 2)
    state = ds.state_dict()
    view = StreamingDataset(tables[0], num_splits=NUM_SPLITS, shuffle_seed=3, columns=["id"],
                            reader="local")
    before = view.state_dict()
    for load in (view.load_state_dict, parse_state, parse_packed_state):
        with pytest.raises(ValueError, match="MixtureDataset's state") as refusal:
            load(state)
        assert "same sources, weights and stop" in str(refusal.value)
    assert view.state_dict() == before


@pytest.fixture
def coordinators(ray_session, tmp_path):
    """``create(source_or_sources, name, world_size, **kw)``; all are stopped at the end."""
    made: list[Coordinator] = []

    def create(of, name, world_size, **kw):
        made.append(Coordinator.create(of, name, storage_path=str(tmp_path / "store"),
                                       world_size=world_size, num_splits=NUM_SPLITS,
                                       shuffle_seed=3, **kw))
        return made[-1]

    yield create
    for c in made:
        with contextlib.suppress(Exception):
            c.kill()


def test_a_coordinator_resized_at_an_epoch_end_serves_the_next_epoch(tables, coordinators):
    coord = coordinators([Source(t, weight=w) for t, w in zip(tables, WEIGHTS)],
                         "edge_epoch_end", 2, stop="all_exhausted",
                         report_policy=ReportPolicy(every_batches=1))
    views = [coord.view(r, 2, columns=["id"], reader="local") for r in range(2)]
    head = lockstep(views)
    for v in views:
        v.state_dict()  # recorded: the epoch's end is sealed
    del views
    coord.resize(4)
    new = [coord.view(r, 4, columns=["id"], reader="local") for r in range(4)]
    assert lockstep(new) == []
    assert Counter(flat(head)) == Counter(flat(lockstep(group(tables, 2))))
    nxt = lockstep(new)
    assert nxt and nxt == lockstep(group(tables, 4, epoch=1))


def test_a_mixture_coordinator_given_to_streaming_dataset_names_the_mixture_api(
        tables, coordinators):
    coordinators([Source(t, weight=w) for t, w in zip(tables, WEIGHTS)], "edge_mix", 1)
    with pytest.raises(ValueError, match="MixtureDataset.from_coordinator") as refusal:
        StreamingDataset.from_coordinator("edge_mix", rank=0, world_size=1, columns=["id"])
    assert "Coordinator.view" in str(refusal.value)
    assert "lance_ray.train.get_dataset" in str(refusal.value)


def test_a_mixture_state_given_to_a_table_coordinator_names_the_mixture(tables, coordinators):
    table = coordinators(tables[0], "edge_table", 1)
    ds = mixture(tables, 1, stop="first_exhausted")
    lockstep([ds], 1)
    with pytest.raises(ValueError, match="MixtureDataset's state"):
        table.load_state_dict(ds.state_dict())
