"""What a user may pass as the table, and how it is reopened: datasets under any name, a
LanceDB table whose connection carries the storage options (on a real S3 server), factories
that cannot be hashed, Azure URIs that name the account, and in-memory tables."""

from __future__ import annotations

import dataclasses
import os
import pickle

import lance
import lancedb
import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pytest
from conftest import S3_PORT
from lancedb import streaming as reference

import lance_ray
from lance_ray import storage
from lance_ray.testing import local_s3


def ids(ds) -> list[int]:
    return [row["id"] for row in ds]


@pytest.mark.parametrize("name", ["plain", "with space.lance", "hash#x.lance", "pct%20.lance"])
def test_a_dataset_under_any_name_reads_the_lancedb_plan(tmp_path, name):
    uri = str(tmp_path / name)
    lance.write_dataset(pa.table({"id": np.arange(40)}), uri)
    ref_table = lancedb.connect(tmp_path / "db").create_table("t", pa.table({"id": np.arange(40)}))
    ours = lance_ray.StreamingDataset(uri, num_splits=4, shuffle_seed=3, reader="local")
    assert ids(ours) == ids(reference.StreamingDataset(ref_table, num_splits=4, shuffle_seed=3))


@dataclasses.dataclass
class Options:
    """A storage_options factory that cannot be hashed (a plain dataclass)."""

    values: dict

    def __call__(self) -> dict:
        return dict(self.values)


def test_a_storage_options_factory_that_cannot_be_hashed_is_called_where_needed(tmp_path,
                                                                                   s3):
    uri = str(tmp_path / "t.lance")
    lance.write_dataset(pa.table({"id": np.arange(10)}), uri)
    ds = lance_ray.StreamingDataset(uri, num_splits=2, reader="local", shuffle=False,
                                    storage_options=Options({}))
    assert sorted(ids(ds)) == list(range(10))
    fs, path = storage.resolve(f"{s3}/x.json", Options({}))
    assert isinstance(fs, pafs.S3FileSystem) and path.endswith("/x.json")


def test_an_azure_uri_that_names_its_account_resolves_to_the_container_path():
    fs, path = storage.resolve("abfss://box@acct.dfs.core.windows.net/runs/r1/c.json")
    assert path == "box/runs/r1/c.json"
    assert isinstance(fs, pafs.AzureFileSystem)


def test_an_in_memory_lancedb_table_is_refused_naming_the_fix():
    table = lancedb.connect("memory://").create_table("m", pa.table({"id": np.arange(8)}))
    with pytest.raises(ValueError, match="memory:// connection.*Write it to a directory"):
        lance_ray.StreamingDataset(table, num_splits=2)


# ------------------------------------------- a connection that carries the storage options


def connection_options() -> dict[str, str]:
    env = local_s3.s3_env(S3_PORT)
    return {"aws_access_key_id": env["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": env["AWS_SECRET_ACCESS_KEY"],
            "aws_endpoint": env["AWS_ENDPOINT_URL"], "aws_region": env["AWS_REGION"],
            "allow_http": "true"}


def reopen(name: str):
    """A connection_factory as lancedb.streaming users write it (picklable, module level)."""
    return lancedb.connect(os.environ["TABLE_DB"], storage_options=connection_options()
                           ).open_table(name)


@pytest.fixture
def no_env_credentials(monkeypatch, s3):
    """A LanceDB table on S3 reachable only through its connection's options."""
    db = f"{s3}/db"
    table = lancedb.connect(db, storage_options=connection_options()).create_table(
        "train", pa.table({"id": np.arange(30)}))
    for key in local_s3.s3_env(S3_PORT):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("TABLE_DB", db)
    return table


def test_a_table_on_a_connection_with_storage_options_reads_in_this_process(
        no_env_credentials):
    kw = {"num_splits": 3, "shuffle_seed": 5}
    ours = lance_ray.StreamingDataset(no_env_credentials, reader="local", **kw)
    assert ids(ours) == ids(reference.StreamingDataset(no_env_credentials, **kw))
    with pytest.raises(TypeError, match="connection_factory"):
        lance_ray.StreamingDataset(no_env_credentials, reader="ray", **kw)


def test_connection_factory_carries_the_options_to_other_processes_unpickled(
        no_env_credentials):
    ds = lance_ray.StreamingDataset(no_env_credentials, num_splits=3, reader="local",
                                    connection_factory=reopen)
    shipped = pickle.dumps(ds._table)
    assert b"secret" not in shipped.lower() and local_s3.DUMMY_SECRET.encode() not in shipped
    table = pickle.loads(shipped)
    assert connection_options().items() <= table.options().items()
    assert table.open_lance().count_rows() == 30
