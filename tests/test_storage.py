"""Every file lance_ray writes or reads works on object storage, through one module.

Against a real S3-compatible server (moto, started by the session fixture on 127.0.0.1):
paths and URIs resolve to the right filesystem, JSON writes are atomic for readers, states,
checkpoint data states and sample logs live on S3, and an unreachable store fails after a
bounded time with a clear error.
"""

from __future__ import annotations

import io
import json
import os
import threading
import time
from pathlib import Path

import pyarrow.fs as pafs
import pytest

import lance_ray
from lance_ray import storage
from lance_ray.proof.audit import Attempt, SampleLog, lineage, read_attempts
from lance_ray.train import (
    MODEL_FILE,
    STATE_FILE,
    checkpoint_data_state,
    load_model_state,
    restored_data_state,
)


def test_a_string_with_an_unknown_scheme_is_an_error_never_a_local_path(tmp_path,
                                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)
    for bad in ("s4://bucket/x.json", "hdfs://nn/x.json", "ftp://host/x.json"):
        with pytest.raises(ValueError, match="unsupported storage scheme"):
            lance_ray.storage.write_json_atomic(bad, {"anything": 1})
        with pytest.raises(ValueError, match="unsupported storage scheme"):
            lance_ray.load_state(bad)
    with pytest.raises(ValueError, match="names no bucket"):
        storage.resolve("s3:///x.json")
    with pytest.raises(ValueError, match="lost a slash"):  # what pathlib makes of a URI
        lance_ray.storage.write_json_atomic(Path("s3://bucket/runs/x.json"), {"anything": 1})
    assert list(tmp_path.iterdir()) == []  # nothing like ./s4:/bucket was created


def test_local_paths_and_file_uris_are_the_same_local_file(tmp_path):
    fs, path = storage.resolve(f"file://{tmp_path}/a.json")
    assert isinstance(fs, pafs.LocalFileSystem) and path == str(tmp_path / "a.json")
    storage.write_json_atomic(f"file://{tmp_path}/a.json", {"v": 1})
    assert storage.read_json(tmp_path / "a.json") == {"v": 1}
    assert storage.list_files(tmp_path) == [str(tmp_path / "a.json")]
    assert storage.join("s3://b/runs/", "x", "/y.json") == "s3://b/runs/x/y.json"


@pytest.mark.parametrize("fsync", [False, True])
def test_a_local_write_has_the_mode_the_umask_gives_and_leaves_no_temp_file(tmp_path, fsync):
    old = os.umask(0o022)
    try:
        for _ in range(2):  # a new file, then one replaced
            storage.write_json_atomic(tmp_path / "state.json", {"v": 1}, fsync=fsync)
            assert (tmp_path / "state.json").stat().st_mode & 0o777 == 0o644
    finally:
        os.umask(old)
    assert os.listdir(tmp_path) == ["state.json"]


def test_a_reader_sees_the_old_object_or_the_new_one_never_half(s3):
    uri = f"{s3}/big.json"
    payload = "x" * 400_000  # big enough that a torn write would be seen
    storage.write_json_atomic(uri, {"version": 0, "payload": payload})
    seen: list[int] = []
    errors: list[BaseException] = []
    done = threading.Event()

    def read_while_writing() -> None:
        try:
            while not done.is_set():
                obj = storage.read_json(uri)  # a torn object would not parse
                assert obj["payload"] == payload
                seen.append(obj["version"])
        except BaseException as e:
            errors.append(e)

    reader = threading.Thread(target=read_while_writing)
    reader.start()
    for version in range(1, 16):
        storage.write_json_atomic(uri, {"version": version, "payload": payload})
    done.set()
    reader.join()
    assert not errors, errors
    assert seen == sorted(seen) and storage.read_json(uri)["version"] == 15


def test_states_and_checkpoint_data_states_round_trip_on_s3(s3, table_1k, tmp_path):
    ranks = [lance_ray.StreamingDataset(table_1k, num_splits=4, rank=r, world_size=2,
                                        reader="local") for r in range(2)]
    for ds in ranks:
        it = ds.iter_batches(8)
        for _ in range(3):
            next(it)
    ckpt = f"{s3}/checkpoint_000001"
    for ds in ranks:
        lance_ray.save_state(storage.join(ckpt, STATE_FILE.format(rank=ds.rank)),
                             ds.state_dict())
    merged = lance_ray.merge_state_dicts([ds.state_dict() for ds in ranks])
    assert checkpoint_data_state(ckpt) == merged
    lance_ray.save_state(f"{s3}/merged.json", merged)
    assert lance_ray.load_state(f"{s3}/merged.json") == merged
    assert checkpoint_data_state(f"{s3}/no-such-checkpoint") is None
    assert not list(tmp_path.iterdir())  # nothing landed on the local disk


def test_a_restored_checkpoint_is_read_from_the_store_never_from_a_shared_temp_dir(
        s3, table_1k, tmp_path, monkeypatch):
    """Ray's ``Checkpoint.as_directory()`` downloads into one temp dir per node and deletes
    it when the last reader leaves; a rank arriving then is handed it empty (seen in CI: that
    rank started the epoch over and DDP hung). The race cannot be forced on demand, so
    ``as_directory`` is replaced by its outcome, an empty directory: the restore must not
    care, because it reads the checkpoint's files from its own filesystem."""
    import contextlib

    import ray.train
    import torch

    ds = lance_ray.StreamingDataset(table_1k, num_splits=4, reader="local")
    next(ds.iter_batches(8))
    ckpt = f"{s3}/checkpoint_000002"
    lance_ray.save_state(storage.join(ckpt, STATE_FILE.format(rank=0)), ds.state_dict())
    model = {"w": torch.arange(6.0).reshape(2, 3)}
    buf = io.BytesIO()
    torch.save(model, buf)
    storage.write_bytes_atomic(storage.join(ckpt, MODEL_FILE), buf.getvalue())
    checkpoint = ray.train.Checkpoint(ckpt.removeprefix("s3://"),
                                      filesystem=storage.s3_filesystem_from_env())
    empty = tmp_path / "emptied-by-another-rank"
    empty.mkdir()
    monkeypatch.setattr(ray.train.Checkpoint, "as_directory",
                        lambda self: contextlib.nullcontext(str(empty)))
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: checkpoint)
    assert restored_data_state() == lance_ray.merge_state_dicts([ds.state_dict()])
    assert torch.equal(load_model_state()["w"], model["w"])

    only_model = ray.train.Checkpoint(storage.join(ckpt, "no-state").removeprefix("s3://"),
                                      filesystem=checkpoint.filesystem)
    storage.write_bytes_atomic(storage.join(ckpt, "no-state", MODEL_FILE), buf.getvalue())
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: only_model)
    with pytest.raises(ValueError, match=r"holds no lance_ray data state.*lance_ray\.train"
                                         r"\.report"):
        restored_data_state()  # never a silent restart of the data under a resumed model
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)
    assert restored_data_state() is None and load_model_state() is None


def test_sample_logs_on_s3_rebuild_the_steps_the_model_descends_from(s3):
    root = f"{s3}/samples"
    first = Attempt("a0", 0, 2, 1.0)
    logs = [SampleLog(root, first, r, flush_every=3) for r in range(2)]
    for step in range(1, 8):
        for r, log in enumerate(logs):
            log.write(step, [step * 10 + r])
    for log in logs:
        log.flush()  # as before a checkpoint at step 7
    logs[0].write(8, [999])  # logged after the checkpoint, then the attempt crashed
    logs[0].flush()
    resumed = SampleLog(root, Attempt("a1", 7, 1, 2.0), 0)
    resumed.write(8, [80, 81])
    resumed.close()
    assert [len(s) for _, s in read_attempts(root)] == [8, 1]
    steps = lineage(root)
    assert steps[:7] == [[s * 10, s * 10 + 1] for s in range(1, 8)]
    assert steps[7] == [80, 81]


def test_an_unreachable_store_fails_after_the_bound_with_a_clear_error(monkeypatch):
    from lance_ray.testing.local_s3 import free_port

    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nobody there
    started = time.monotonic()
    with pytest.raises(storage.StorageUnavailable, match=r"could not write s3://.*attempts"):
        storage.write_json_atomic("s3://bucket/x.json", {"v": 1},
                                  retry=storage.RetryPolicy(timeout_s=1.0))
    assert time.monotonic() - started < 60  # bounded: never a hang


def test_missing_files_and_bad_json_are_never_retried_or_unpickled(s3):
    with pytest.raises(FileNotFoundError):
        storage.read_json(f"{s3}/missing.json", retry=storage.RetryPolicy(timeout_s=30))
    storage.write_bytes_atomic(f"{s3}/bad.json", b"\x80\x04not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        lance_ray.load_state(f"{s3}/bad.json")


def test_retries_wait_with_bounded_backoff_and_then_succeed():
    calls = []

    def flaky() -> str:
        calls.append(time.monotonic())
        if len(calls) < 4:
            raise OSError("AWS Error NETWORK_CONNECTION: Could not connect to server")
        return "ok"

    policy = storage.RetryPolicy(timeout_s=30, first_backoff_s=0.01, max_backoff_s=0.02)
    assert storage.with_retries(flaky, what="read x", remote=True, policy=policy) == "ok"
    assert len(calls) == 4
    with pytest.raises(OSError, match="ACCESS_DENIED"):  # permanent: raised at once
        storage.with_retries(lambda: (_ for _ in ()).throw(OSError("ACCESS_DENIED")),
                             what="read x", remote=True, policy=policy)


def test_run_storage_json_is_plain_json_on_s3(s3):
    storage.write_json_atomic(f"{s3}/run.json", {"a": [1, 2]})
    fs, path = storage.resolve(f"{s3}/run.json")
    with fs.open_input_stream(path) as f:
        assert json.loads(f.read()) == {"a": [1, 2]}
