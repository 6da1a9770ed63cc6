"""Synthetic LanceDB tables for trying lance_ray, its docs, tests and benchmarks.

    from lance_ray.testing import create_table, token_rows
    table = create_table("data/db", "demo", rows=20_000, dim=16)
    tokens = create_table("data/db", "tokens", rows=1_000, batch=token_rows(mean_len=100))

Columns: ``id`` (int64, 0..rows-1), ``label`` (int64), ``x`` (float32) and ``v``
(fixed-size list of ``dim`` float32). A token table instead has ``id`` and ``tokens``
(``list<int32>``, one document per row, lognormal lengths; see :func:`token_batch`). Tables
are written in ``fragments`` appends so reads cross fragments as they do on real tables.
``python -m jobs.make_table`` is the same as a Ray job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa

logger = logging.getLogger(__name__)


def synthetic_batch(lo: int, hi: int, dim: int, seed: int = 0) -> pa.Table:
    """Rows ``lo .. hi-1``; every value is a pure function of the row id."""
    ids = np.arange(lo, hi, dtype=np.int64)
    rng = np.random.default_rng([seed, lo])
    vectors = rng.standard_normal((hi - lo, dim), dtype=np.float32)
    return pa.table({
        "id": ids,
        "label": ids % 10,
        "x": (ids % 1000).astype(np.float32) / 1000,
        "v": pa.FixedSizeListArray.from_arrays(pa.array(vectors.reshape(-1)), dim),
    })


# Token ids below FIRST_TOKEN never occur in documents: packing reserves them.
PAD_ID, EOS_ID, FIRST_TOKEN = 0, 1, 2
LENGTH_SIGMA = 1.0  # of log(length): a long tail of long documents, as in real corpora


def document_lengths(lo: int, hi: int, mean_len: float, seed: int = 0) -> np.ndarray:
    """Lengths (>= 1) of documents ``lo .. hi-1``: lognormal with mean about ``mean_len``."""
    rng = np.random.default_rng([seed, lo, 1])
    mu = np.log(mean_len) - LENGTH_SIGMA**2 / 2  # E[exp(N(mu, s^2))] = exp(mu + s^2/2)
    return np.maximum(1, np.rint(rng.lognormal(mu, LENGTH_SIGMA, hi - lo))).astype(np.int64)


def token_batch(lo: int, hi: int, *, mean_len: float = 500.0, vocab: int = 32_000,
                seed: int = 0) -> pa.Table:
    """Documents ``lo .. hi-1``, a pure function of (seed, lo, hi).

    Each document counts up from a random token by a random stride (1..3) modulo the
    vocabulary, so a tiny language model can learn it and every block's content differs.
    """
    lengths = document_lengths(lo, hi, mean_len, seed)
    rng = np.random.default_rng([seed, lo, 2])
    span = vocab - FIRST_TOKEN
    start = rng.integers(0, span, hi - lo)
    stride = rng.integers(1, 4, hi - lo)
    offsets = np.zeros(hi - lo + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    within = np.arange(offsets[-1]) - np.repeat(offsets[:-1], lengths)
    values = (np.repeat(start, lengths) + np.repeat(stride, lengths) * within) % span
    tokens = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)),
                                      pa.array((values + FIRST_TOKEN).astype(np.int32)))
    return pa.table({"id": np.arange(lo, hi, dtype=np.int64), "tokens": tokens})


def token_rows(mean_len: float = 500.0, vocab: int = 32_000
               ) -> Callable[[int, int, int], pa.Table]:
    """``create_table``'s ``batch`` for a token table (:func:`token_batch`; no ``dim``)."""
    return lambda lo, hi, dim: token_batch(lo, hi, mean_len=mean_len, vocab=vocab)


def blocks_per_epoch(uri: str, block_len: int, num_splits: int,
                     column: str = "tokens") -> int:
    """Packed blocks of ``block_len`` holding every token of the Lance dataset at ``uri``
    (each document ends with an EOS), rounded down to a multiple of ``num_splits``: the
    exact ``blocks_per_epoch`` (splits with more tokens than the average lose their tail,
    the others end in padding, as the reference's fixed per-split budget does)."""
    import lance
    import pyarrow.compute as pc

    lengths = pc.list_value_length(lance.dataset(uri).to_table(columns=[column]).column(0))
    tokens = int(pc.sum(lengths).as_py()) + len(lengths)
    return max(num_splits, tokens // block_len // num_splits * num_splits)


def create_table(db_path: str, name: str = "demo", *, rows: int, dim: int = 16,
                 fragments: int = 4, overwrite: bool = True,
                 batch: Callable[[int, int, int], pa.Table] = synthetic_batch):
    """Create (or replace) table ``name`` in the LanceDB database at ``db_path``: rows
    ``batch(lo, hi, dim)`` written in ``fragments`` appends (the tests' tables pass their own
    ``batch``)."""
    import lancedb

    db = lancedb.connect(db_path)
    if overwrite and name in db.table_names():
        db.drop_table(name)
    bounds = np.linspace(0, rows, fragments + 1).astype(int)
    started = time.monotonic()
    table = None
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        data = batch(int(lo), int(hi), dim)
        table = db.create_table(name, data) if table is None else table
        if table.count_rows() < hi:
            table.add(data)
        logger.info("wrote rows %d..%d (%.0f rows/s)", lo, hi,
                    hi / max(time.monotonic() - started, 1e-9))
    return table
