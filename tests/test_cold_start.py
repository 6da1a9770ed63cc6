"""Cold start: the default reader never starts Ray. In a fresh process with no cluster
connected it reads in-process (the sequence and states of every other reader), and once Ray
is connected it reads through Ray Data. ``jobs/bench/cold_start.py`` measures the time."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

import lance_ray
from lance_ray.view.readers import choose_reader

REPO = Path(__file__).resolve().parents[1]
CHILD = r"""
import json, sys
import lancedb, lance_ray
table = lancedb.connect(sys.argv[1]).open_table("t")
ds = lance_ray.StreamingDataset(table, num_splits=4, shuffle_seed=5, shuffle_clump_size=4)
batches = ds.iter_batches(32)
ids = [i for _ in range(3) for i in next(batches)["id"].tolist()]
state = ds.state_dict()
ids += [i for b in batches for i in b["id"].tolist()]
print(json.dumps({"ids": ids, "state": state, "reader": ds._reads.kind,
                  "ray_imported": "ray" in sys.modules}))
"""


def test_with_no_cluster_connected_the_default_reader_reads_locally_and_never_imports_ray(
        table_1k):
    db = os.path.dirname(table_1k.to_lance().uri.rstrip("/"))
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", CHILD, db], env=env, capture_output=True,
                         text=True, timeout=300, check=True)
    fresh = json.loads(out.stdout.strip().splitlines()[-1])
    assert fresh["reader"] == "local"
    assert not fresh["ray_imported"]  # not even imported (1-3 s of a cold start here)
    # The same sequence and the same state as an explicit local reader in this process.
    ds = lance_ray.StreamingDataset(table_1k, num_splits=4, shuffle_seed=5,
                                    shuffle_clump_size=4, reader="local")
    batches = ds.iter_batches(32)
    ids = [i for _ in range(3) for i in next(batches)["id"].tolist()]
    assert json.loads(json.dumps(ds.state_dict())) == fresh["state"]
    assert ids + [i for b in batches for i in b["id"].tolist()] == fresh["ids"]


def test_once_ray_is_connected_the_default_reader_is_ray_data(ray_session, table_1k):
    ds = lance_ray.StreamingDataset(table_1k, num_splits=4)
    assert ds._reads.kind == "ray"
    assert choose_reader("local") == "local"


def test_an_address_in_the_environment_counts_as_connected(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    assert choose_reader("auto") == "ray"


def test_an_unknown_reader_is_refused_naming_the_choices(table_1k):
    with pytest.raises(ValueError, match="'auto', 'ray', 'local'"):
        lance_ray.StreamingDataset(table_1k, num_splits=4, reader="threads")


RAY_CHILD = r"""
import sys, time
import lancedb, lance_ray
table = lancedb.connect(sys.argv[1]).open_table("t")
# Small reads, one at a time, consumed slowly: the epoch outlasts the pipeline's start.
ds = lance_ray.StreamingDataset(table, num_splits=4, shuffle_seed=5, reader="ray",
                                read_batch_size=16, prefetch_bytes=1)
rows = 0
for batch in ds.iter_batches(16):
    rows += len(batch["id"])
    time.sleep(0.01)
print(rows, flush=True)
"""


def test_reader_ray_with_no_cluster_starts_one_that_outlives_the_pipeline_start(
        table_1k, tmp_path):
    # Ray Data would start the cluster on the thread that starts the pipeline, and a local
    # cluster's processes are killed when the thread that started them ends: the epoch then
    # hung for 60 s and the process exited with code 1 after the first few reads.
    db = os.path.dirname(table_1k.to_lance().uri.rstrip("/"))
    ray_root = tempfile.mkdtemp(prefix="lrc")  # short: Ray's socket paths have a length limit
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env |= {"RAY_TMPDIR": ray_root, "PYTHONPATH": os.pathsep.join([str(REPO),
                                                                    env.get("PYTHONPATH", "")])}
    try:
        out = subprocess.run([sys.executable, "-c", RAY_CHILD, db], env=env,
                             capture_output=True, text=True, timeout=240)
    finally:
        shutil.rmtree(ray_root, ignore_errors=True)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "1000"
