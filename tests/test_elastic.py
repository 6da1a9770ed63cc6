"""In-run elastic training and chaos in real TorchTrainer runs
(``python -m jobs.faults.chaos --trainer``).

Each test drives its own ``ray.cluster_utils.Cluster`` from a subprocess: nodes may only be
added and removed from a cluster's main thread, and this session may already be connected
to the ``ray_cluster`` fixture's cluster. The runs are proven from their per-step sample
logs (``jobs/verify.py``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def trainer_chaos(work: Path, kinds: str, trials: int, seed: int = 0) -> list[dict]:
    """Run ``python -m jobs.faults.chaos --trainer`` and return its trial summaries."""
    out = work / "trials.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    proc = subprocess.run(
        [sys.executable, "-m", "jobs.faults.chaos", "--trainer", "--kinds", kinds, "--trials",
         str(trials), "--seed", str(seed), "--workdir", str(work), "--json", str(out)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=1800 * (trials + 1))
    assert out.exists(), proc.stdout[-4000:] + proc.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_a_node_joining_and_leaving_mid_epoch_resizes_the_run_exactly_once(
        tmp_path_factory):
    [trial] = trainer_chaos(tmp_path_factory.mktemp("el"), "elastic", 1)
    sizes = trial["world_sizes"].split("->")
    assert not trial["error"], trial["error"]
    assert sizes[0] == "2" and "4" in sizes and sizes[-1] == "2", trial  # grown, shrunk
    assert trial["steps_per_attempt"][-1] > 0, trial  # ... and shrunk mid-epoch
    assert trial["duplicates"] == 0 and trial["lost"] == 0, trial
    assert trial["steps_identical"] and trial["ok"], trial


@pytest.mark.slow
def test_train_workers_killed_in_report_or_with_their_node_lose_no_sample_or_checkpoint(
        tmp_path_factory):
    trials = trainer_chaos(tmp_path_factory.mktemp("ch"), "report,node", 2, seed=1)
    assert [t["kind"] for t in trials] == ["report", "node"]
    for t in trials:
        assert not t["error"], t["error"]
        assert t["restarts"] >= 1, t
        assert t["ok"] and t["steps_identical"], t
        assert t["lost_checkpoints"] == 0, t  # every restart resumed from the newest one
