"""The Ray reader keeps every CPU it may use busy, proven by structure, not by timing: with N
declared CPUs and a transform that records when each call starts and ends, at some point of
a pass at least 0.75 N calls overlap in Ray's workers; and in the same pass order,
exactly-once delivery and a mid-pass checkpoint are those of the local reader and of
``lancedb.streaming``.

The pass runs in a child Python with a Ray of its own (``ray.init(address="local",
num_cpus=N)``): the session's cluster has two CPUs, and one process cannot hold two.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

CPUS = 8
ROWS = 2100  # a multiple of the splits: the reference drops a remainder
WAIT_S = 0.008  # per row: holds no CPU, so N declared CPUs can overlap on two real cores
BATCH = 64


class Recorded:
    """Waits ``wait`` a row, appends ``pid start end rows`` to ``path``; one
    ``{"id", "image"}`` per row."""

    def __init__(self, path: str, wait: float = WAIT_S):
        self.path, self.wait = path, wait

    def __call__(self, batch: pa.RecordBatch) -> list[dict]:
        started = time.time()
        time.sleep(batch.num_rows * self.wait)
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()} {started} {time.time()} {batch.num_rows}\n")
        return [{"id": i, "image": np.full((3, 8, 8), i % 251, dtype=np.uint8)}
                for i in batch.column("id").to_pylist()]


def max_overlap(calls: list[tuple[float, float]]) -> int:
    """The most intervals ``(start, end)`` open at one instant."""
    events = sorted([(s, 1) for s, _ in calls] + [(e, -1) for _, e in calls])
    now = most = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


def _hold(path: str) -> None:
    """Returns once ``CPUS`` of these run at once (each in its own worker process)."""
    with open(path, "a") as f:
        f.write(f"{os.getpid()}\n")
    deadline = time.time() + 120
    while len(Path(path).read_text().split()) < CPUS and time.time() < deadline:
        time.sleep(0.05)


def _ids(batches) -> list[int]:
    return [int(i) for b in batches for i in b["id"].tolist()]


def child(folder: str) -> dict:
    """One pass of each reader over a fresh table, and a resume from the middle."""
    import lancedb
    import ray
    from lancedb import streaming as reference

    import lance_ray

    table = lancedb.connect(folder).create_table(
        "t", pa.table({"id": np.arange(ROWS, dtype=np.int64), "x": np.ones(ROWS)}))
    log = os.path.join(folder, "calls.log")
    kw = {"num_splits": 3, "shuffle_seed": 7}
    # The same items without the wait: the sequences do not depend on it.
    local = _ids(lance_ray.StreamingDataset(table, reader="local", transform=Recorded(log, 0),
                                            **kw).iter_batches(BATCH))
    expected = [int(x["id"]) for x in reference.StreamingDataset(
        table, transform=Recorded(log, 0), **kw)]
    ray.init(address="local", num_cpus=CPUS, include_dashboard=False, log_to_driver=False)
    try:
        # N worker processes up before the pass: Ray starts workers a few at a time, and a
        # pass of short tasks can end before the last one is up (that is start-up, not the
        # pipeline's shape). N tasks held at once need N workers.
        hold = ray.remote(num_cpus=1)(_hold)
        ray.get([hold.remote(os.path.join(folder, "up")) for _ in range(CPUS)])
        os.remove(log)
        ours = lance_ray.StreamingDataset(table, reader="ray", transform=Recorded(log), **kw)
        got = _ids(ours.iter_batches(BATCH))
        lines = [line.split() for line in Path(log).read_text().splitlines()]
        calls = [(float(s), float(e)) for pid, s, e, _ in lines if int(pid) != os.getpid()]
        # A checkpoint in the middle of a pass, resumed by a new view.
        view = lance_ray.StreamingDataset(table, reader="ray", transform=Recorded(log), **kw)
        it = view.iter_batches(BATCH)
        head = _ids(next(it) for _ in range(ROWS // BATCH // 2))
        state = view.state_dict()
        it.close()
        again = lance_ray.StreamingDataset(table, reader="ray", transform=Recorded(log), **kw)
        again.load_state_dict(state)
        rest = _ids(again.iter_batches(BATCH))
    finally:
        ray.shutdown()
    return {"ray": got, "local": local, "reference": expected, "head": head, "rest": rest,
            "overlap": max_overlap(calls), "calls": len(calls)}


def test_the_ray_reader_overlaps_three_quarters_of_its_cpus_and_keeps_order(tmp_path):
    env = os.environ | {"RAY_AUTH_MODE": "disabled", "RAY_DATA_DISABLE_PROGRESS_BARS": "1",
                        "RAY_USAGE_STATS_ENABLED": "0"}
    here = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, str(Path(here).parent),
                                                    env.get("PYTHONPATH")) if p)
    done = subprocess.run([sys.executable, __file__, str(tmp_path)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # Concurrency by structure: calls open at one instant in Ray's workers.
    assert out["overlap"] >= 0.75 * CPUS, out["overlap"]
    # Order and exactly-once: the reference's sequence, as the local reader gives it.
    assert out["ray"] == out["local"] == out["reference"]
    assert sorted(out["ray"]) == list(range(ROWS))
    # Checkpoint: the resumed view yields exactly the rest of the sequence.
    assert out["head"] + out["rest"] == out["reference"]
    assert out["head"] and out["rest"]


if __name__ == "__main__":
    print(json.dumps(child(sys.argv[1])), flush=True)
