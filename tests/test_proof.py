"""The exactly-once proof on hand-made sample logs: it must fail whenever delivery was
wrong and hold on every correct run, including torn last lines and uncommitted steps."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from jobs import train_mixture
from lance_ray.proof.audit import Attempt, SampleLog, lineage


def log_attempt(root: Path, attempt: Attempt, steps: dict[int, list[int]],
                checkpoints: list[int]) -> SampleLog:
    log = SampleLog(root, attempt, 0)
    for step, ids in steps.items():
        log.write(step, ids)
    for step in checkpoints:
        log.checkpoint(step)
    log.close()
    return log


def test_steps_after_the_last_committed_checkpoint_are_not_in_the_committed_lineage(
        tmp_path):
    log_attempt(tmp_path, Attempt("a0", 0, 1, 1.0), {s: [s] for s in range(1, 8)}, [5])
    assert len(lineage(tmp_path)) == 7  # what was logged
    assert lineage(tmp_path, committed_only=True) == [[s] for s in range(1, 6)]
    # A restart from step 5 that commits the rest: every step is in it.
    log_attempt(tmp_path, Attempt("a1", 5, 1, 2.0), {s: [s] for s in range(6, 10)}, [9])
    assert lineage(tmp_path, committed_only=True) == [[s] for s in range(1, 10)]


def test_a_last_line_cut_short_is_dropped_and_any_other_bad_line_refused(tmp_path):
    log = log_attempt(tmp_path, Attempt("a0", 0, 1, 1.0), {1: [1], 2: [2]}, [2])
    rank0 = Path(log.dir) / "rank0.jsonl"
    with rank0.open("a") as f:
        f.write('{"step": 3, "ids": [3')  # the writer died mid-append
    log_attempt(tmp_path, Attempt("a1", 2, 1, 2.0), {3: [3]}, [3])
    assert lineage(tmp_path, committed_only=True) == [[1], [2], [3]]
    rank0.write_text('{"step": 1, "ids": [1]}\n{"step": 2, "ids"\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        lineage(tmp_path)


@pytest.fixture(scope="module")
def mixture_tables(tmp_path_factory) -> tuple[Path, dict[str, int]]:
    workdir = tmp_path_factory.mktemp("mixture")
    return workdir, train_mixture.make_tables(str(workdir / "db"), 400)


def write_mixture_log(workdir: Path, samples: list[tuple[int, int]]) -> SampleLog:
    """One attempt that trained ``samples`` in steps of 40, as the job's ranks log them."""
    logs = workdir / "samples"
    if logs.exists():
        shutil.rmtree(logs)
    return log_attempt(logs, Attempt("a0", 0, 1, 1.0, model_step=0),
                       {k // 40 + 1: [list(x) for x in samples[k:k + 40]]
                        for k in range(0, len(samples), 40)}, [])


def test_the_mixture_proof_checks_which_samples_not_how_many(mixture_tables):
    workdir, versions = mixture_tables
    planned = train_mixture.planned_samples(workdir, versions, 4, 0)
    write_mixture_log(workdir, planned)
    assert train_mixture.proof(workdir, versions, 4)["exactly_once"]
    source, _ = planned[5]
    stranger = [(source, 10**6), *planned[:5], *planned[6:]]  # one planned sample swapped
    write_mixture_log(workdir, stranger)
    result = train_mixture.proof(workdir, versions, 4)
    assert not result["exactly_once"]
    assert result["sources"][source]["lost"] == result["sources"][source]["unexpected"] == 1


@pytest.mark.parametrize("model_step", [3, 7])
def test_an_attempt_whose_data_and_model_resumed_at_different_steps_fails(tmp_path,
                                                                          model_step):
    """a0 trains 1..7 and saves step 5; a1's data says it resumed from 5, but its model was
    saved at another step: steps were trained twice (3) or never reached the model (7)."""
    log_attempt(tmp_path, Attempt("a0", 0, 1, 1.0, model_step=0),
                {s: [s] for s in range(1, 8)}, [5])
    log_attempt(tmp_path, Attempt("a1", 5, 1, 2.0, model_step=model_step),
                {s: [s] for s in range(6, 11)}, [10])
    with pytest.raises(ValueError, match=f"data from global step 5 but its model from step "
                                         f"{model_step}"):
        lineage(tmp_path, committed_only=True)


def test_an_attempt_that_trains_a_step_before_its_resume_again_fails(tmp_path):
    log_attempt(tmp_path, Attempt("a0", 0, 1, 1.0), {s: [s] for s in range(1, 6)}, [5])
    log_attempt(tmp_path, Attempt("a1", 5, 1, 2.0), {s: [s] for s in range(4, 11)}, [10])
    with pytest.raises(ValueError, match=r"resumed from global step 5 but trained steps "
                                         r"\[4, 5\] again"):
        lineage(tmp_path, committed_only=True)


def test_verify_fails_naming_the_reason_and_counts_steps_past_a_gap_in_an_unsaved_tail(
        tmp_path, monkeypatch, capsys):
    from jobs import verify
    from lance_ray.proof.audit import logged_steps
    from lance_ray.storage import write_json_atomic

    log_attempt(tmp_path / "run" / "samples", Attempt("a0", 0, 1, 1.0),
                {1: [1], 2: [2], 4: [4]}, [2])  # step 3 never logged, after the checkpoint
    assert logged_steps(tmp_path / "run" / "samples") == 3
    write_json_atomic(tmp_path / "run" / "run.json", {"rows": 2})
    monkeypatch.setattr(verify, "uninterrupted_steps", lambda run: [[1], [2]])
    with pytest.raises(SystemExit) as done:
        verify.main(["--storage-path", str(tmp_path), "--name", "run"])
    assert done.value.code == 0  # the saved model trained steps 1 and 2, each once
    log_attempt(tmp_path / "run" / "samples", Attempt("a1", 2, 1, 2.0, model_step=1),
                {3: [3]}, [3])
    with pytest.raises(SystemExit) as done:
        verify.main(["--storage-path", str(tmp_path), "--name", "run"])
    assert done.value.code == 1 and "PROOF: FAILED: attempt a1" in capsys.readouterr().out


def test_the_mixture_proof_drops_a_cut_last_line_and_refuses_steps_trained_again(
        mixture_tables):
    workdir, versions = mixture_tables
    planned = train_mixture.planned_samples(workdir, versions, 4, 0)
    log = write_mixture_log(workdir, planned)
    with (Path(log.dir) / "rank0.jsonl").open("a") as f:
        f.write('{"step": 99, "ids": [[0, 2')  # the rank died mid-write
    assert train_mixture.proof(workdir, versions, 4)["exactly_once"]
    # A later attempt that resumed from step 2 and logs step 2 again.
    log_attempt(workdir / "samples", Attempt("a1", 2, 1, 9.0, model_step=2),
                {2: [list(x) for x in planned[40:80]]}, [])
    with pytest.raises(ValueError, match=r"resumed from global step 2 but trained steps "
                                         r"\[2\]"):
        train_mixture.proof(workdir, versions, 4)


def test_verify_tells_a_run_that_has_not_finished_from_a_wrong_one(tmp_path, monkeypatch,
                                                                  capsys):
    from jobs import verify
    from lance_ray.storage import write_json_atomic

    samples = tmp_path / "run" / "samples"
    log_attempt(samples, Attempt("a0", 0, 1, 1.0), {1: [1], 2: [2]}, [2])
    log_attempt(samples, Attempt("a1", 2, 1, 2.0), {}, [])  # restarted, died at once
    write_json_atomic(tmp_path / "run" / "run.json", {"rows": 4})
    monkeypatch.setattr(verify, "uninterrupted_steps", lambda run: [[1], [2], [3], [4]])
    with pytest.raises(SystemExit) as done:
        verify.main(["--storage-path", str(tmp_path), "--name", "run"])
    out = capsys.readouterr().out
    assert done.value.code == 1 and "attempt 1: 1 worker(s), resumed from step 2, logged no " \
                                    "step" in out
    assert "PROOF: INCOMPLETE: the saved model reached global step 2 of 4" in out
    log_attempt(samples, Attempt("a2", 2, 1, 3.0), {3: [4], 4: [3]}, [4])  # steps swapped
    with pytest.raises(SystemExit):
        verify.main(["--storage-path", str(tmp_path), "--name", "run"])
    assert capsys.readouterr().out.splitlines()[-1] == "PROOF: FAILED"
