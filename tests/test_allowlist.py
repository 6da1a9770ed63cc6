"""Allowlist encoding: lance_ray's numpy encoder of row-address allowlists gives exactly the
bytes of pylance's ``serialize_row_addrs`` (array and bitmap containers, many fragments,
offsets up to 2^32 - 1), and a read falls back to pylance's encoder when they differ."""

from __future__ import annotations

import lance
import numpy as np
import pyarrow as pa
from hypothesis import given, settings
from hypothesis import strategies as st
from lance.dataset import serialize_row_addrs

from lance_ray.plan.resolve import resolve_table
from lance_ray.read import allowlist as al
from lance_ray.read.take import read_sorted


@st.composite
def addresses(draw: st.DrawFn) -> np.ndarray:
    parts = []
    for fragment in draw(st.lists(st.integers(0, 2**32 - 1), max_size=4, unique=True)):
        # A window of the offset space (anywhere, up to its top) and a density in it, so
        # that containers come out sparse (arrays), dense (bitmaps) or full.
        size = draw(st.sampled_from([1, 100, 5000, 70_000, 200_000]))
        base = draw(st.integers(0, 2**32 - size))
        density = draw(st.sampled_from([0.001, 0.05, 0.5, 1.0]))
        seed = draw(st.integers(0, 2**16))
        keep = np.random.default_rng(seed).random(size) < density
        offsets = base + np.flatnonzero(keep).astype(np.uint64)
        parts.append((np.uint64(fragment) << np.uint64(32)) | offsets)
    ids = np.concatenate(parts) if parts else np.empty(0, np.uint64)
    return np.unique(ids)


@settings(deadline=None, max_examples=200)
@given(addresses())
def test_encoding_is_pylances_byte_for_byte(ids):
    assert al.encode(ids) == serialize_row_addrs(ids.tolist())


def test_a_read_falls_back_to_pylances_encoder(tmp_path, monkeypatch):
    path = str(tmp_path / "t.lance")
    lance.write_dataset(pa.table({"id": np.arange(300, dtype=np.int64)}), path)
    lance.write_dataset(pa.table({"id": np.arange(300, 600, dtype=np.int64)}), path,
                        mode="append")
    ref = resolve_table(path)
    rows = lance.dataset(path).to_table(columns=[], with_row_id=True)
    wanted = np.sort(rows.column("_rowid").to_numpy())[::7].astype(np.uint64)
    fast = read_sorted(ref, wanted, ["id"])
    assert al._matches_pylance()
    monkeypatch.setattr(al, "_matches_pylance", lambda: False)
    assert read_sorted(ref, wanted, ["id"]).equals(fast)
    assert fast.column("id").to_pylist() == list(range(0, 600, 7))
