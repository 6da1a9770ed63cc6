"""Create a synthetic LanceDB table for demos, tests and benchmarks.

    python jobs/make_table.py --db runs/demo/db --rows 20000 --dim 16
    python jobs/make_table.py --db runs/lm/db --name tokens --tokens --rows 50000

Columns: ``id`` (int64, 0..rows-1), ``label`` (int64), ``x`` (float32) and ``v``
(fixed-size list of ``dim`` float32). With ``--tokens`` a token table instead: ``id`` and
``tokens`` (``list<int32>``, one document per row, lognormal lengths with mean
``--mean-len``; see :func:`token_batch`). Written in ``--fragments`` appends so reads cross
fragments as they do on real tables.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable

import numpy as np
import pyarrow as pa

logger = logging.getLogger("make_table")


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="runs/demo/db", help="LanceDB database directory")
    parser.add_argument("--name", default="demo")
    parser.add_argument("--rows", type=int, default=20_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--fragments", type=int, default=4)
    parser.add_argument("--tokens", action="store_true",
                        help="a token table (one document per row) instead")
    parser.add_argument("--mean-len", type=float, default=500.0,
                        help="--tokens: mean document length")
    parser.add_argument("--vocab", type=int, default=32_000, help="--tokens: vocabulary size")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    table = create_table(args.db, args.name, rows=args.rows, dim=args.dim,
                         fragments=args.fragments,
                         batch=token_rows(args.mean_len, args.vocab) if args.tokens
                         else synthetic_batch)
    print(f"table {args.name!r} at {args.db}: {table.count_rows()} rows, version {table.version}")


if __name__ == "__main__":
    main()
