"""The last visible differences from ``lancedb.streaming``: error phrases, deprecations,
states, iterators and merges (docs/migrating.md).

Invariant: a script written for the reference that matches on its key phrases, compares the
states of its ranks, or starts one iterator at a time, behaves the same with lance_ray; where
lance_ray deliberately differs, it says why. Real Lance tables, no Ray.
"""

from __future__ import annotations

import gc
import logging
import warnings

import lancedb
import pyarrow as pa
import pytest

import lance_ray
from lance_ray.state.format import parse_state

SPLITS = 12


@pytest.fixture(scope="module")
def table(table_factory):
    return table_factory(120, 2)


def ours(table, **kw) -> lance_ray.StreamingDataset:
    return lance_ray.StreamingDataset(table, **{"num_splits": SPLITS, "shuffle_seed": 42,
                                                "reader": "local", **kw})


def token_table(tmp_path, docs: list[list[int]], keep: list[bool]):
    db = lancedb.connect(tmp_path)
    return db.create_table("tokens", pa.table({
        "tokens": pa.array(docs, type=pa.list_(pa.int64())), "keep": keep}))


# ----------------------------------------------------------------------- error phrases


def test_plain_worker_checkpoint_error_names_streaming_dataloader(table):
    ds = ours(table)
    ds._untracked[0] = 1  # what a plain DataLoader worker sets (shared memory)
    with pytest.raises(RuntimeError, match="Use StreamingDataLoader") as e:
        ds.state_dict()
    assert "commits each batch" in str(e.value)  # our fuller explanation stays


def test_loader_refuses_a_subclass_that_overrides_iter(table):
    class Custom(lance_ray.StreamingDataset):
        def __iter__(self):
            return iter([1000])

    ds = Custom(table, num_splits=SPLITS, reader="local")
    with pytest.raises(TypeError, match="override __iter__") as e:
        lance_ray.StreamingDataLoader(ds, batch_size=2)
    assert "silently ignored" in str(e.value)


def test_packed_blocks_not_divisible_is_named_before_too_few_rows(tmp_path):
    # A filter leaves 1 row for 2 splits, and 3 blocks do not divide over 2 splits: the
    # reference names the divisibility, checked first; so does lance_ray.
    t = token_table(tmp_path, [[1, 2], [3, 4]], [True, False])
    args = dict(columns=["tokens"], pack_sequences=4, eos_id=9, pad_id=0, num_splits=2,
                filter="keep", reader="local", shuffle=False)
    with pytest.raises(ValueError, match="must be divisible by num_splits"):
        lance_ray.StreamingDataset(t, blocks_per_epoch=3, **args)
    with pytest.raises(ValueError, match="at least 1 row per split"):
        lance_ray.StreamingDataset(t, blocks_per_epoch=2, **args)


@pytest.mark.parametrize("returns", ["record batch", "table", "none"])
def test_a_transform_breaking_the_row_contract_raises_the_references_type(table, returns):
    # An Arrow batch or table returned whole is a ValueError in the reference (it counts
    # the columns as items), a non-iterable a TypeError: lance_ray raises the same types,
    # naming what the transform returned.
    make = {"record batch": lambda b: b, "table": lambda b: pa.Table.from_batches([b]),
            "none": lambda b: None}[returns]
    from lancedb.streaming import StreamingDataset as Reference

    with pytest.raises(Exception) as ref:
        next(iter(Reference(table, num_splits=SPLITS, shuffle=False, transform=make)))
    with pytest.raises(type(ref.value)) as got:
        next(iter(ours(table, shuffle=False, transform=make)))
    if returns != "none":
        assert "returned a" in str(got.value) and "to_pylist" in str(got.value)


# ----------------------------------------------------------------------- deprecations


def test_prefetch_batches_is_a_deprecated_alias_of_io_queue_depth(table, caplog):
    with pytest.warns(DeprecationWarning, match="io_queue_depth"), \
            caplog.at_level(logging.WARNING):
        old = ours(table, prefetch_batches=3)
    assert any("deprecated" in r.message and "io_queue_depth" in r.message
               for r in caplog.records)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the new name is silent
        new = ours(table, io_queue_depth=3)
    assert old._reads.prefetch == new._reads.prefetch == 3
    assert [r["id"] for r in old] == [r["id"] for r in new]
    with pytest.raises(ValueError, match="pass only one"), \
            pytest.warns(DeprecationWarning):
        ours(table, prefetch_batches=2, io_queue_depth=3)


def test_auto_blocks_on_a_filtered_token_column_say_what_was_counted(tmp_path, caplog):
    t = token_table(tmp_path, [[1] * 4, [2] * 9, [3] * 4, [4] * 9],
                    [True, False, True, False])
    args = dict(columns=["tokens"], pack_sequences=5, eos_id=9, pad_id=0, num_splits=2,
                reader="local", shuffle=False, blocks_per_epoch="auto")
    with pytest.warns(UserWarning, match="exact count of 10 tokens") as w, \
            caplog.at_level(logging.INFO, logger="lance_ray"):
        ds = lance_ray.StreamingDataset(t, filter="keep", **args)
    assert len(w) == 1 and "approximate token-count sample" in str(w[0].message)
    assert "left by the filter" in str(w[0].message) and " s." in str(w[0].message)
    assert ds.state_dict()["blocks_per_epoch"] == 2
    assert sum("blocks_per_epoch='auto'" in r.message for r in caplog.records) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # unfiltered: logged only, as an exact count is
        lance_ray.StreamingDataset(t, **args)


# ----------------------------------------------------------------------- states


@pytest.mark.parametrize("world_size,per_rank", [(2, 6), (3, 4), (4, 3), (4, 6)])
def test_a_lockstep_runs_ranks_write_identical_states(table, world_size, per_rank):
    views = [ours(table, rank=r, world_size=world_size) for r in range(world_size)]
    its = [iter(v) for v in views]
    for _ in range(3):
        for it in its:
            for _ in range(per_rank):
                next(it)
    states = [v.state_dict() for v in views]
    assert all(s == states[0] for s in states)  # the lance_ray identity block included
    extra = states[0]["lance_ray"]
    assert (extra["lockstep"], extra["rank"], extra["world_size"]) == (True, None, world_size)
    assert parse_state(states[0]).loadable_anywhere
    # Any one of them resumes every rank of another world size exactly.
    full = sorted(r["id"] for r in ours(table))
    seen = []
    for it in its:
        seen += [r["id"] for r in it]  # the rest of the epoch, to compare with
    resumed = [ours(table, rank=r, world_size=6) for r in range(6)]
    for v in resumed:
        v.load_state_dict(states[0])
    after = sorted(r["id"] for v in resumed for r in v)
    assert after == sorted(seen)
    assert len(after) == len(full) - 3 * per_rank * world_size
    assert lance_ray.merge_state_dicts(states)["samples_consumed_per_split"] == \
        states[0]["samples_consumed_per_split"]


def test_a_rank_state_that_is_not_lockstep_still_names_its_rank(table):
    skip = dict(transform=lambda b: b.to_pylist(), on_transform_error="skip")
    views = [ours(table, rank=r, world_size=2, **skip) for r in range(2)]
    for v in views:
        next(iter(v))
    states = [v.state_dict() for v in views]
    assert [s["lance_ray"]["rank"] for s in states] == [0, 1]
    assert "lockstep" not in states[0]["lance_ray"]


def test_one_ranks_reference_state_is_not_taken_for_every_ranks_progress(table):
    """lancedb's rank state holds only lower bounds for the other ranks' splits. Loaded as
    it is, it resumes its own rank exactly, but a state taken later must not derive the
    other ranks' progress from it (a lockstep state would claim those bounds, and a resume
    would repeat the samples above them): it stays this rank's own state, to be merged."""
    from lancedb.streaming import StreamingDataset as Reference

    args = {"num_splits": SPLITS, "shuffle_seed": 42}
    refs = [Reference(table, rank=r, world_size=2, **args) for r in range(2)]
    its = [iter(r) for r in refs]
    for it in its:  # 7 each: rank 0's state is [1 x 6 or 2] and the others' lower bounds
        for _ in range(7):
            next(it)
    ref_states = [r.state_dict() for r in refs]
    assert len(set(ref_states[0]["samples_consumed_per_split"])) > 1
    states = []
    for rank, (it, ref_state) in enumerate(zip(its, ref_states)):  # each rank migrates
        resumed = ours(table, rank=rank, world_size=2)
        resumed.load_state_dict(ref_state)
        again = iter(resumed)
        assert [next(again)["id"] for _ in range(5)] == [next(it)["id"] for _ in range(5)]
        states.append(resumed.state_dict())
        assert (states[-1]["lance_ray"]["rank"], "lockstep" in states[-1]["lance_ray"]) == \
            (rank, False)
    rest = ours(table)
    rest.load_state_dict(lance_ray.merge_state_dicts(states))
    assert sorted(r["id"] for r in rest) == sorted(r["id"] for it in its for r in it)
    # A reference state at one count on every split, nothing skipped, is every rank's.
    uniform = {**ref_state, "samples_consumed_per_split": [3] * SPLITS,
               "positions_consumed_per_split": [3] * SPLITS}
    resumed.load_state_dict(uniform)
    next(iter(resumed))
    assert resumed.state_dict()["lance_ray"]["lockstep"] is True


def test_merge_refuses_conflicting_exact_claims_and_takes_the_maximum_of_reference_states(
        table):
    base = ours(table, num_splits=2, shuffle=False).state_dict()
    a = {**base, "samples_consumed_per_split": [2, 0], "positions_consumed_per_split": [2, 0]}
    b = {**base, "samples_consumed_per_split": [0, 2], "positions_consumed_per_split": [0, 2]}
    # Each lance_ray state says it is exact on both splits at step 0: one of them is not
    # what it says, and a maximum could skip rows.
    with pytest.raises(ValueError, match="two states claim split 0 with different progress"):
        lance_ray.merge_state_dicts([a, b])
    # Without the lance_ray block (as the reference writes them) owners are unknown: the
    # reference's rule, the element-wise maximum.
    plain = [{k: v for k, v in s.items() if k != "lance_ray"} for s in (a, b)]
    merged = lance_ray.merge_state_dicts(plain)
    assert merged["samples_consumed_per_split"] == merged["positions_consumed_per_split"] == [2, 2]


def test_the_references_private_names_for_splits_and_seed(table):
    ds = ours(table, shuffle_seed=None, world_size=2, num_splits=None)
    assert ds._num_splits == ds.num_splits == 2
    assert isinstance(ds._shuffle_seed, int) and ds._shuffle_seed == ds.shuffle_seed
    assert ds.state_dict()["shuffle_seed"] == ds._shuffle_seed


# ----------------------------------------------------------------------- one iterator


def test_a_loader_iterator_holds_the_lease_until_closed(table):
    ds = ours(table, num_splits=1, shuffle=False)
    loader = lance_ray.StreamingDataLoader(ds, batch_size=40)
    first = iter(loader)
    assert next(first)["id"].tolist() == list(range(40))
    with pytest.raises(RuntimeError, match="concurrent iteration"):
        iter(loader)  # refused when created, as in the reference
    with pytest.raises(RuntimeError, match="concurrent iteration"):
        next(iter(ds))  # the dataset's own iterators share the one lease
    first._shutdown_workers()  # torch's name; close() is the same
    second = iter(loader)
    assert next(second)["id"].tolist() == list(range(40, 80))  # from the committed state
    second.close()
    third = iter(loader)
    del third
    gc.collect()
    fourth = iter(loader)  # a dropped iterator gives its lease up
    assert [b["id"].tolist() for b in fourth] == [list(range(80, 120))]


def test_a_dataset_iterator_blocks_loaders_until_exhausted(table):
    ds = ours(table, num_splits=1, shuffle=False)
    loader = lance_ray.StreamingDataLoader(ds, batch_size=60)
    it = iter(ds)
    next(it)
    with pytest.raises(RuntimeError, match="concurrent iteration"):
        iter(loader)
    rest = list(it)
    assert len(rest) == 119
    assert list(iter(loader)) != []  # exhausted: the next iteration starts epoch 1
    assert ds.epoch == 1


# ----------------------------------------------------------------------- loader surface


def test_the_loader_reports_the_batch_size_it_was_given(table):
    from lancedb.streaming import StreamingDataLoader as ReferenceLoader
    from lancedb.streaming import StreamingDataset as Reference

    reference = ReferenceLoader(Reference(table, num_splits=SPLITS), batch_size=8)
    loader = lance_ray.StreamingDataLoader(ours(table), batch_size=8)
    assert loader.batch_size == reference.batch_size == 8  # e.g. samples = steps * batch_size
    assert lance_ray.StreamingDataLoader(ours(table), batch_size=None).batch_size is None


def test_a_loader_whose_iterator_torch_refuses_leaves_the_dataset_as_it_was(table):
    ds = ours(table)
    with pytest.raises(AssertionError):  # torch: a timeout needs worker processes
        next(iter(lance_ray.StreamingDataLoader(ds, batch_size=8, timeout=5)))
    assert ds.raw_queue_depth == 0 and ds.state_dict() == ours(table).state_dict()
    assert sum(len(b["id"]) for b in lance_ray.StreamingDataLoader(ds, batch_size=8)) == 120


def test_a_reference_dataset_given_to_the_loader_is_named_with_its_module(table):
    from lancedb.streaming import StreamingDataset as Reference

    with pytest.raises(TypeError, match=r"got lancedb\.streaming\.StreamingDataset: build "
                                        r"the dataset with lance_ray\.StreamingDataset"):
        lance_ray.StreamingDataLoader(Reference(table, num_splits=SPLITS), batch_size=8)
