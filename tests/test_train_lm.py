"""The LM job end to end: a real TorchTrainer run of a tiny causal transformer on packed
token blocks crashes, resumes on another world size, and trains on every block of the
epoch exactly once, in the global steps of one uninterrupted rank of the reference."""

from __future__ import annotations

import json

import pytest
import ray.train
import torch

from jobs import lm_data, train_lm
from jobs import verify as verify_job
from jobs.lm_model import document_mask, document_positions
from lance_ray.proof.audit import read_attempts
from lance_ray.testing.tables import create_table, token_rows


@pytest.fixture
def lm_args(tmp_path, request):
    db = tmp_path / "db"
    create_table(str(db), "tokens", rows=96, fragments=2, batch=token_rows(60, 128))
    name = request.node.name[:40]
    return ["--db", str(db), "--table", "tokens", "--storage-path", str(tmp_path / "storage"),
            "--name", name, "--vocab", "128", "--block-len", "64", "--num-splits", "4",
            "--global-batch", "8", "--checkpoint-every", "3"], tmp_path / "storage" / name


@pytest.mark.slow
@pytest.mark.parametrize("reader", ["lance_ray", "coordinator"])
def test_packed_lm_run_that_crashes_and_resumes_on_another_world_size_trains_every_block_once(
        ray_session, lm_args, reader):
    """lance_ray's packing under TorchTrainer: a worker dies at step 4 and the job fails (no
    retries: one worker-group start less on this small machine); a new job resumes the run
    on 1 worker from the step-3 checkpoint and finishes the epoch. The proof compares with
    one uninterrupted rank of the reference. ``coordinator``: the views are attached to the
    run's coordinator actor, which the second job recovers from its ledger and resizes.
    (``--reader reference`` runs the same job on ``lancedb.streaming``'s packing: ``make
    demo-lm`` style runs, not repeated here.)"""
    args, run_dir = lm_args
    args += ["--reader", reader]
    with pytest.raises(ray.train.TrainingFailedError):
        train_lm.main(args + ["--workers", "2", "--crash-at-step", "4", "--max-failures", "0"])
    last = train_lm.main(args + ["--workers", "1"])
    report, attempts = verify_job.verify_run(run_dir)
    assert [a.resumed_from_step for a, _ in read_attempts(run_dir / "samples")] == [0, 3]
    assert report.exactly_once and report.after == report.planned, report
    assert report.steps_identical and report.steps_compared == last["global_step"], report
    if reader == "coordinator":  # its ledger sealed the last step of the resized run
        saved = json.loads((run_dir / "coordinator" / run_dir.name / "coordinator.json")
                           .read_text())["ledger"]
        assert (saved["world_size"], saved["sealed"]["step"]) == (1, last["global_step"])


def test_blocks_are_identified_by_their_content():
    batch = {"input_ids": torch.tensor([[5, 6, 1, 0], [5, 6, 1, 0], [5, 6, 1, 7]]),
             "doc_ids": torch.tensor([[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 1]])}
    a, b, c = lm_data.block_ids(batch)
    assert a == b != c and 0 <= c < 2**63


def test_attention_stays_within_each_document_and_positions_restart():
    doc_ids = torch.tensor([[0, 0, 1, 1, 1, 2]])
    mask = document_mask(doc_ids)[0, 0]
    assert mask[3].tolist() == [False, False, True, True, False, False]
    assert not mask.triu(1).any()  # causal
    assert document_positions(doc_ids).tolist() == [[0, 1, 0, 1, 2, 0]]


def test_a_global_batch_that_splits_cycles_is_refused(tmp_path):
    spec = lm_data.PackSpec(db=str(tmp_path), table="t", table_version=1, num_splits=4,
                            shuffle_seed=0, block_len=8, eos_id=1, pad_id=0,
                            blocks_per_epoch=8, global_batch=6)
    with pytest.raises(ValueError, match="multiple of num_splits"):
        lm_data.PackedView(spec, "reference", 0, 2)
