"""Reads sized by bytes: with 1 MB rows a reader holds no more than its in-flight budget and
each read stays under the byte target, and the sequence is the reference's.

Bytes are measured where the reader holds them (``Held``: reads submitted, running or done
but not yet handed to the consumer; the Ray reader's blocks received but not handed over),
not as RSS, which a test cannot pin on a shared machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lancedb
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from lancedb import streaming as reference

import lance_ray
from jobs.bench.wide import ensure_wide_table
from lance_ray.read.convert import gather_rows
from lance_ray.view import readers

ROW = 1 << 20  # 1 MB of random bytes per row
ROWS = 200


@pytest.fixture(scope="module")
def wide_table(tmp_path_factory) -> Any:
    db = tmp_path_factory.mktemp("wide")
    ensure_wide_table(Path(db), "wide", ROWS, ROW)
    return lancedb.connect(str(db)).open_table("wide")


class Spy:
    """Keeps every reader a view makes, and the bytes of every read it returned."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.readers: list[Any] = []
        self.read_bytes: list[int] = []
        make = readers.make_reader

        def spying(*args: Any, **kwargs: Any) -> Any:
            reader = make(*args, **kwargs)
            self.readers.append(reader)
            inner = reader.iter_chunks

            def iter_chunks(requests: Any) -> Any:
                for chunk in inner(requests):
                    if chunk.cost.nbytes:  # a read's cost rides on its first result
                        self.read_bytes.append(chunk.cost.nbytes)
                    yield chunk

            reader.iter_chunks = iter_chunks
            return reader

        monkeypatch.setattr(readers, "make_reader", spying)


CASES = [
    pytest.param("local", None, None, id="local-defaults"),
    pytest.param("local", 3 * ROW, 8 * ROW, id="local-small-budget"),
    pytest.param("ray", 3 * ROW, 8 * ROW, id="ray-small-budget"),
]


@pytest.mark.parametrize(("reader", "read_bytes", "prefetch_bytes"), CASES)
def test_wide_rows_keep_reads_under_the_target_and_in_flight_bytes_under_the_budget(
        request, monkeypatch, wide_table, reader, read_bytes, prefetch_bytes):
    if reader == "ray":
        request.getfixturevalue("ray_session")
    kw = {"num_splits": 4, "shuffle_seed": 3, "shuffle_clump_size": 8}
    spy = Spy(monkeypatch)
    ds = lance_ray.StreamingDataset(wide_table, reader=reader, io_queue_depth=8,
                                    read_bytes=read_bytes, prefetch_bytes=prefetch_bytes, **kw)
    sizing = ds._reads.sizing
    assert abs(sizing.row_bytes - ROW) < ROW // 100  # the width estimate, from metadata
    got = []
    for batch in ds.iter_batches(8):
        assert (batch["payload"]["offsets"].diff() == ROW).all()  # every row, whole
        got += batch["id"].tolist()
    want = [r["id"] for r in reference.StreamingDataset(wide_table, columns=["id"], **kw)]
    assert got == want
    (used,) = spy.readers
    assert 0 < used.held.peak <= sizing.budget_bytes
    # Every read holds at most the target (one row when a row alone exceeds it).
    assert spy.read_bytes and max(spy.read_bytes) <= max(sizing.target_bytes, ROW) + ROW // 10


def test_the_width_estimate_follows_the_columns_read(wide_table):
    narrow = lance_ray.StreamingDataset(wide_table, reader="local", columns=["id", "label"])
    assert narrow._reads.sizing.row_bytes == 16
    sizing = narrow._reads.sizing
    assert sizing.steady_rows == sizing.max_rows  # bounded by rows, not bytes


def test_ray_reads_default_to_a_larger_byte_target_and_an_explicit_one_wins(wide_table):
    """A Ray Data task has a fixed cost in the trainer, so its reads default larger; the
    sizing is fixed when the view is built, so DataLoader workers cut the same reads."""
    from lance_ray.read.requests import RAY_READ_TARGET_BYTES, READ_TARGET_BYTES
    from lance_ray.view.readers import read_sizing

    ref = lance_ray.StreamingDataset(wide_table, reader="local")._table
    for reader, want in (("ray", RAY_READ_TARGET_BYTES), ("local", READ_TARGET_BYTES)):
        sizing = read_sizing(ref, None, 65536, None, None, reader=reader)
        assert sizing.target_bytes == want and sizing.steady_rows == want // sizing.row_bytes
        assert read_sizing(ref, None, 65536, 8 << 20, None, reader=reader).target_bytes == 8 << 20
    assert RAY_READ_TARGET_BYTES > READ_TARGET_BYTES


@settings(deadline=None, max_examples=80)
@given(lengths=st.lists(st.integers(0, 700), min_size=1, max_size=40), seed=st.integers(0, 9),
       inner=st.sampled_from([None, 3]), cuts=st.lists(st.integers(0, 40), max_size=3))
def test_rows_gathered_slice_by_slice_equal_the_element_gather(lengths, seed, inner, cuts):
    shape = (sum(lengths),) if inner is None else (sum(lengths), inner)
    values = np.arange(int(np.prod(shape)), dtype=np.int64).reshape(shape)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
    order = np.random.default_rng(seed).permutation(len(lengths))
    starts, lens = starts[order], np.asarray(lengths, dtype=np.int64)[order]
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    want = np.concatenate([values[s : s + n] for s, n in zip(starts, lens)])
    assert np.array_equal(gather_rows([values], starts, lens, offsets), want)
    # The same values in chunks (cut between rows, as a read's fragments are).
    row_ends = np.cumsum(lengths)
    edges = sorted({0, len(values), *(int(row_ends[min(c, len(lengths) - 1)]) for c in cuts)})
    chunks = [values[a:b] for a, b in zip(edges, edges[1:])] or [values]
    assert np.array_equal(gather_rows(chunks, starts, lens, offsets), want)


def _object_store_peak_mib(ds: Any, pause_s: float) -> int:
    """The object store's peak use over an epoch of ``ds`` read by a consumer that pauses
    after every batch, above its use before (sampled every 50 ms)."""
    import re
    import threading
    import time

    import ray
    from ray._private.internal_api import memory_summary

    # This session's cluster by its address: with no address Ray looks for one on the machine
    # and finds several when other clusters run beside the tests.
    address = ray.get_runtime_context().gcs_address

    def used() -> int:
        summary = memory_summary(address, stats_only=True)
        found = re.search(r"Plasma memory usage (\d+) MiB", summary)
        return int(found.group(1)) if found else 0

    base, peak, done = used(), [0], threading.Event()

    def sample() -> None:
        while not done.wait(0.05):
            peak[0] = max(peak[0], used() - base)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        for _ in ds.iter_batches(2):
            time.sleep(pause_s)
    finally:
        done.set()
        sampler.join()
    return peak[0]


def test_a_slow_consumer_holds_the_ray_pipeline_within_its_run_ahead_bound(
        ray_session, wide_table, monkeypatch):
    """Reads of 2 rows (2 MB) and a 4 MB budget: about 100 read tasks over the 200 MB table.
    The run-ahead bound (``read.run_ahead``) keeps the object store near the budget; the same
    pipeline without Ray Data's reservation and without the bound fills it with the table."""
    import ray.data

    from lance_ray.read import ray_data

    def view() -> Any:
        return lance_ray.StreamingDataset(wide_table, reader="ray", num_splits=4,
                                          shuffle_seed=3, read_bytes=2 * ROW,
                                          prefetch_bytes=4 * ROW, io_queue_depth=2)

    bounded = _object_store_peak_mib(view(), pause_s=0.08)
    monkeypatch.setattr(ray_data.RayDataReader, "_run_ahead", lambda self, requests: None)
    monkeypatch.setattr(ray.data.DataContext.get_current(), "op_resource_reservation_enabled",
                        False)
    unbounded = _object_store_peak_mib(view(), pause_s=0.08)
    print(f"object store peak: bounded {bounded} MiB, unbounded {unbounded} MiB")
    # Ray frees objects lazily, so the samples carry some tens of MiB beyond the bound.
    assert bounded <= 100
    assert unbounded >= bounded + 50


def test_blocks_far_wider_than_their_estimate_keep_the_planned_order(ray_session, tmp_path,
                                                                     monkeypatch):
    """Values that compress well make the width estimate (bytes on disk) far too small: a
    read the estimate put under Ray Data's block size comes out above it, Ray Data slices
    it, and a slice of rows in Lance's order would scatter the positions."""
    import pyarrow as pa
    from ray.data import DataContext

    monkeypatch.setattr(DataContext.get_current(), "target_max_block_size", 256 * 1024)
    n = 2000
    table = lancedb.connect(tmp_path).create_table("t", pa.table({
        "id": np.arange(n), "s": pa.array([("ab"[i % 2]) * 2000 for i in range(n)])}))
    kw: dict[str, Any] = {"num_splits": 2, "shuffle_seed": 7, "columns": ["id", "s"]}
    ray_ds = lance_ray.StreamingDataset(table, reader="ray", **kw)
    assert ray_ds._reads.sizing.row_bytes < 200  # the estimate, against 2 KB in memory
    want = [b["id"].tolist() for b in lance_ray.StreamingDataset(
        table, reader="local", **kw).iter_batches(100)]
    assert [b["id"].tolist() for b in ray_ds.iter_batches(100)] == want


class Blobs:
    """A transform whose items carry 16 KB of bytes each (an encoded image, say)."""

    def __call__(self, batch: Any) -> list[dict[str, Any]]:
        return [{"id": i, "blob": bytes(16384)} for i in batch.column("id").to_pylist()]


def test_tasks_are_sized_by_the_bytes_their_items_carry(ray_session, table_factory,
                                                        monkeypatch):
    """Bytes leaves count in a task's output: tasks stay within the memory they may use
    (a bytes item counted as nothing made each task's output the size of a whole share)."""
    from lance_ray.read import ray_data

    blocks: list[int] = []
    chunk = ray_data.RayDataReader._chunk

    def measured(self: Any, block: Any) -> Any:
        blocks.append(block.nbytes)
        return chunk(self, block)

    monkeypatch.setattr(ray_data.RayDataReader, "_chunk", measured)
    ds = lance_ray.StreamingDataset(table_factory(1500, 3), reader="ray", transform=Blobs(),
                                    num_splits=2, prefetch_bytes=2 << 20)
    got = [i["id"] for b in ds.iter_batches(100, collate_fn=lambda rows: rows) for i in b]
    assert sorted(got) == list(range(1500))
    assert max(blocks) <= 2 << 20, blocks
