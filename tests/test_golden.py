"""Golden tests: the checkpoint format and the sample order are versioned. If one of these
fails, the change is deliberate only if FORMAT_VERSION (or the documented order) changes
with it, because checkpoints in the wild depend on both."""

from __future__ import annotations

import lance_ray
from lance_ray.state.format import FORMAT_VERSION, PlanIdentity, make_state

IDENTITY = PlanIdentity(num_splits=4, shuffle_seed=7, epoch=1, split_len=250, table_version=3,
                        plan_fingerprint="abc", shuffle=True, filter="id > 1",
                        shuffle_clump_size=8)


def test_checkpoint_format_version_1_is_exactly_this():
    assert FORMAT_VERSION == 1
    state = make_state(IDENTITY, [3, 3, 2, 0], [3, 4, 2, 0], world_size=2, rank=0,
                       global_step=5)
    assert state == {
        "shuffle_seed": 7, "num_splits": 4, "epoch": 1,
        "samples_consumed_per_split": [3, 3, 2, 0],
        "positions_consumed_per_split": [3, 4, 2, 0],
        "lance_ray": {
            "format_version": 1, "table_version": 3, "plan_fingerprint": "abc",
            "split_len": 250, "shuffle": True, "filter": "id > 1", "shuffle_clump_size": 8,
            "world_size": 2, "rank": 0, "owned_splits": [0, 1], "global_step": 5,
        },
    }


def test_optional_identity_fields_add_their_key_and_change_nothing_else():
    """Fields added to format 1 after it shipped appear only when set, so a state without
    them is byte for byte the one above (and loads wherever it did)."""
    from dataclasses import replace

    plain = make_state(IDENTITY, [3, 3, 2, 0], [3, 4, 2, 0], world_size=2, rank=0,
                       global_step=5)
    state = make_state(replace(IDENTITY, table_commit="c0ffee", plan="index"),
                       [3, 3, 2, 0], [3, 4, 2, 0], world_size=2, rank=0, global_step=5,
                       lockstep=True)
    assert state == {**plain, "lance_ray": {**plain["lance_ray"], "table_commit": "c0ffee",
                                            "plan": "index", "lockstep": True}}


def test_sample_order_and_plan_fingerprint_are_pinned(table_factory):
    table = table_factory(1000, 3)
    ds = lance_ray.StreamingDataset(table, num_splits=4, shuffle_seed=7, reader="local")
    assert [r["id"] for _, r in zip(range(12), ds)] == [
        758, 9, 224, 292, 232, 881, 396, 325, 640, 133, 235, 700]
    assert ds.identity.plan_fingerprint == "ab5ea02cb930d99d"
    clumped = lance_ray.StreamingDataset(table, num_splits=4, shuffle_seed=7, epoch=1,
                                         shuffle_clump_size=8, reader="local")
    assert [r["id"] for _, r in zip(range(12), clumped)] == [
        240, 426, 372, 606, 241, 427, 373, 607, 242, 428, 374, 624]
    assert clumped.identity.plan_fingerprint == "b8bedd7c8abaf9ba"
