"""Exact token counts of an epoch's splits: what ``blocks_per_epoch="auto"`` is computed from.

Each planned row contributes ``len(tokens) + 1`` (its ``eos_id``), as in the reference's
estimate, but every row is counted instead of a ~1% sample. The token column is scanned
fragment by fragment (one Ray task per group of fragments when Ray is up, in this process
otherwise) and the counts are summed per split with the plan's row ids.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence

import numpy as np
import pyarrow.compute as pc

from ..plan.splits import PlanSpec, SplitPlan
from ..plan.table import TableRef

logger = logging.getLogger(__name__)

ROW_ID = "_rowid"


def scan_counts(table: TableRef, fragment_ids: Sequence[int], column: str,
                filter: str | None) -> tuple[np.ndarray, np.ndarray]:
    """``(row ids, len(tokens) + 1)`` of the rows of ``fragment_ids`` that match ``filter``."""
    ds = table.open_lance()
    ids: list[np.ndarray] = [np.empty(0, np.uint64)]
    counts: list[np.ndarray] = [np.empty(0, np.int64)]
    for fid in fragment_ids:
        for batch in ds.get_fragment(fid).to_batches(columns=[column], filter=filter,
                                                      with_row_id=True):
            tokens = batch.column(column)
            if tokens.null_count:
                raise ValueError("pack_sequences does not support null token lists; filter "
                                 f"them out (e.g. filter='{column} IS NOT NULL')")
            counts.append(pc.list_value_length(tokens).to_numpy().astype(np.int64) + 1)
            ids.append(batch.column(ROW_ID).to_numpy().astype(np.uint64))
    return np.concatenate(ids), np.concatenate(counts)


def split_token_totals(table: TableRef, plan: SplitPlan, splits: Sequence[int], column: str,
                       filter: str | None, *, remote: bool) -> np.ndarray:
    """Tokens (with one ``eos`` per row) of each of ``splits`` (held by ``plan``), exactly."""
    fragments = [f.fragment_id for f in table.open_lance().get_fragments()]
    groups = _groups(fragments, remote)
    if remote:
        import ray

        task = ray.remote(scan_counts).options(num_cpus=1)
        parts = ray.get([task.remote(table, g, column, filter) for g in groups])
    else:
        parts = [scan_counts(table, g, column, filter) for g in groups]
    ids = np.concatenate([p[0] for p in parts])
    counts = np.concatenate([p[1] for p in parts])
    order = np.argsort(ids, kind="stable")
    ids, counts = ids[order], counts[order]
    totals = np.zeros(len(splits), dtype=np.int64)
    positions = np.arange(plan.split_len, dtype=np.int64)
    for k, split in enumerate(splits):
        rows = plan.rows(split, positions).astype(np.uint64)
        at = np.minimum(np.searchsorted(ids, rows), max(len(ids) - 1, 0))
        if len(rows) and (not len(ids) or np.any(ids[at] != rows)):
            raise RuntimeError(f"the token count scan did not see every planned row of split "
                               f"{split}; the pinned table version no longer holds them")
        totals[k] = int(counts[at].sum()) if len(rows) else 0
    return totals


def _groups(fragments: list[int], remote: bool) -> list[list[int]]:
    if not remote or len(fragments) <= 1:
        return [fragments]
    import ray

    tasks = max(1, min(len(fragments), int(ray.cluster_resources().get("CPU", 1))))
    return [fragments[i::tasks] for i in range(tasks)]


def auto_budget(total_tokens: int, block_len: int, num_splits: int) -> int:
    """The reference's budget formula on an exact count: whole blocks of the epoch's tokens,
    rounded down to a multiple of ``num_splits`` (at least ``num_splits``)."""
    blocks = total_tokens // block_len
    return max(num_splits, blocks - blocks % num_splits)


def say_auto_budget(budget: int, block_len: int, tokens: int, rows: int, spec: PlanSpec,
                    seconds: float) -> None:
    """Say once what ``blocks_per_epoch="auto"`` counted and how long it took: logged, and
    with a filter also a ``UserWarning``, where the reference warns about its estimate."""
    message = (f"blocks_per_epoch='auto' is {budget} blocks of {block_len} tokens for epoch "
               f"{spec.epoch}: an exact count of {tokens} tokens (one eos_id per document "
               f"included) in the {rows} planned rows{' left by the filter' if spec.filter else ''}"
               f", taking {seconds:.2f} s. lancedb.streaming resolves 'auto' from an approximate "
               "token-count sample instead, so the two may differ: pass "
               f"blocks_per_epoch={budget} to read this epoch's blocks elsewhere")
    logger.info(message)
    if spec.filter is not None:
        warnings.warn(message, UserWarning, stacklevel=2)
