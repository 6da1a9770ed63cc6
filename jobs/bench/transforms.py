"""Transform throughput: an image-decode and a tokenizer-like transform, every loader.

    python -m jobs.bench --only transforms        (the driver: jobs.bench.run)
    python -m jobs.bench.transforms tables DB RESULT.json   (writes the two tables)

Two tables, written once and reused: ``images`` (6,000 PNG-encoded 64x64 RGB images, a
gradient plus noise, ~9 KB each, and a label) and ``texts`` (20,000 lines of ~275 chars of
English-like words). Two transforms over them, both returning one dict per row:

* ``decode_png``: PIL decodes the image to a ``uint8[64, 64, 3]`` array (C code, the GIL
  mostly held);
* ``tokenize``: pure Python, GIL-bound: a regex split, a per-character rolling hash per word
  into a 30,000-id vocabulary, truncated and padded to 128 ``int64`` ids plus an attention
  mask.

For each: the single-core rate of the transform alone over the table's Arrow batches (one
thread, no loader: the "limit" row; the bound is that times the cores), lance_ray's Ray
reader, its local reader (two transform threads, in-process), its ``StreamingDataLoader``
with two workers, the reference (``lancedb.streaming`` + ``DataLoader``, its default
transform thread pool), and ``ray.data.read_lance(...).map_batches(...)``. The scaling rows
run the image case on a ``ray.cluster_utils.Cluster`` of its own: a head with no CPU for
tasks plus 1, 2 or 3 simulated CPU-only nodes, ``ray_remote_args`` placing the read and
transform tasks there (on a 2-core machine the nodes share the same two cores: the figures
show the mechanism, not more hardware).
"""

from __future__ import annotations

import io
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

IMAGES, TEXTS = 6_000, 20_000
SIDE, MAX_TOKENS, VOCAB = 64, 128, 30_000
WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by",
         "at", "from", "data", "model", "train", "loader", "stream", "lance", "ray", "tensor",
         "batch", "epoch", "shuffle", "split", "rank", "worker", "image", "token", "text"]
WORD = re.compile(r"\w+|[^\w\s]")
CASES = {"image": ("images", IMAGES), "tokens": ("texts", TEXTS)}


def decode_png(batch: pa.RecordBatch) -> list[dict[str, Any]]:
    """One ``{"image": uint8[64, 64, 3], "label": int, "id": int}`` per row."""
    from PIL import Image

    return [{"image": np.asarray(Image.open(io.BytesIO(png)).convert("RGB")), "label": label,
             "id": i}
            for png, label, i in zip(batch.column("png").to_pylist(),
                                     batch.column("label").to_pylist(),
                                     batch.column("id").to_pylist())]


def _token_ids(text: str) -> np.ndarray:
    ids = [1]
    for word in WORD.findall(text.lower()):
        h = 0
        for c in word:
            h = (h * 31 + ord(c)) % VOCAB
        ids.append(h + 3)
    ids = ids[: MAX_TOKENS - 1] + [2]
    out = np.zeros(MAX_TOKENS, dtype=np.int64)
    out[: len(ids)] = ids
    return out


def tokenize(batch: pa.RecordBatch) -> list[dict[str, Any]]:
    """One ``{"input_ids": int64[128], "attention_mask": int64[128], "id": int}`` per row."""
    out = []
    for text, i in zip(batch.column("text").to_pylist(), batch.column("id").to_pylist()):
        ids = _token_ids(text)
        out.append({"input_ids": ids, "attention_mask": (ids != 0).astype(np.int64), "id": i})
    return out


TRANSFORMS = {"image": decode_png, "tokens": tokenize}


class CountedByNode:
    """``fn``, also appending ``<node id> <rows>`` to ``path`` on each call: which node of
    the cluster ran the transform on how many rows."""

    def __init__(self, fn: Any, path: str):
        self.fn, self.path = fn, path

    def __call__(self, batch: pa.RecordBatch) -> list[Any]:
        import ray

        with open(self.path, "a") as f:
            f.write(f"{ray.get_runtime_context().get_node_id()} {batch.num_rows}\n")
        return self.fn(batch)


def stack_items(items: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """What a Ray Data user's ``map_batches`` returns: one stacked array per key."""
    return {k: np.stack([np.asarray(x[k]) for x in items]) for k in items[0]}


class RayDataTransform:
    """``map_batches`` function for ``ray.data.read_lance``: the same transform, stacked."""

    def __init__(self, case: str):
        self.case = case

    def __call__(self, table: pa.Table) -> dict[str, np.ndarray]:
        batch = table.combine_chunks().to_batches()[0]
        return stack_items(TRANSFORMS[self.case](batch))


def image_rows(lo: int, hi: int) -> pa.Table:
    from PIL import Image

    rng = np.random.default_rng([7, lo])
    base = np.add.outer(np.arange(SIDE), np.arange(SIDE)).astype(np.uint8)[..., None]
    pngs = []
    for _ in range(lo, hi):
        img = (base * np.array([1, 2, 3], np.uint8) + rng.integers(0, 32, (SIDE, SIDE, 3))
               ).astype(np.uint8)
        buf = io.BytesIO()
        Image.fromarray(img).save(buf, format="PNG")
        pngs.append(buf.getvalue())
    ids = np.arange(lo, hi, dtype=np.int64)
    return pa.table({"id": ids, "label": ids % 10, "png": pa.array(pngs, pa.binary())})


def text_rows(lo: int, hi: int) -> pa.Table:
    rng = np.random.default_rng([11, lo])
    texts = [" ".join(rng.choice(WORDS, int(rng.integers(40, 60)))) + "." for _ in range(lo, hi)]
    ids = np.arange(lo, hi, dtype=np.int64)
    return pa.table({"id": ids, "label": ids % 10, "text": texts})


def ensure_tables(db: Path, fragments: int = 4) -> dict[str, Any]:
    """``{name: {"uri", "rows"}}`` of the two tables, written unless already there."""
    import lancedb

    conn = lancedb.connect(str(db))
    out = {}
    for name, rows, make in (("images", IMAGES, image_rows), ("texts", TEXTS, text_rows)):
        marker = db / f"{name}.bench.json"
        if marker.exists() and name in conn.table_names() \
                and conn.open_table(name).count_rows() == rows:
            table = conn.open_table(name)
        else:
            started = time.perf_counter()
            if name in conn.table_names():
                conn.drop_table(name)
            bounds = np.linspace(0, rows, fragments + 1).astype(int)
            table = conn.create_table(name, make(int(bounds[0]), int(bounds[1])))
            for lo, hi in zip(bounds[1:-1], bounds[2:]):
                table.add(make(int(lo), int(hi)))
            marker.write_text(json.dumps({"rows": rows}))
            print(f"created table {name!r}: {rows:,} rows in {time.perf_counter() - started:.1f}s",
                  flush=True)
        out[name] = {"uri": table.to_lance().uri, "rows": rows}
    return out


def single_core_batches(uri: str, case: str, batch_rows: int) -> tuple[list[Any], Any]:
    """The table's Arrow batches (read before timing) and the transform to time over them."""
    import lance

    batches = list(lance.dataset(uri).to_batches(batch_size=batch_rows))
    return batches, TRANSFORMS[case]


if __name__ == "__main__":
    if sys.argv[1:2] == ["tables"]:
        Path(sys.argv[3]).write_text(json.dumps(ensure_tables(Path(sys.argv[2]))))
