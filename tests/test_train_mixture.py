"""The mixture training job end to end: TorchTrainer on three sources, a crash and a resize,
every sample of every source trained on exactly once, the mix as weighted."""

from __future__ import annotations

import pytest
import ray.cloudpickle

from jobs import train_mixture

# Train workers get the job's loop by value, as `ray job submit` ships a __main__ script.
ray.cloudpickle.register_pickle_by_value(train_mixture)


@pytest.mark.slow  # three Ray Train group starts: ~2.5 min on the shared 2-core VM
@pytest.mark.parametrize("route", ["checkpoints", "coordinator"])
def test_mixture_job_crashes_resizes_and_trains_each_source_exactly_once(ray_session, tmp_path,
                                                                         route):
    result = train_mixture.main(["--workdir", str(tmp_path), "--rows", "800", "--workers", "4",
                                 "--then", "2", "--crash-at-step", "5", "--stop-at-step", "8",
                                 "--checkpoint-every", "3",
                                 *(["--coordinator"] if route == "coordinator" else [])])
    # crashed at 5 (resumed from the step-3 checkpoint), stopped at 8, resized to 2 ranks
    assert result["attempts"] == [(4, 0), (4, 3), (2, 8)]
    assert result["exactly_once"], result
    assert all(s["lost"] == s["unexpected"] == s["repeated"] == 0 for s in result["sources"])
    assert result["global_step"] == 20  # 800 rows / 40 per global step
    for s in result["sources"]:
        assert abs(s["observed"] - s["weight"]) < 1e-9  # sizes in proportion: exact mix
    if route == "coordinator":  # it sealed the last step of the resized run
        assert result["coordinator_step"] == 20
