"""The transform cases' configurations, how each reads an epoch, and their report.
"""

from __future__ import annotations

import os
import tempfile
from collections import Counter
from collections.abc import Iterator
from typing import Any

from .configs import BATCH, SEED, SPLITS, Config
from .formats import W, fmt_rate, fmt_ratio
from .runners import Runner
from .transforms import (
    CASES,
    TRANSFORMS,
    CountedByNode,
    RayDataTransform,
    single_core_batches,
)

GROUP = "transforms"  # --only transforms runs every configuration below
SCALING_NODES = (1, 2, 3)
NODE_RESOURCE = "transform_cpu"


def transform_configurations() -> list[Config]:
    out = []
    for case, (table, _) in CASES.items():
        def cfg(name: str, label: str, kind: str, case: str = case, table: str = table,
                **kw: Any) -> Config:
            return Config(f"tx-{case}-{name}", label, kind, kw.pop("shuffle", "full"),
                          table=table, transform=case, group=GROUP, **kw)

        out += [
            cfg("limit", "transform alone, one thread (x cores = limit)", "limit",
                limit="transform"),
            cfg("ray", "lance_ray iter_batches (ray)", "lance_ray", reader="ray"),
            cfg("local", "lance_ray iter_batches (local, 2 threads)", "lance_ray",
                reader="local"),
            cfg("loader2", "lance_ray StreamingDataLoader(nw=2)", "lance_ray", reader="local",
                loader_workers=2),
            cfg("reference", "lancedb.streaming + DataLoader(nw=0)", "reference"),
            cfg("ray-data", "ray.data.read_lance + map_batches", "ray_data", shuffle="none"),
        ]
    for nodes in SCALING_NODES:
        out.append(Config(f"tx-image-nodes{nodes}", f"lance_ray (ray), {nodes} CPU-only node(s)",
                          "lance_ray", "full", table="images", transform="image",
                          reader="ray", nodes=nodes, group=GROUP))
    return out


def simulated_cluster(nodes: int) -> Any:
    """A head that runs no tasks plus ``nodes`` one-CPU nodes carrying ``NODE_RESOURCE``;
    this process is connected to it."""
    import ray
    from ray.cluster_utils import Cluster

    temp = tempfile.mkdtemp(prefix="lance_ray_bench_ray_")
    cluster = Cluster(initialize_head=True, connect=False,
                      head_node_args={"num_cpus": 0, "include_dashboard": False,
                                      "temp_dir": temp})
    for _ in range(nodes):
        cluster.add_node(num_cpus=1, resources={NODE_RESOURCE: 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    return cluster


def rows_per_node(path: str) -> dict[str, int]:
    """Rows transformed on each node ("head" or a node id's first 8 digits), from the lines
    ``CountedByNode`` wrote to ``path``."""
    import ray

    head = ray.get_runtime_context().get_node_id()
    nodes: Counter[str] = Counter()
    with open(path) as f:
        for line in f:
            node, rows = line.split()
            nodes["head" if node == head else node[:8]] += int(rows)
    return dict(nodes)


def transform_runner(spec: dict[str, Any], cfg: Config, mp_context: str | None = None
                     ) -> Runner:
    case = cfg.transform or ""
    fn, rows = TRANSFORMS[case], spec["rows"]
    if cfg.kind == "limit":
        batches, _ = single_core_batches(spec["uri"], case, BATCH)

        def make_limit(state: dict | None) -> tuple[Any, Iterator[Any]]:
            return None, (fn(b) for b in batches)

        return Runner(make_limit, len, rows)
    count, ids = (lambda b: len(b["id"])), (lambda b: int(b["id"].sum()))
    if cfg.kind == "ray_data":
        import ray.data

        def make_ray(state: dict | None) -> tuple[Any, Iterator[Any]]:
            ds = ray.data.read_lance(spec["uri"]).map_batches(
                RayDataTransform(case), batch_format="pyarrow")
            return ds, iter(ds.iter_torch_batches(batch_size=BATCH))

        return Runner(make_ray, count, rows, ids=ids,
                      warm_whole_epoch=True)
    import lancedb

    table = lancedb.connect(spec["db"]).open_table(spec["table_name"])
    if cfg.kind == "reference":
        from lancedb.streaming import StreamingDataset as Reference
        from torch.utils.data import DataLoader

        def make_ref(state: dict | None) -> tuple[Any, Iterator[Any]]:
            ds = Reference(table, num_splits=SPLITS, shuffle_seed=SEED, transform=fn)
            return ds, iter(DataLoader(ds, batch_size=BATCH, num_workers=0))

        return Runner(make_ref, count, rows, ids=ids)
    import lance_ray

    remote = None
    if cfg.nodes:
        spec["cluster"] = simulated_cluster(cfg.nodes)  # kept alive by the spec
        spec["node_log"] = tempfile.mkstemp(prefix="lance_ray_bench_nodes_")[1]
        fn = CountedByNode(fn, spec["node_log"])
        remote = {"resources": {NODE_RESOURCE: 1}}
    loader_kw = {} if mp_context is None else {"multiprocessing_context": mp_context}

    def make_lr(state: dict | None) -> tuple[Any, Iterator[Any]]:
        ds = lance_ray.StreamingDataset(
            table, num_splits=SPLITS, shuffle_seed=SEED, transform=fn, reader=cfg.reader,
            ray_remote_args=remote,
            transform_parallelism=2 if cfg.reader == "local" else None)
        if cfg.loader_workers is None:
            return ds, ds.iter_batches(BATCH)
        loader = lance_ray.StreamingDataLoader(ds, batch_size=BATCH,
                                               num_workers=cfg.loader_workers, **loader_kw)
        return loader, iter(loader)

    ray_side = cfg.reader == "ray" and not cfg.loader_workers
    return Runner(make_lr, count, rows, ids=ids,
                  warm_whole_epoch=ray_side)


def transform_report(results: list[dict[str, Any]]) -> tuple[list[str], list[dict[str, Any]]]:
    """The printed lines of the transform table and the targets (>= 0.8x the limit of
    cores x the single-core rate; >= 2x the reference)."""
    ok = {r["config"]["name"]: r for r in results if "error" not in r}
    cores = os.cpu_count() or 1
    lines = [f"Transforms: rows/s = median of the timed epochs, batch {BATCH}, {SPLITS} splits; "
             f"limit = {cores} cores x the single-core rate of the transform alone (same run)",
             f"{'case':<7} {'configuration':<{W}} {'rows/s':>8} {'x limit':>8} {'x ref':>7}"]
    targets = []
    for r in results:
        c = r["config"]
        if not c.get("transform"):
            continue
        case = c["transform"]
        single = ok.get(f"tx-{case}-limit", {}).get("rows_per_s")
        limit = single * cores if single else None
        ref = ok.get(f"tx-{case}-reference", {}).get("rows_per_s")
        if "error" in r:
            lines.append(f"{case:<7} {c['label']:<{W}} FAILED: {r['error']}")
            continue
        rate = r["rows_per_s"]
        r["x_limit"] = rate / limit if limit else None
        r["x_reference"] = rate / ref if ref else None
        extra = f"  rows per node {r['rows_per_node']}" if r.get("rows_per_node") else ""
        shown = f"{fmt_rate(rate)} (limit {fmt_rate(limit)})" if c["kind"] == "limit" else \
            fmt_rate(rate)
        lines.append(f"{case:<7} {c['label']:<{W}} {shown:>8} {fmt_ratio(r['x_limit']):>8} "
                     f"{fmt_ratio(r['x_reference']):>7}{extra}")
        if c["kind"] == "lance_ray" and not c.get("nodes"):
            for what, value, bound in (("limit", r["x_limit"], 0.8),
                                       ("reference", r["x_reference"], 2.0)):
                targets.append({"target": f"{case}: {c['label']} >= {bound}x {what}",
                                "value": value, "bound": bound,
                                "holds": None if value is None else value >= bound})
    for t in targets:
        mark = {True: "HOLDS", False: "FAILS", None: "n/a"}[t["holds"]]
        lines.append(f"  [{mark:<5}] {t['target']}: {fmt_ratio(t['value'])}")
    return lines, targets
