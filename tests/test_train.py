"""Ray Train end to end: a real TorchTrainer run that crashes, resumes on another world size,
and trains on every sample exactly once, as proven from its own sample logs."""

from __future__ import annotations

import pytest
import ray.cloudpickle

import lance_ray
from jobs import train as train_job
from jobs import verify as verify_job
from lance_ray.proof.audit import read_attempts
from lance_ray.testing.tables import create_table
from lance_ray.train import check_world_sizes

# Train workers cannot import jobs/ as a module: ship the job's loop by value, as
# `ray job submit` does for a __main__ script.
ray.cloudpickle.register_pickle_by_value(train_job)


@pytest.fixture
def run_args(tmp_path, request):
    db = tmp_path / "db"
    create_table(str(db), "demo", rows=960, dim=16, fragments=3)
    name = request.node.name[:40]  # one run (and coordinator) per test
    return ["--db", str(db), "--table", "demo", "--storage-path", str(tmp_path / "storage"),
            "--name", name, "--num-splits", "8", "--global-batch", "32",
            "--checkpoint-every", "4"], tmp_path / "storage" / name


def test_crash_then_resume_on_another_world_size_trains_every_sample_exactly_once(
        ray_session, run_args):
    args, run_dir = run_args
    first = train_job.main(args + ["--workers", "2", "--crash-at-step", "6",
                                   "--stop-at-step", "12"])
    assert first["global_step"] == 12
    last = train_job.main(args + ["--workers", "4"])
    assert last["global_step"] == 30  # 960 rows / 32 per global step
    report, attempts = verify_job.verify_run(run_dir)
    assert len(attempts) == 3, attempts  # crashed, recovered, resized
    # The crash came two steps after every rank reported the step-4 checkpoint, well
    # within one controller poll: lt.report waited until it was registered, so the
    # restart resumed from it rather than from the start.
    assert [a.resumed_from_step for a, _ in read_attempts(run_dir / "samples")] == [0, 4, 12]
    assert report.exactly_once and report.after == report.planned == 960, report
    assert report.steps_identical, report


def test_local_mode_stop_and_resume_is_exactly_once(ray_session, run_args):
    args, run_dir = run_args
    train_job.main(args + ["--local-mode", "--stop-at-step", "9"])
    train_job.main(args + ["--local-mode"])
    report, attempts = verify_job.verify_run(run_dir)
    assert len(attempts) == 2
    assert report.exactly_once and report.steps_identical and report.after == 960, report


def test_world_sizes_that_cannot_divide_num_splits_are_refused_before_training():
    check_world_sizes((1, 2), 8)
    check_world_sizes(6, 12)
    with pytest.raises(ValueError, match=r"sizes \[3\].*valid world sizes are \[1, 2, 4, 8\]"):
        check_world_sizes((2, 4), 8)
    for bad, name in ((0, "num_workers"), ((0, 2), "num_workers"), ((-1, 2), "num_workers")):
        with pytest.raises(ValueError, match=name):
            check_world_sizes(bad, 8)
    with pytest.raises(ValueError, match="minimum world size is above the maximum"):
        check_world_sizes((4, 2), 8)
    for splits, batch, name in ((0, None, "num_splits"), (8, 0, "global_batch"),
                                (8, -8, "global_batch")):
        with pytest.raises(ValueError, match=name):
            check_world_sizes(2, splits, global_batch=batch)


def test_a_run_on_s3_crashes_and_resumes_on_another_world_size_exactly_once(ray_session, s3):
    """No shared disk: table, Ray Train checkpoints, ledger and sample logs all on S3."""
    from test_security import assert_no_credentials

    from lance_ray import storage

    create_table(f"{s3}/db", "demo", rows=640, dim=16, fragments=2)
    name = "s3-run"
    args = ["--db", f"{s3}/db", "--table", "demo", "--storage-path", f"{s3}/runs",
            "--name", name, "--num-splits", "8", "--global-batch", "32",
            "--checkpoint-every", "4"]
    first = train_job.main(args + ["--workers", "2", "--crash-at-step", "6",
                                   "--stop-at-step", "12"])
    assert first["global_step"] == 12
    last = train_job.main(args + ["--workers", "4"])
    assert last["global_step"] == 20  # 640 rows / 32 per global step
    run_dir = f"{s3}/runs/{name}"
    report, attempts = verify_job.verify_run(run_dir)
    # Crashed, recovered, resized. A second fit() in one driver can see Ray retry its group
    # once before any step (notes/ray-ecosystem.md: a placement group removed by the previous
    # run's cleaner); such an attempt trains nothing and changes no progress.
    trained = [a for a in attempts if "logged steps 0..0" not in a]
    assert len(trained) == 3, attempts
    assert report.exactly_once and report.after == report.planned == 640, report
    assert report.steps_identical, report
    assert any("checkpoint_" in d for d in storage.list_dirs(run_dir))  # Ray Train's, on S3
    assert storage.exists(f"{run_dir}/coordinator/{name}/coordinator.json")
    assert_no_credentials(run_dir)  # checkpoints, Ray Train's own files, ledger, logs


def _resume_at_own_rank(config: dict) -> None:
    import lance_ray.train as lt

    rank = ray.train.get_context().get_world_rank()
    lt._check_ranks_agree({"lance_ray": {"global_step": 4 * rank}}, rank)


def test_a_global_batch_that_is_not_a_multiple_of_num_splits_is_refused():
    check_world_sizes((2, 4), 12, global_batch=48)
    with pytest.raises(ValueError,
                       match=r"not a multiple of num_splits \(48\).*\[4, 8, 16, 32, 64\]"):
        check_world_sizes(4, 48, global_batch=64)
    # Suggestions that hold: a num_splits every world size divides, or, where no num_splits
    # can fit the batch, a batch that fits the splits.
    with pytest.raises(ValueError, match=r"\(a multiple of 16, e\.g\. 16\)$"):
        check_world_sizes(16, 12)
    with pytest.raises(ValueError, match=r"narrow the range, or .*a multiple of 12, e\.g\. 12"):
        check_world_sizes((2, 4), 10)
    with pytest.raises(ValueError, match=r"No num_splits both divides it and is a multiple of "
                                         r"12 .*e\.g\. 48$"):
        check_world_sizes((2, 4), 12, global_batch=50)


def _two_ranks(loop, name: str, tmp_path, config: dict | None = None):
    """A TorchTrainer of two half-CPU ranks that must not retry (the tests expect its
    first failure)."""
    import ray.train
    from ray.train.torch import TorchTrainer

    return TorchTrainer(
        loop, train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(num_workers=2,
                                               resources_per_worker={"CPU": 0.5}),
        run_config=ray.train.RunConfig(name=name, storage_path=str(tmp_path),
                                       failure_config=ray.train.FailureConfig(max_failures=0)))


def _resume_uneven(config: dict) -> None:
    import ray.train

    import lance_ray.train as lt

    rank = ray.train.get_context().get_world_rank()
    ds = lance_ray.StreamingDataset(config["table"], num_splits=8, rank=rank, world_size=2,
                                    reader="local")
    ds.load_state_dict(config["state"])
    lt._check_samples_left(ds, rank)


def test_ranks_left_with_different_numbers_of_samples_fail_the_start_not_hang(
        ray_session, table_1k, tmp_path):
    """A one-rank checkpoint taken after a batch of 3 over 8 splits leaves the splits
    unequally consumed: on two ranks, one would run a step more than the other, and DDP
    would wait for it until gloo times out."""
    one = lance_ray.StreamingDataset(table_1k, num_splits=8, reader="local")
    next(one.iter_batches(3))
    trainer = _two_ranks(_resume_uneven, "uneven", tmp_path,
                         {"table": table_1k.to_lance().uri, "state": one.state_dict()})
    with pytest.raises(Exception, match=r"rank 1 has \d+ samples left after restoring and "
                                        r"rank 0 has \d+"):
        trainer.fit()


def test_ranks_that_would_resume_from_different_states_fail_the_start_not_hang(
        ray_session, tmp_path):
    """A rank that restored another state (e.g. found its checkpoint empty) would train
    other steps than its peers, whose DDP collectives would then wait for it until gloo
    times out (30 min); the ranks compare what they restore and refuse instead."""
    trainer = _two_ranks(_resume_at_own_rank, "disagree", tmp_path)
    with pytest.raises(Exception, match=r"rank 1 restores a different data state \(global "
                                        r"step 4\) than rank 0"):
        trainer.fit()
