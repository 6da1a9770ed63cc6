"""Breaking things on purpose: one fault of each kind on the real multi-node cluster, each
ending with exactly-once coverage and the uninterrupted run's global steps.
(`python -m jobs.faults.chaos --trials 24` runs many more random kill points.)"""

from __future__ import annotations

import pytest

from jobs.faults import chaos


@pytest.mark.parametrize("kind", chaos.KINDS)
def test_a_fault_at_a_random_step_loses_and_repeats_nothing(ray_cluster, kind):
    # The replacement for a removed node gets the session cluster's worker-node resources.
    node_args = {"num_cpus": 1, "resources": {"at_w1": 1, "slot": 2}}
    [trial] = chaos.run_trials(ray_cluster, 1, seed=chaos.KINDS.index(kind),
                               node_args=node_args, rows=640, kinds=(kind,))
    assert trial.recovered, trial
    assert trial.report.exactly_once and trial.report.steps_identical, trial
