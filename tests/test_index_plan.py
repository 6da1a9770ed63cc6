"""``plan="index"``: a computed plan with the guarantees of the lancedb-compatible one.

Pure properties first (the bijection, every row once, clumps, the same plan in another
process, memory independent of the table size), then the real datasets over real Lance
tables (``reader="local"``): filters and deletions, checkpoints of one mode refused by the
other, and the lancedb builder's limit. Exact resume on every world size, global-step sets,
own-state resume and the DataLoader properties run in both plan modes in test_resume.py.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_resume import PROPERTY, ids

import lance_ray
from lance_ray.plan.index import (
    Feistel,
    ShuffledOrder,
    computed_plan,
    dense_row_space,
    listed_row_space,
)
from lance_ray.plan.splits import PlanSpec, PlanTooLargeError
from lance_ray.state.merge import merge_state_dicts

PURE = settings(deadline=None, max_examples=100)


def all_rows(plan) -> np.ndarray:
    """Every planned row id, split by split (split k, positions 0 .. split_len-1)."""
    s = np.repeat(np.arange(plan.spec.num_splits), plan.split_len)
    p = np.tile(np.arange(plan.split_len), plan.spec.num_splits)
    return plan.rows_at(s, p)


@st.composite
def row_spaces(draw: st.DrawFn):
    """A row space (dense, or a listed subset as a filter or deletions make) and its ids."""
    sizes = draw(st.lists(st.integers(0, 300), min_size=1, max_size=5))
    frag_ids = draw(st.permutations(range(10)))[: len(sizes)]
    frags = [(f, n) for f, n in zip(sorted(frag_ids), sizes)]
    ids = [(f << 32) | o for f, n in frags for o in range(n)]
    if draw(st.booleans()):  # listed: keep a random subset, scanned in batches
        ids = [i for i in ids if draw(st.booleans())] or ids[:1]
        cut = draw(st.integers(1, 64))
        space = listed_row_space(np.array(ids[lo:lo + cut], dtype=np.uint64)
                                 for lo in range(0, len(ids), cut))
    else:
        space = dense_row_space(frags)
    return space, ids


@st.composite
def specs(draw: st.DrawFn, total: int) -> PlanSpec:
    return PlanSpec(1, draw(st.integers(1, max(1, min(12, total)))), draw(st.booleans()),
                    draw(st.integers(0, 2**40)), draw(st.integers(0, 5)),
                    draw(st.one_of(st.none(), st.integers(1, 64))), None, "index")


# ----------------------------------------------------------------------- pure


@PURE
@given(n=st.integers(1, 5000), seed=st.integers(0, 2**64 - 1))
def test_the_keyed_permutation_is_a_bijection_and_its_inverse_undoes_it(n, seed):
    perm = Feistel.of(n, seed)
    image = perm(np.arange(n, dtype=np.uint64))
    assert np.array_equal(np.sort(image), np.arange(n))
    assert np.array_equal(perm.inverse(image), np.arange(n))


@pytest.mark.parametrize("n", [70_001, 100_000, 1 << 17])
def test_the_shuffle_looks_like_a_random_permutation(n):
    """No trace of storage order: position and shuffled index are uncorrelated, neighbours
    share a split as often as chance says, and jumps have a random permutation's median."""
    shuffled = Feistel.of(n, n)(np.arange(n, dtype=np.uint64)).astype(np.int64)
    assert abs(np.corrcoef(np.arange(n), shuffled)[0, 1]) < 0.02
    split_of = np.empty(n, dtype=np.int64)
    split_of[shuffled] = np.arange(n) * 8 // n
    assert abs((split_of[1:] == split_of[:-1]).mean() - 1 / 8) < 0.01
    # |U - V| of two uniform draws has median (1 - 1/sqrt(2)) n.
    assert abs(np.median(np.abs(np.diff(shuffled))) / n - (1 - 2 ** -0.5)) < 0.02


@PURE
@given(data=st.data())
def test_every_row_is_planned_exactly_once_per_epoch_and_only_the_tail_is_dropped(data):
    space, listed = data.draw(row_spaces())
    if space.total == 0:
        return
    spec = data.draw(specs(space.total))
    plan = computed_plan(spec, space)
    rows = all_rows(plan)
    assert len(np.unique(rows)) == rows.size == spec.num_splits * plan.split_len
    assert set(rows.tolist()) <= set(listed)
    assert plan.dropped_rows == space.total % spec.num_splits


@PURE
@given(total=st.integers(1, 3000), clump=st.integers(2, 200), seed=st.integers(0, 2**32))
def test_rows_of_a_clump_stay_contiguous_and_in_order(total, clump, seed):
    order = ShuffledOrder.of(total, PlanSpec(1, 1, True, seed, 0, clump, None, "index"))
    positions = order.positions(np.arange(total))
    assert np.array_equal(np.sort(positions), np.arange(total))
    where = np.empty(total, dtype=np.int64)
    where[positions] = np.arange(total)  # shuffled index of each position
    for lo in range(0, total, clump):
        run = where[lo:lo + clump]
        assert np.array_equal(run, np.arange(run[0], run[0] + len(run))), (lo, run)


def test_unshuffled_index_plan_is_storage_order_in_equal_runs():
    plan = computed_plan(PlanSpec(1, 4, False, 0, 0, None, None, "index"),
                         dense_row_space([(0, 6), (1, 5)]))
    addr = all_rows(plan).reshape(4, 2).tolist()
    assert addr == [[0, 1], [2, 3], [4, 5], [1 << 32, (1 << 32) | 1]]


SUBPROCESS_PLAN = """
import json, sys, numpy as np
from lance_ray.plan.index import computed_plan, dense_row_space
from lance_ray.plan.splits import PlanSpec
args = json.loads(sys.argv[1])
plan = computed_plan(PlanSpec(1, *args["spec"], None, "index"), dense_row_space(args["frags"]))
s = np.repeat(np.arange(plan.spec.num_splits), plan.split_len)
p = np.tile(np.arange(plan.split_len), plan.spec.num_splits)
print(json.dumps([plan.fingerprint, plan.rows_at(s, p).tolist()]))
"""


@pytest.mark.parametrize("spec", [(6, True, 11, 2, None), (4, True, 2**63, 0, 7),
                                  (3, False, 0, 1, None)])
def test_the_same_seed_gives_the_same_plan_in_a_fresh_process(spec):
    frags = [[0, 500], [3, 17], [4, 300]]
    args = json.dumps({"spec": list(spec), "frags": frags})
    out = subprocess.run([sys.executable, "-c", SUBPROCESS_PLAN, args], check=True,
                         capture_output=True, text=True).stdout
    fingerprint, rows = json.loads(out)
    here = computed_plan(PlanSpec(1, *spec, None, "index"),
                         dense_row_space([tuple(f) for f in frags]))
    assert fingerprint == here.fingerprint
    assert rows == all_rows(here).tolist()


def test_an_index_plan_holds_the_same_few_bytes_at_a_thousand_and_a_billion_rows():
    def size(rows: int) -> int:
        frags = [(f, min(1 << 20, rows - (f << 20))) for f in range(-(-rows // (1 << 20)))]
        plan = computed_plan(PlanSpec(1, 64, True, 0, 0, None, None, "index"),
                             dense_row_space(frags[:1] if rows < 1 << 20 else frags))
        return len(pickle.dumps(plan))

    # The billion-row plan differs only by its 954 fragments' ids and starts (16 B each).
    assert size(10**9) - size(1000) < 954 * 16 + 512


def test_the_fingerprint_follows_every_plan_input():
    space = dense_row_space([(0, 1000)])
    base = PlanSpec(1, 4, True, 5, 0, 8, None, "index")
    prints = {computed_plan(s, space).fingerprint for s in (
        base, base.for_epoch(1), PlanSpec(1, 4, True, 6, 0, 8, None, "index"),
        PlanSpec(1, 4, True, 5, 0, 9, None, "index"), PlanSpec(2, 4, True, 5, 0, 8, None,
                                                               "index"))}
    prints.add(computed_plan(base, dense_row_space([(0, 999)])).fingerprint)
    assert len(prints) == 6
    assert computed_plan(base, space).fingerprint == computed_plan(base, space).fingerprint


# ----------------------------------------------------------------------- real tables


@PROPERTY
@given(filter=st.sampled_from(["id % 3 != 0", "x < 100", "id >= 990", "id < 0 or id = 5"]),
       num_splits=st.sampled_from([1, 2, 3]), clump=st.one_of(st.none(), st.integers(1, 9)))
def test_index_plan_with_a_filter_yields_only_and_every_matching_row(table_1k, filter,
                                                                     num_splits, clump):
    matching = set(table_1k.to_lance().to_table(filter=filter)["id"].to_pylist())
    if len(matching) < num_splits:
        return
    ds = lance_ray.StreamingDataset(table_1k, num_splits=num_splits, filter=filter,
                                    shuffle_clump_size=clump, plan="index", reader="local")
    got = ids(ds)
    assert len(got) == len(set(got)) == len(matching) - len(matching) % num_splits
    assert set(got) <= matching


def test_index_plan_skips_deleted_rows(tmp_path):
    from conftest import write_table

    table = write_table(str(tmp_path), 300, fragments=3)
    table.delete("id % 7 = 0 or (id >= 100 and id < 200)")
    ds = lance_ray.StreamingDataset(table, num_splits=2, plan="index", reader="local")
    alive = set(table.to_lance().to_table()["id"].to_pylist())
    got = ids(ds)
    assert len(got) == len(set(got)) == len(alive) - len(alive) % 2
    assert set(got) <= alive


def test_a_filtered_views_next_epoch_shares_its_rows_instead_of_scanning_again(table_1k):
    """A view holds this epoch's plan and builds the next one ahead: one row list (4 bytes
    per matching row) serves both, and goes once no plan holds it."""
    import gc

    from lance_ray.plan import index

    ds = lance_ray.StreamingDataset(table_1k, num_splits=2, filter="id % 3 != 0",
                                    plan="index", reader="local")
    next(ds.iter_batches(8))
    later = lance_ray.StreamingDataset(table_1k, num_splits=2, filter="id % 3 != 0",
                                       plan="index", reader="local", epoch=1)
    rows = ds.plan.computed.rows
    assert rows.offsets is not None and later.plan.computed.rows is rows
    del ds, later, rows
    gc.collect()
    assert not [k for k in index._row_spaces if k[2] == "id % 3 != 0"]


def test_a_checkpoint_of_one_plan_mode_is_refused_by_the_other(table_1k):
    index = lance_ray.StreamingDataset(table_1k, num_splits=4, plan="index", reader="local")
    lancedb = lance_ray.StreamingDataset(table_1k, num_splits=4, reader="local")
    for ds, state, theirs in ((lancedb, index.state_dict(), "index"),
                              (index, lancedb.state_dict(), "lancedb")):
        with pytest.raises(ValueError, match=f"plan mode mismatch.*plan={theirs!r}"):
            ds.load_state_dict(state)
    reference_format = {k: v for k, v in lancedb.state_dict().items() if k != "lance_ray"}
    with pytest.raises(ValueError, match="mismatch.*plan='lancedb' .it has no lance_ray identity"):
        index.load_state_dict(reference_format)
    with pytest.raises(ValueError, match="plan mismatch across state dicts"):
        merge_state_dicts([
            lance_ray.StreamingDataset(table_1k, num_splits=4, world_size=2, rank=r,
                                       plan=mode, reader="local").state_dict()
            for r, mode in ((0, "index"), (1, "lancedb"))])
    assert "plan" not in lancedb.state_dict()["lance_ray"]  # the default format is unchanged


def test_an_unknown_plan_mode_is_refused_naming_the_modes(table_1k):
    with pytest.raises(ValueError, match=r"plan must be one of \('lancedb', 'index'\)"):
        lance_ray.StreamingDataset(table_1k, plan="feistel")


def test_the_lancedb_plan_past_its_builder_limit_names_the_limit_and_plan_index(tmp_path):
    """lancedb 0.40's builder sorts in a fixed 100 MB pool: 3M shuffled rows fail (its own
    error is translated); above 3M the builder is not even tried."""
    import lance
    import pyarrow as pa

    uri = str(tmp_path / "three_million.lance")
    lance.write_dataset(pa.table({"id": np.arange(3_000_000, dtype=np.int64)}), uri)
    with pytest.raises(PlanTooLargeError) as caught:
        lance_ray.StreamingDataset(uri, num_splits=8, reader="local")
    message = str(caught.value)
    assert "plan='index'" in message and "2.5M" in message and "3,000,000" in message
    assert "external sort" not in message and "datafusion" not in message.lower()
    assert caught.value.__cause__ is None  # DataFusion's message is not chained on
    ds = lance_ray.StreamingDataset(uri, num_splits=8, reader="local", plan="index")
    assert (len(ds), ds.plan.split_len) == (3_000_000, 3_000_000 // 8)
    # Above 3M rows the same error comes at once, without running the builder.
    lance.write_dataset(pa.table({"id": np.array([3_000_000])}), uri, mode="append")
    with pytest.raises(PlanTooLargeError, match="3,000,001 rows shuffled.*plan='index'"):
        lance_ray.StreamingDataset(uri, num_splits=8, reader="local", shuffle_clump_size=64)


def test_the_index_order_is_pinned_across_releases():
    """The per-index order is part of the checkpoint contract: the same seed gives the same
    permutation in every release (values recorded when plan="index" shipped)."""
    small = Feistel.of(1000, 7)(np.arange(12, dtype=np.uint64)).tolist()
    large = Feistel.of(2**40, 3)(np.arange(4, dtype=np.uint64)).tolist()
    assert small == [307, 142, 103, 262, 656, 388, 242, 549, 239, 55, 251, 650]
    assert large == [320719758313, 772090952782, 309791062887, 941660979793]
