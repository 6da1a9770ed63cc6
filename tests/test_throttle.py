"""Seal writes are throttled, never dropped: the last request always runs, at most
``every_s`` late."""

from __future__ import annotations

import threading
import time

from lance_ray.coordinator.throttle import Throttled


def test_a_burst_runs_once_at_once_and_once_more_for_its_last_request():
    runs: list[float] = []
    lock = threading.RLock()
    throttled = Throttled(lambda: runs.append(time.monotonic()), 0.1, lock)
    started = time.monotonic()
    for _ in range(20):
        with lock:
            throttled.request()
    assert len(runs) == 1
    deadline = time.monotonic() + 10
    while len(runs) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.3)
    assert len(runs) == 2  # the burst's last request, once
    assert runs[1] - started >= 0.1


def test_requests_an_interval_apart_run_at_once():
    now = [0.0]
    runs: list[float] = []
    throttled = Throttled(lambda: runs.append(now[0]), 1.0, threading.RLock(),
                          clock=lambda: now[0])
    for t in (0.0, 1.0, 2.5, 3.5):
        now[0] = t
        throttled.request()
    assert runs == [0.0, 1.0, 2.5, 3.5]
