"""Range reads: a read of sorted row addresses (runs of consecutive rows read as ranges by a
restricted scan) returns exactly the rows, in exactly the order, a take of the same ids does,
on tables with several fragments, deleted rows, and stable row ids (read with a take)."""

from __future__ import annotations

import lance
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lance_ray.plan.resolve import resolve_table
from lance_ray.read.take import TAKE_BYTES, read_sorted, take_in_order


def _write(path: str, *, stable: bool) -> str:
    data = [pa.table({"id": np.arange(lo, lo + 300, dtype=np.int64),
                      "s": [f"row-{i}" * (i % 5) for i in range(lo, lo + 300)]})
            for lo in (0, 300, 600)]
    kw = {"enable_stable_row_ids": True} if stable else {}
    ds = lance.write_dataset(data[0], path, **kw)
    for part in data[1:]:
        ds = lance.write_dataset(part, path, mode="append")
    ds.delete("id % 7 = 3 OR (id >= 310 AND id < 330)")  # deletion files in every fragment
    return path


@pytest.fixture(scope="module", params=[False, True], ids=["addresses", "stable-row-ids"])
def table(request, tmp_path_factory):
    path = _write(str(tmp_path_factory.mktemp("ranges") / "t.lance"), stable=request.param)
    ref = resolve_table(path)
    row_ids = ref.open_lance().to_table(columns=[], with_row_id=True).column("_rowid")
    return ref, np.sort(row_ids.to_numpy().astype(np.uint64))


PROPERTY = settings(deadline=None, max_examples=60,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@PROPERTY
@given(data=st.data(), clump=st.sampled_from([1, 2, 7, 64, 1000]),
       columns=st.sampled_from([None, ["id"], ["s", "id"]]),
       piece=st.sampled_from([None, 1, 3, 50]))
def test_a_range_read_returns_the_rows_of_a_take_in_order(table, data, clump, columns, piece):
    """Also when a read is made in pieces (rows of a width whose ``TAKE_BYTES`` is
    ``piece`` rows)."""
    ref, ids = table
    starts = data.draw(st.lists(st.integers(0, len(ids) - 1), min_size=1, max_size=12))
    wanted = np.unique(np.concatenate([ids[s : s + clump] for s in starts]))
    got = read_sorted(ref, wanted, columns, None if piece is None else TAKE_BYTES // piece)
    assert got.equals(ref.take_rows(wanted, columns))
    if piece is not None and not ref.open_lance().has_stable_row_ids:
        assert got.column(0).num_chunks >= -(-len(wanted) // piece)
    # And through the plan-order path, rows shuffled back to the order asked for.
    shuffled = np.random.default_rng(len(wanted)).permutation(wanted)
    assert take_in_order(ref, shuffled, columns).column("id").to_pylist() == \
        ref.take_rows(shuffled, ["id"]).column("id").to_pylist()


def test_a_deleted_row_is_refused_not_skipped(table):
    ref, ids = table
    if ref.open_lance().has_stable_row_ids:
        pytest.skip("stable row ids are read with a take, which Lance defines for them")
    deleted = np.array([(1 << 32) | 15], dtype=np.uint64)  # id 315, fragment 1: deleted
    with pytest.raises(RuntimeError, match="no longer holds the planned rows"):
        take_in_order(ref, np.concatenate([ids[:5], deleted]), ["id"])
