"""The jobs refuse bad arguments and unusable clusters up front, with a message that says
what to change, instead of hanging or failing deep inside Ray Train. No Ray here: every
check must fire before a job connects to (or starts) a cluster."""

from __future__ import annotations

import pytest

from jobs import train as train_job

# --- worker resources -------------------------------------------------------------------

@pytest.mark.parametrize("resources, want", [({"CPU": 2.0}, {"CPU": 0.5}),
                                             ({"CPU": 2.0, "slot": 4.0}, {"slot": 1}),
                                             ({"slot": 8.0}, {"slot": 1})])
def test_workers_ask_for_slots_or_cpus_on_a_cluster_without_slots(monkeypatch, resources,
                                                                  want):
    monkeypatch.setattr(train_job.ray, "cluster_resources", lambda: resources)
    assert train_job.worker_resources(4) == want


def test_a_cluster_with_too_few_slots_is_refused_not_run_on_cpus_that_starve_reads(
        monkeypatch):
    monkeypatch.setattr(train_job.ray, "cluster_resources", lambda: {"CPU": 3.0, "slot": 2.0})
    with pytest.raises(SystemExit) as e:
        train_job.worker_resources(4)
    msg = str(e.value.code)
    assert "4" in msg and "2 train slot" in msg and "cluster/local.sh resize 2" in msg, msg
    assert "--workers" in msg, msg
