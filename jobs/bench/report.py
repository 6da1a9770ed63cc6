"""Ratios, targets, the printed tables and the chart.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .configs import (
    BATCH,
    CLUMP,
    DIM,
    SPLITS,
    TAKE_ROWS,
)
from .formats import W, fmt_rate, fmt_ratio, fmt_s, label_of
from .packing import PACK_BATCH, PACK_LEN, PACK_MEAN_LEN, packing_targets


def analyse(results: list[dict[str, Any]], cold: dict[str, float] | None = None
            ) -> dict[str, Any]:
    """Ratios to the reference and to the limits, and the targets of the issue."""
    ok = {r["config"]["name"]: r for r in results if "error" not in r}

    def rate(name: str) -> float | None:
        return ok[name]["rows_per_s"] if name in ok else None

    limits = {"full": rate("limit-take"), "clump": rate("limit-scan"),
              "none": rate("limit-scan")}
    refs = {"full": rate("reference-full"), "clump": rate("reference-clump"),
            "none": rate("reference-full")}
    for r in results:
        c = r["config"]
        if "error" in r or c["table"] != "small":
            continue
        ref, lim = refs[c["shuffle"]], limits[c["shuffle"]]
        r["x_reference"] = r["rows_per_s"] / ref if ref else None
        r["x_limit"] = r["rows_per_s"] / lim if lim else None
    wide_ref = ok.get("wide-reference-full")
    for r in results:
        if r["config"]["table"] == "wide" and "error" not in r and wide_ref:
            r["x_reference"] = r["rows_per_s"] / wide_ref["rows_per_s"]
            r["x_reference_rss"] = r["peak_rss_mb"] / wide_ref["peak_rss_mb"]

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    def get(name: str, *keys: str) -> float | None:
        v: Any = ok.get(name)
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        return v

    targets = []

    def target(what: str, value: float | None, bound: float, detail: str) -> None:
        targets.append({"target": what, "value": value, "bound": bound, "detail": detail,
                        "holds": None if value is None else value >= bound})

    def target_le(what: str, value: float | None, bound: float, detail: str) -> None:
        targets.append({"target": what, "value": value, "bound": bound, "detail": detail,
                        "holds": None if value is None else value <= bound})

    for reader in ("ray", "local"):
        name = f"batch-{reader}-full"
        target(f"full-shuffle batch path ({reader}) >= 3x reference",
               ratio(rate(name), rate("reference-full")), 3.0, ">= 3.0x")
        target(f"full-shuffle batch path ({reader}) >= 0.6x sorted-take limit",
               ratio(rate(name), rate("limit-take")), 0.6, ">= 0.6x")
        target(f"clumped (1024) batch path ({reader}) >= 0.5x sequential scan",
               ratio(rate(f"batch-{reader}-clump"), rate("limit-scan")), 0.5, ">= 0.5x")
        target_le(f"first batch after resume at 90% <= 1.2x fresh ({reader}, full shuffle)",
                  ratio(get(name, "resume_first_batch_s", "0.9"), get(name, "first_batch_s")),
                  1.2, "<= 1.2x")
        target(f"clumped (1024) batch path ({reader}) steady >= 0.5x scan steady",
               ratio(get(f"batch-{reader}-clump", "steady_rows_per_s"),
                     get("limit-scan", "steady_rows_per_s")), 0.5, ">= 0.5x")
        target(f"wide rows (64 KB) batch path ({reader}) >= 2x reference",
               ratio(rate(f"wide-batch-{reader}-full"), rate("wide-reference-full")), 2.0,
               ">= 2.0x")
        target_le(f"wide rows (64 KB) batch path ({reader}) peak RSS <= reference's",
                  ratio(get(f"wide-batch-{reader}-full", "peak_rss_mb"),
                        get("wide-reference-full", "peak_rss_mb")), 1.0, "<= 1.0x")
    packing_targets(rate, target)
    target_le("trainer peak RSS at big rows <= 1.2x at rows (batch path, ray, full shuffle)",
              ratio(get("big-batch-ray-full", "peak_rss_mb"), get("batch-ray-full", "peak_rss_mb")),
              1.2, "<= 1.2x")
    cold = cold or {}
    target_le("cold start, no Ray connected: first batch <= 2x reference (default reader)",
              ratio(cold.get("default"), cold.get("reference")), 2.0, "<= 2.0x")
    packed = {name: ok[name] for name in ok if ok[name]["config"]["table"] == "tokens"}
    ref, scan, take = rate("pack-reference"), rate("pack-limit-scan"), rate("pack-limit-take")
    for r in packed.values():
        r["x_reference"] = r["rows_per_s"] / ref if ref else None
        r["x_limit"] = r["rows_per_s"] / scan if scan else None
        r["x_take"] = r["rows_per_s"] / take if take else None
    return {"targets": targets, "limits": limits, "references": refs, "cold_start": cold}


def print_head(head: str) -> None:
    """A table's header line, underlined."""
    print(head)
    print("-" * len(head))


def print_wide(wide: list[dict[str, Any]], width_bytes: int) -> None:
    """The wide-row table: throughput and peak RSS against the reference."""
    print(f"\nWide rows: {wide[0].get('rows', 0):,} rows of {width_bytes:,} bytes (binary), "
          "full shuffle, batch 256; rows/s = median of 2 epochs")
    print_head(f"{'configuration':<{W}} {'rows/s':>8} {'x ref':>7} {'MB/s':>7} "
               f"{'1st batch s':>11} {'peak RSS MB':>11} {'x ref RSS':>9} {'tree RSS MB':>11}")
    for r in wide:
        if "error" in r:
            print(f"{r['config']['label']:<{W}} FAILED: {r['error']}")
            continue
        print(f"{label_of(r):<{W}} {fmt_rate(r['rows_per_s']):>8} "
              f"{fmt_ratio(r.get('x_reference')):>7} "
              f"{r['rows_per_s'] * width_bytes / 2**20:>7.0f} "
              f"{r['first_batch_s']:>11.3f} {r['peak_rss_mb']:>11.0f} "
              f"{fmt_ratio(r.get('x_reference_rss')):>9} {r['tree_peak_rss_mb']:>11.0f}")


def print_rows(small: list[dict[str, Any]], args: Any) -> None:
    """The throughput and time-to-first-batch tables of the ``--rows`` table."""
    print(f"\nThroughput at {args.rows:,} rows (dim {DIM}), batch {BATCH}, num_splits {SPLITS}; "
          f"rows/s = median of {args.repeats} epochs, construction to last batch (steady/s: "
          "after the first batch); x reference = vs the reference with the "
          "same shuffle (unshuffled rows: vs full shuffle); x limit = vs Lance's sorted take "
          f"of random ids, {TAKE_ROWS}/call (full shuffle) or sequential scan (clump, "
          "unshuffled)")
    head = (f"{'configuration':<{W}} {'shuffle':<7} {'rows/s':>8} {'x ref':>7} {'x limit':>8} "
            f"{'steady/s':>8} {'1st batch s':>11} {'peak RSS MB':>11} {'tree RSS MB':>11}")
    print_head(head)
    for r in small:
        c = r["config"]
        if "error" in r:
            print(f"{c['label']:<{W}} {c['shuffle']:<7} FAILED: {r['error']}")
            continue
        flag = "" if r.get("complete", True) else "*"
        print(f"{label_of(r):<{W}} {c['shuffle']:<7} {fmt_rate(r['rows_per_s']) + flag:>8} "
              f"{fmt_ratio(r.get('x_reference')):>7} {fmt_ratio(r.get('x_limit')):>8} "
              f"{fmt_rate(r.get('steady_rows_per_s')):>8} "
              f"{fmt_s(r['first_batch_s'] if c['kind'] != 'limit' else None):>11} "
              f"{r['peak_rss_mb']:>11.0f} {r['tree_peak_rss_mb']:>11.0f}")

    print("\nTime to first batch (s; construct [+ load_state_dict] to first batch, warm; cold = "
          "first pass of the process, incl. Ray worker start-up)")
    head = (f"{'configuration':<{W}} {'shuffle':<7} {'cold':>7} {'fresh':>7} {'res 50%':>8} "
            f"{'res 90%':>8} {'90%/fresh':>9}")
    print_head(head)
    for r in small:
        c = r["config"]
        if "error" in r or not c["resume"]:
            continue
        res = r["resume_first_batch_s"]
        r90 = res.get("0.9")
        print(f"{label_of(r):<{W}} {c['shuffle']:<7} {r['cold_first_batch_s']:>7.3f} "
              f"{r['first_batch_s']:>7.3f} {fmt_s(res.get('0.5')):>8} {fmt_s(r90):>8} "
              f"{fmt_ratio(r90 / r['first_batch_s'] if r90 else None):>9}")


def print_report(results: list[dict[str, Any]], analysis: dict[str, Any], args: Any,
                 notes: list[str]) -> None:
    small = [r for r in results if r["config"]["table"] == "small"]
    if small:
        print_rows(small, args)

    big = {r["config"]["name"]: r for r in results if r["config"]["table"] == "big"}
    if big:
        byname = {r["config"]["name"]: r for r in small}
        print(f"\nTrainer peak RSS, {args.rows:,} vs {args.big_rows:,} rows (full shuffle; big "
              f"rows: one pass capped at {args.big_seconds:g}s of iteration)")
        head = (f"{'configuration':<{W}} {'RSS small':>9} {'RSS big':>9} {'ratio':>7} "
                f"{'tree big':>9} {'rows/s big':>10} {'epoch read':>10}")
        print_head(head)
        for name, r in big.items():
            if "error" in r:
                print(f"{r['config']['label']:<{W}} FAILED: {r['error']}")
                continue
            s = byname.get(name.removeprefix("big-"))
            s_rss = s["peak_rss_mb"] if s and "error" not in s else None
            frac = sum(p["rows"] for p in r["passes"]) / (r["epoch_rows"] * len(r["passes"]))
            print(f"{r['config']['label']:<{W}} {s_rss or 0:>9.0f} {r['peak_rss_mb']:>9.0f} "
                  f"{fmt_ratio(r['peak_rss_mb'] / s_rss if s_rss else None):>7} "
                  f"{r['tree_peak_rss_mb']:>9.0f} {fmt_rate(r['rows_per_s']):>10} {frac:>10.0%}")

    print_packing(results, args)
    wide = [r for r in results if r["config"]["table"] == "wide"]
    if wide:
        print_wide(wide, args.wide_bytes)
    cold = analysis.get("cold_start") or {}
    if cold:
        print("\nCold start: a fresh process, no Ray connected, construct + first batch "
              "(median s)")
        for kind, s in cold.items():
            ref = cold.get("reference")
            print(f"  {kind:<10} {s:>7.3f}  {fmt_ratio(s / ref if ref else None)}")

    print("\nTargets")
    for t in analysis["targets"]:
        if args.only and t["holds"] is None:
            continue  # a partial run: only the targets it measured
        mark = {True: "HOLDS", False: "FAILS", None: "n/a"}[t["holds"]]
        print(f"  [{mark:<5}] {t['target']}: {fmt_ratio(t['value'])} (needs {t['detail']})")
    for n in notes:
        print(f"note: {n}")


def print_packing(results: list[dict[str, Any]], args: Any) -> None:
    """The packed-tokens table: tokens/s, x reference, x the token column's scan."""
    packed = [r for r in results if r["config"]["table"] == "tokens"]
    if not packed:
        return
    print(f"\nPacked tokens/s: {args.pack_docs:,} documents, lognormal lengths (mean "
          f"{PACK_MEAN_LEN:g}), pack_sequences={PACK_LEN}, {SPLITS} splits, {PACK_BATCH} "
          f"blocks per batch; median of {args.repeats} epochs, construction to last block "
          "(padding counted: what the trainer receives); x scan = vs a sequential scan of the "
          "token column counting its tokens (no packing, no tensors); x take = vs Lance's "
          "takes of every row in a random order (what a full shuffle reads)")
    head = (f"{'configuration':<{W}} {'tokens/s':>9} {'x ref':>7} {'x scan':>7} {'x take':>7} "
            f"{'steady/s':>9} {'1st block s':>11} {'peak RSS MB':>11}")
    print(head)
    print("-" * len(head))
    for r in packed:
        if "error" in r:
            why = r["error"] if r["error"].startswith("skipped") else f"FAILED: {r['error']}"
            print(f"{r['config']['label']:<{W}} {why}")
            continue
        flag = "" if r.get("complete", True) else "*"
        first = r["first_batch_s"] if r["config"]["kind"] != "limit" else None
        print(f"{label_of(r):<{W}} {fmt_rate(r['rows_per_s']) + flag:>9} "
              f"{fmt_ratio(r.get('x_reference')):>7} {fmt_ratio(r.get('x_limit')):>7} "
              f"{fmt_ratio(r.get('x_take')):>7} "
              f"{fmt_rate(r.get('steady_rows_per_s')):>9} {fmt_s(first):>11} "
              f"{r['peak_rss_mb']:>11.0f}")


def chart(results: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in results if "error" not in r and r["config"]["table"] == "small"]
    if not rows:
        return
    labels = list(dict.fromkeys(label_of(r) for r in rows))
    colors = {"full": "#1f77b4", "clump": "#ff7f0e", "none": "#7f7f7f"}
    fig, ax = plt.subplots(figsize=(10, 0.65 * len(labels) + 1.8))
    height = 0.38
    for i, label in enumerate(labels):
        mine = [r for r in rows if label_of(r) == label]
        for r in mine:
            sh = r["config"]["shuffle"]
            off = 0.0 if len(mine) == 1 else (-height / 2 if sh == "full" else height / 2)
            ax.barh(i + off, r["rows_per_s"], height=height, color=colors[sh])
            ax.text(r["rows_per_s"] * 1.03, i + off, fmt_rate(r["rows_per_s"]),
                    va="center", fontsize=8)
    ax.set_yticks(range(len(labels)), labels, fontsize=9)
    ax.invert_yaxis()
    ax.set_xscale("log")
    rates = [r["rows_per_s"] for r in rows]
    ax.set_xlim(min(rates) / 2, max(rates) * 2.5)
    ax.set_xlabel("rows/s (median; log scale)")
    ax.set_title(title, fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    ax.legend(handles, ["full shuffle", f"shuffle_clump_size={CLUMP}", "unshuffled / n.a."],
              loc="lower right", fontsize=8)
    ax.grid(axis="x", which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

