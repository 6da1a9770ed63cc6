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


# ----------------------------------------------------------------------- on object storage

def s3_options_from_env() -> dict[str, str]:
    """A Lance-style storage-options factory for S3, read where the store is opened."""
    return {"aws_access_key_id": os.environ["AWS_ACCESS_KEY_ID"],
            "aws_secret_access_key": os.environ["AWS_SECRET_ACCESS_KEY"],
            "aws_endpoint": os.environ["AWS_ENDPOINT_URL"], "aws_region": "us-east-1",
            "allow_http": "true"}


def objects_under(uri: str) -> dict[str, bytes]:
    """Every object under an ``s3://`` prefix, with its bytes."""
    import pyarrow.fs as pafs

    from lance_ray import storage

    fs, prefix = storage.resolve(uri)
    infos = fs.get_file_info(pafs.FileSelector(prefix, recursive=True))
    return {i.path: fs.open_input_file(i.path).readall() for i in infos
            if i.type == pafs.FileType.File}


def assert_no_credentials(uri: str) -> None:
    secret = os.environ["AWS_SECRET_ACCESS_KEY"].encode()
    objects = objects_under(uri)
    assert objects
    leaked = [k for k, data in objects.items() if secret in data]
    assert not leaked, f"credentials written to {leaked}"


def test_s3_credentials_never_appear_in_objects_states_logs_or_pickles(ray_session, s3,
                                                                       caplog):
    import ray.cloudpickle
    from conftest import write_table

    from lance_ray.driver.handle import Coordinator
    from lance_ray.proof.audit import Attempt, SampleLog

    table = write_table(f"{s3}/db", 200)
    coord = Coordinator.create(table, "secrets", storage_path=f"{s3}/store", world_size=1,
                               num_splits=4, storage_options=s3_options_from_env)
    try:
        ds = coord.view(0, 1, reader="local")
        log = SampleLog(f"{s3}/samples", Attempt("a0", 0, 1, 0.0), 0,
                        storage_options=s3_options_from_env)
        for batch in ds.iter_batches(20):
            log.write(ds.global_step, batch["id"].tolist())
        log.close()
        state = coord.state_dict()
        lance_ray.save_state(f"{s3}/state.json", state, storage_options=s3_options_from_env)
        secret = os.environ["AWS_SECRET_ACCESS_KEY"]
        assert secret not in json.dumps(state)
        assert secret.encode() not in pickle.dumps(ds)
        assert secret.encode() not in ray.cloudpickle.dumps(coord)
        assert secret not in repr(ds._table) and secret not in caplog.text
        assert_no_credentials(s3)  # ledger, states, logs, table files, version tag
    finally:
        coord.kill()
