"""Shared fixtures: real Lance tables on disk, one local Ray cluster per session, and a real
S3-compatible server (moto) for tests of object storage."""

from __future__ import annotations

import contextlib
import os
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

# Before ray is imported anywhere: no auth tokens, no progress bars, no usage reporting.
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_DATA_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from lance_ray.testing import local_s3  # noqa: E402
from lance_ray.testing.tables import create_table  # noqa: E402

# The local S3 server's endpoint and dummy credentials go into the environment now, before
# any Ray node starts, so every Ray worker (actors, train workers) sees them too; the server
# itself starts only when a test asks for the `s3` fixture.
S3_PORT = local_s3.free_port()
os.environ.update(local_s3.s3_env(S3_PORT))
S3_BUCKET = "lance-ray-test"

import lancedb  # noqa: E402
import numpy as np  # noqa: E402
import pyarrow as pa  # noqa: E402
import pytest  # noqa: E402


@contextlib.contextmanager
def coordinators(table: Any, storage_path: str, **defaults: Any) -> Iterator[Callable[..., Any]]:
    """``make(name, **kw)`` creates coordinators of ``table``; all are stopped at the end."""
    from lance_ray.driver.handle import Coordinator

    made = []

    def make(name: str, **kw: Any) -> Coordinator:
        made.append(Coordinator.create(table, name, storage_path=storage_path,
                                       **{**defaults, **kw}))
        return made[-1]

    try:
        yield make
    finally:
        for c in made:
            with contextlib.suppress(Exception):  # already gone: the test killed it
                c.kill()


def wait_sealed(coord: Any, step: int, timeout: float = 20.0) -> dict:
    """The coordinator's status once it sealed ``step`` (views' reports are coalesced, so
    the last steps arrive within the report interval)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = coord.status()
        if status["sealed_step"] >= step:
            return status
        time.sleep(0.05)
    raise AssertionError(f"step {step} never sealed: {coord.status()}")


def consecutive_requests(rows: list[int]) -> list[Any]:
    """Read requests of ``rows[i]`` consecutive rows each, from row 0 (one span each)."""
    from lance_ray.read.requests import ChunkRequest

    out, lo = [], 0
    for n in rows:
        out.append(ChunkRequest(((lo, lo + n),), np.arange(lo, lo + n, dtype=np.uint64)))
        lo += n
    return out


def id_rows(lo: int, hi: int, dim: int) -> pa.Table:
    """Rows ``lo .. hi-1`` whose every value tells its row id: id, x = id / 2, v = [id] * dim."""
    ids = np.arange(lo, hi, dtype=np.int64)
    return pa.table({
        "id": ids,
        "x": ids.astype(np.float32) / 2,
        "v": pa.FixedSizeListArray.from_arrays(
            pa.array(np.repeat(ids, dim).astype(np.float32)), dim),
    })


def write_table(path: str, n: int, *, fragments: int = 2, dim: int = 4, name: str = "t"):
    """A LanceDB table of ``n`` :func:`id_rows` written in ``fragments`` appends."""
    return create_table(path, name, rows=n, dim=dim, fragments=fragments, batch=id_rows)


def write_token_table(path: str, n: int, longest: int, fragments: int, seed: int = 0,
                      shortest: int = 0, kind: pa.DataType | None = None):
    """A LanceDB table of ``n`` token documents (``id``, ``tokens``: list<``kind``>, int32 by
    default, of ``shortest..longest`` token ids 2..98; some empty by default) written in
    ``fragments`` appends, and the documents."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(2, 99, rng.integers(shortest, longest + 1)).tolist()
            for _ in range(n)]
    db = lancedb.connect(path)
    bounds = np.linspace(0, n, fragments + 1).astype(int)
    table = None
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        data = pa.table({"id": np.arange(lo, hi, dtype=np.int64),
                         "tokens": pa.array(docs[lo:hi], pa.list_(kind or pa.int32()))})
        table = db.create_table("docs", data) if table is None else table
        if table.count_rows() != hi:
            table.add(data)
    return table, docs


@pytest.fixture(scope="session")
def token_table(tmp_path_factory):
    """60 token documents of up to 30 tokens, in 3 fragments: ``(table, docs)``."""
    return write_token_table(str(tmp_path_factory.mktemp("tokens")), 60, 30, 3)


_rows_after_filter: dict[tuple[int, int, str | None], int] = {}


def open_table(table_factory, shape: tuple[int, int], kw: dict):
    """A cached table for a hypothesis example; skips (``assume``) plans that have more
    splits than rows after the filter."""
    from hypothesis import assume

    table = table_factory(*shape)
    key = (*shape, kw["filter"])
    if key not in _rows_after_filter:
        _rows_after_filter[key] = table.count_rows(kw["filter"])
    assume(kw["num_splits"] <= _rows_after_filter[key])
    return table


@pytest.fixture(scope="session")
def table_factory(tmp_path_factory) -> Callable[..., object]:
    """Make (and cache) tables by size: ``table_factory(n, fragments=2)``."""
    cache: dict[tuple[int, int], object] = {}

    def make(n: int, fragments: int = 2):
        key = (n, fragments)
        if key not in cache:
            root = tmp_path_factory.mktemp(f"db_{n}_{fragments}")
            cache[key] = write_table(str(root), n, fragments=fragments)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def table_1k(table_factory):
    return table_factory(1000, 3)


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[object]:
    """One real two-node Ray cluster (head + one worker node) for the whole session.

    Sized for 2 cores: one CPU per node. Each node carries a marker resource
    (``at_head`` / ``at_w1``) so tests can place actors on a chosen node.
    """
    import ray
    from ray.cluster_utils import Cluster

    # Workers must import functions defined in test modules (transforms, train loops).
    # (tests/ and the checkout's root, for jobs.*: the same paths pyproject's pytest
    # `pythonpath` gives this process).
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (here, os.path.dirname(here), os.environ.get("PYTHONPATH")) if p)
    # "slot": train workers ask for slots, not CPUs, so Ray Data reads always get a CPU.
    cluster = Cluster(initialize_head=True, connect=True,
                      head_node_args={"num_cpus": 1, "resources": {"at_head": 1, "slot": 2},
                                      "include_dashboard": False})
    cluster.add_node(num_cpus=1, resources={"at_w1": 1, "slot": 2})
    cluster.wait_for_nodes()
    yield cluster
    ray.shutdown()
    cluster.shutdown()


@pytest.fixture(scope="session")
def ray_session(ray_cluster) -> None:
    """Ray is connected (to the session's two-node cluster)."""


@pytest.fixture(scope="session")
def s3_server() -> Iterator[local_s3.LocalS3]:
    """A real S3-compatible server (moto) on 127.0.0.1 for the session, stopped by its
    handle at the end. Fault tests may freeze it."""
    server = local_s3.LocalS3.start(S3_PORT)
    try:
        server.create_bucket(S3_BUCKET)
        yield server
    finally:
        server.stop()


@pytest.fixture
def s3(s3_server, request) -> str:
    """A fresh ``s3://`` prefix for one test, in the session server's bucket."""
    return f"s3://{S3_BUCKET}/{re.sub(r'[^A-Za-z0-9_-]', '-', request.node.name)[:60]}"
