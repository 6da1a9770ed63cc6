"""The packed-tokens case: ``pack_sequences`` from lance_ray and from the reference, and the
sequential scan of the token column that bounds them, on one generated token table.

    python -m jobs.bench --only packing

The table: ``PACK_DOCS`` documents with lognormal lengths (mean ``PACK_MEAN_LEN`` tokens,
``lance_ray.testing.tables.token_batch``), packed into blocks of ``PACK_LEN`` over ``SPLITS`` splits
with the exact ``blocks_per_epoch`` (every token of the table). A runner's "rows" are the
tokens of the blocks it delivered (``PACK_BATCH`` blocks per batch, padding included: what
a trainer receives), and for the scan the tokens of the rows it read.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from .configs import SEED, SPLITS, TAKE_ROWS, Config
from .runners import Runner, limit_runner

PACK_TABLE = "bench_tokens"
PACK_DOCS = 50_000
PACK_MEAN_LEN = 500.0
PACK_VOCAB = 32_000
PACK_LEN = 2048
PACK_BATCH = 8  # blocks per batch (lance_ray iter_batches, the reference's DataLoader)
GROUP = "packing"  # --only packing runs every configuration below
SCAN_TARGET = 0.3  # the target: packed tokens/s >= this fraction of the scan


def packing_configurations() -> list[Config]:
    kw: dict[str, Any] = {"shuffle": "full", "table": "tokens", "group": GROUP}
    return [
        Config("pack-limit-scan", f"Lance scan of the token column, {TAKE_ROWS} rows/call",
               "limit", limit="scan", **kw),
        Config("pack-limit-take", f"Lance take of the token column, random order, "
               f"{4 * TAKE_ROWS} rows/call", "limit", limit="take_random_big", **kw),
        Config("pack-reference", f"lancedb.streaming packed + DataLoader({PACK_BATCH})",
               "reference", **kw),
        Config("pack-ray", f"lance_ray packed iter_batches({PACK_BATCH}) (ray)", "lance_ray",
               reader="ray", **kw),
        Config("pack-local", f"lance_ray packed iter_batches({PACK_BATCH}) (local)",
               "lance_ray", reader="local", **kw),
        Config("pack-loader", f"lance_ray packed StreamingDataLoader({PACK_BATCH}, nw=2)",
               "lance_ray", reader="local", loader_workers=2, **kw),
    ]


def pack_kwargs(blocks_per_epoch: int) -> dict[str, Any]:
    from lance_ray.testing.tables import EOS_ID, PAD_ID

    return {"num_splits": SPLITS, "shuffle_seed": SEED, "columns": ["tokens"],
            "pack_sequences": PACK_LEN, "eos_id": EOS_ID, "pad_id": PAD_ID,
            "blocks_per_epoch": blocks_per_epoch}


def packing_runner(spec: dict[str, Any], cfg: Config, mp_context: str | None = None
                   ) -> Runner:
    """How one packing configuration reads the epoch; its counts are tokens."""
    blocks = spec["blocks_per_epoch"]
    epoch_tokens = blocks * PACK_LEN
    if cfg.kind == "limit":
        return token_limit_runner(spec["uri"], cfg.limit or "scan", epoch_tokens)

    def count(batch: dict) -> int:
        return int(batch["input_ids"].numel())

    import lancedb

    table = lancedb.connect(spec["db"]).open_table(spec["table_name"])
    kwargs = pack_kwargs(blocks)
    if cfg.kind == "reference":
        from lancedb.streaming import StreamingDataset as Reference
        from torch.utils.data import DataLoader

        def make_ref(state: dict | None) -> tuple[Any, Iterator[Any]]:
            ds = Reference(table, **kwargs)
            return ds, iter(DataLoader(ds, batch_size=PACK_BATCH, num_workers=0))

        return Runner(make_ref, count, epoch_tokens)
    import inspect

    import lance_ray

    if "pack_sequences" not in inspect.signature(lance_ray.StreamingDataset).parameters:
        raise NotImplementedError("this lance_ray has no pack_sequences (the packing "
                                  "branch is not merged)")

    def make_lr(state: dict | None) -> tuple[Any, Iterator[Any]]:
        ds = lance_ray.StreamingDataset(table, reader=cfg.reader, **kwargs)
        if cfg.loader_workers:
            return ds, iter(lance_ray.StreamingDataLoader(ds, batch_size=PACK_BATCH,
                                                          num_workers=cfg.loader_workers))
        return ds, ds.iter_batches(PACK_BATCH)

    # Warmed up on one whole epoch (``Runner.warm_whole_epoch``). A few documents were not
    # enough: measured here, the next two epochs still waited 13-17 s for their first
    # block (Ray starting more read workers) against 2 s once warm.
    return Runner(make_lr, count, epoch_tokens, warm_whole_epoch=cfg.needs_ray)


def token_limit_runner(uri: str, which: str, epoch_tokens: int) -> Runner:
    """A limit on the token column, counting its tokens: the sequential scan (``"scan"``)
    or Lance's own takes of every row in a random order (``"take_random_big"``), which is
    all a full shuffle can read at."""
    import pyarrow.compute as pc

    def tokens(batch: Any) -> int:
        return int(pc.sum(pc.list_value_length(batch.column(0))).as_py() or 0)

    return limit_runner(uri, which, ["tokens"], tokens, epoch_tokens)


def packing_targets(rate: Any, target: Any) -> None:
    """The issue's targets for packed tokens/s: >= 5x the reference, >= 0.3x the scan."""
    ref, scan = rate("pack-reference"), rate("pack-limit-scan")
    for reader in ("ray", "local"):
        mine = rate(f"pack-{reader}")
        target(f"packed tokens/s ({reader}) >= 5x reference",
               mine / ref if mine and ref else None, 5.0, ">= 5.0x")
        target(f"packed tokens/s ({reader}) >= {SCAN_TARGET}x sequential scan of the token "
               "column (fresh processes; judged paired: python -m jobs.bench.paired)",
               mine / scan if mine and scan else None, SCAN_TARGET, f">= {SCAN_TARGET}x")
