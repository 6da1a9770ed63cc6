"""Credentials never travel or persist; checkpoints are plain JSON, never pickles."""

from __future__ import annotations

import json
import os
import pickle

import pytest

import lance_ray

SECRET = "s3cr3t-AKIA-do-not-leak"


def options_from_env() -> dict[str, str]:
    """A storage-options factory that reads credentials where the table is opened."""
    return {"aws_secret_access_key": os.environ["LANCE_RAY_TEST_SECRET"]}


def test_storage_credentials_never_appear_in_pickles_states_or_reprs(monkeypatch, table_1k,
                                                                     caplog):
    monkeypatch.setenv("LANCE_RAY_TEST_SECRET", SECRET)
    ds = lance_ray.StreamingDataset(table_1k.to_lance().uri, num_splits=4, reader="local",
                                    storage_options=options_from_env)
    next(ds.iter_batches(8))
    assert SECRET.encode() not in pickle.dumps(ds)
    assert SECRET not in json.dumps(ds.state_dict())
    assert SECRET not in repr(ds._table) and SECRET not in caplog.text


def test_storage_options_must_be_a_factory_not_a_dict(table_1k):
    with pytest.raises(TypeError, match="zero-argument callable"):
        lance_ray.StreamingDataset(table_1k, reader="local",
                                   storage_options={"aws_secret_access_key": SECRET})


def test_a_checkpoint_file_is_json_and_a_pickle_is_refused(tmp_path, table_1k):
    ds = lance_ray.StreamingDataset(table_1k, num_splits=4, reader="local")
    path = tmp_path / "state.json"
    lance_ray.save_state(path, ds.state_dict())
    assert json.loads(path.read_text())["num_splits"] == 4
    path.write_bytes(pickle.dumps(ds.state_dict()))
    with pytest.raises(ValueError, match="not valid JSON"):
        lance_ray.load_state(path)
