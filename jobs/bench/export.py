"""``python -m jobs.bench``'s measurements as shared-format results (:mod:`.results`): one
file per case group, what docs/performance.md shows."""

from __future__ import annotations

from typing import Any

from .configs import BATCH, CLUMP, DIM, SPLITS
from .formats import label_of
from .packing import PACK_BATCH, PACK_DOCS, PACK_LEN, PACK_MEAN_LEN
from .results import result

COMMAND = "python -m jobs.bench"


def _ok(results: list[dict[str, Any]], table: str) -> list[dict[str, Any]]:
    return [r for r in results if r["config"]["table"] == table and "error" not in r]


def _with(command: str, only: str) -> str:
    """The command that reruns one group (unchanged when the run already chose its cases)."""
    return command if "--only" in command else f"{command} --only {only}"


def _round(x: float | None, digits: int = 3) -> float | None:
    return None if x is None else round(float(x), digits)


def exported(results: list[dict[str, Any]], analysis: dict[str, Any], args: Any,
             command: str, machine: str | None) -> list[dict[str, Any]]:
    """The result files of one run: throughput, packing, transforms, cold start, memory."""
    out = []
    small = _ok(results, "small")
    if small:
        out.append(result(
            "throughput", f"Rows/s on one generated table ({args.rows:,} rows, dim {DIM}, "
            f"batch {BATCH}, {SPLITS} splits)",
            ["configuration", "shuffle", "rows/s", "x reference", "x limit", "steady rows/s",
             "first batch s", "peak RSS MB"],
            [[label_of(r), r["config"]["shuffle"], round(r["rows_per_s"]),
              _round(r.get("x_reference")), _round(r.get("x_limit")),
              round(r.get("steady_rows_per_s") or 0),
              _round(r["first_batch_s"]) if r["config"]["kind"] != "limit" else None,
              round(r["peak_rss_mb"])] for r in small],
            command=command, machine=machine, notes=[
                "rows/s counts from constructing the dataset (which builds the epoch's plan) "
                "to the last batch, median of the timed epochs; steady rows/s only after the "
                "first batch.",
                "x reference: against lancedb.streaming through a DataLoader with the same "
                "shuffle; x limit: against Lance's own sorted take of random ids (full "
                f"shuffle) or its sequential scan (clumps of {CLUMP}, no shuffle), the most a "
                "loader can read at.",
                "Every configuration runs in a fresh process; Ray configurations attach to "
                "one local Ray started before any timing, and warm up on one whole epoch "
                "first (so every task slot's worker has started). Ratios come from the same "
                "run.",
                *(["Short epochs (under 200,000 rows) are dominated by start-up: the Ray "
                   "reader's pipeline start and per-task overhead, the reference's plan build."]
                  if args.rows < 200_000 else []),
            ]))
    packed = _ok(results, "tokens")
    if packed:
        out.append(result(
            "packing", f"Packed tokens/s ({args.pack_docs:,} documents of mean length "
            f"{PACK_MEAN_LEN:g}, pack_sequences={PACK_LEN}, {PACK_BATCH} blocks per batch)",
            ["configuration", "tokens/s", "x reference", "x scan", "x take", "first block s"],
            [[label_of(r), round(r["rows_per_s"]), _round(r.get("x_reference")),
              _round(r.get("x_limit")), _round(r.get("x_take")),
              _round(r["first_batch_s"]) if r["config"]["kind"] != "limit" else None]
             for r in packed],
            command=_with(command, "packing"), machine=machine, notes=[
                "tokens/s counts the tokens of delivered blocks, padding included (what a "
                "trainer receives).",
                "x scan: against a sequential scan of the token column (no packing, no "
                "tensors); x take: against Lance's takes of every row in random order, what a "
                "full shuffle reads.",
                *(["Short epochs (fewer documents than the default): the first block's "
                   "start-up (plan, token count, first read) dominates tokens/s; compare "
                   "the first-block seconds too."] if args.pack_docs < PACK_DOCS else []),
            ]))
    tx = [r for r in results if r["config"].get("transform") and "error" not in r]
    if tx:
        out.append(result(
            "transforms", "Transforms: rows/s against the transform's own limit (cores x its "
            "single-core rate)",
            ["case", "configuration", "rows/s", "x limit", "x reference"],
            [[r["config"]["transform"], label_of(r), round(r["rows_per_s"]),
              _round(r.get("x_limit")), _round(r.get("x_reference"))] for r in tx],
            command=_with(command, "transforms"), machine=machine, notes=[
                "The limit is the transform alone on one thread times the CPU count, "
                "measured in the same run.",
                "CPU-only node rows are simulated on this machine's cores "
                "(ray.cluster_utils): they show placement, not added hardware.",
            ]))
    cold = analysis.get("cold_start") or {}
    if cold:
        ref = cold.get("reference")
        out.append(result(
            "cold-start", "Time to the first batch in a fresh process, no Ray connected",
            ["loader", "first batch s", "x reference"],
            [[k, _round(s), _round(s / ref if ref else None)] for k, s in cold.items()],
            command=_with(command, "cold-start"), machine=machine, notes=[
                "Median over fresh processes; imports are timed apart and not included.",
            ]))
    big = _ok(results, "big")
    if big:
        byname = {r["config"]["name"]: r for r in small}
        rows = []
        for r in big:
            s = byname.get(r["config"]["name"].removeprefix("big-"))
            s_rss = s["peak_rss_mb"] if s else None
            rows.append([label_of(r), round(s_rss) if s_rss else None, round(r["peak_rss_mb"]),
                         _round(r["peak_rss_mb"] / s_rss if s_rss else None)])
        out.append(result(
            "memory", f"Trainer peak RSS, {args.rows:,} vs {args.big_rows:,} rows",
            ["configuration", "peak RSS MB (small)", "peak RSS MB (big)", "ratio"], rows,
            command=command, machine=machine, notes=[
                f"The big table is read for one pass capped at {args.big_seconds:g} s.",
            ]))
    return out
