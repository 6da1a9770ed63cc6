"""Fuzzing the edges a user touches: every malformed checkpoint, checkpoint file or
constructor argument gives a ValueError/TypeError, never a hang, a crash, a silent
reposition or a partial state change."""

from __future__ import annotations

import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_state import apply_mutation, json_values, mutation

import lance_ray

FUZZ = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture,
                                       HealthCheck.too_slow])


@pytest.fixture(scope="module")
def view(table_1k):
    """A rank of a 2-rank run with some progress, and its exact state."""
    ds = lance_ray.StreamingDataset(table_1k, num_splits=8, rank=1, world_size=2,
                                    reader="local", read_batch_size=64)
    it = ds.iter_batches(12)
    for _ in range(3):
        next(it)
    return ds, ds.state_dict()


@FUZZ
@given(st.lists(mutation(), min_size=1, max_size=3))
def test_a_mutated_checkpoint_is_refused_whole_or_loaded_whole(view, mutations):
    ds, good = view
    state = copy.deepcopy(good)
    for m in mutations:
        apply_mutation(state, m)
    before = ds.state_dict()
    try:
        ds.load_state_dict(state)
    except (ValueError, TypeError):
        assert ds.state_dict() == before  # nothing changed
        return
    # Accepted: then it was still a valid state of this plan, and it is what we now hold.
    loaded = ds.state_dict()
    counts = state["samples_consumed_per_split"]
    if isinstance(counts, int):  # the reference's old format: one count for every split
        counts = [counts] * len(loaded["samples_consumed_per_split"])
    assert loaded["samples_consumed_per_split"][4:] == counts[4:]
    ds.load_state_dict(good)


@FUZZ
@given(st.binary(max_size=200) | json_values.map(lambda v: json.dumps(v).encode()))
def test_a_garbage_checkpoint_file_is_a_clear_error(tmp_path_factory, blob):
    path = tmp_path_factory.mktemp("f") / "state.json"
    path.write_bytes(blob)
    with pytest.raises((ValueError, TypeError)):
        lance_ray.load_state(path)


WEIRD = [None, True, False, 0, -1, 1, 2, 3, 7, 8, 2**40, 2**64, 1.5, "2", "", [], {}, [1],
         "id > 3", object()]
PARAMS = ["num_splits", "world_size", "rank", "shuffle", "shuffle_seed", "epoch",
          "shuffle_clump_size", "read_batch_size", "prefetch_batches", "columns", "filter",
          "transform", "on_transform_error", "table_version", "reader", "storage_options"]


@FUZZ
@given(st.dictionaries(st.sampled_from(PARAMS), st.sampled_from(WEIRD), max_size=3))
def test_constructor_arguments_are_accepted_or_refused_clearly(table_1k, kwargs):
    kwargs.setdefault("reader", "local")
    try:
        ds = lance_ray.StreamingDataset(table_1k, **kwargs)
    except (ValueError, TypeError):
        return
    json.dumps(ds.state_dict())  # an accepted view has a valid, plain-data state
