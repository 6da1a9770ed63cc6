"""Cold start: the default reader never starts Ray. In a fresh process with no cluster
connected it reads in-process (the sequence and states of every other reader), and once Ray
is connected it reads through Ray Data. ``jobs/cold_start.py`` measures the time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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
print(json.dumps({"ids": ids, "state": state, "reader": ds._reader_kind,
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
    assert ds._reader_kind == "ray"
    assert choose_reader("local") == "local"


def test_an_address_in_the_environment_counts_as_connected(monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    assert choose_reader("auto") == "ray"


def test_an_unknown_reader_is_refused_naming_the_choices(table_1k):
    with pytest.raises(ValueError, match="'auto', 'ray', 'local'"):
        lance_ray.StreamingDataset(table_1k, num_splits=4, reader="threads")
