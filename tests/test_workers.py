"""DataLoader workers start in any script, guarded by ``if __name__ == "__main__":`` or not.

Each test runs a real script in a fresh interpreter (the guard question is about the
``__main__`` module, which a pytest process cannot stand in for).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, os, sys
import lancedb
import lance_ray

STARTS = os.environ["STARTS_FILE"]
with open(STARTS, "a") as f:          # one line per run of this script, in any process
    f.write(f"{os.getpid()}\\n")

def tripled(batch):                   # defined here: travels to the workers by value
    return [{"id": r["id"], "x3": r["id"] * 3} for r in batch.to_pylist()]

def note_worker(worker_id):
    with open(os.environ["INIT_FILE"], "a") as f:
        f.write(f"{worker_id}\\n")

{body}
"""

BODY = """
table = lancedb.connect(sys.argv[1]).open_table("t")
ds = lance_ray.StreamingDataset(table, num_splits=4, shuffle_seed=3, reader="local",
                                transform=lambda b: tripled(b))  # a lambda reaches them too
loader = lance_ray.StreamingDataLoader(ds, batch_size=50, num_workers=2,
                                       worker_init_fn=note_worker{context})
ids = [int(i) for batch in loader for i, x3 in zip(batch["id"], batch["x3"])
       if int(x3) == 3 * int(i)]
print(json.dumps(ids))
"""


def run_script(tmp_path: Path, db: str, *, guarded: bool, context: str = ""
               ) -> subprocess.CompletedProcess[str]:
    body = BODY.format(context=context)
    if guarded:
        body = 'if __name__ == "__main__":\n' + textwrap.indent(body, "    ")
    script = tmp_path / ("guarded.py" if guarded else "unguarded.py")
    script.write_text(SCRIPT.replace("{body}", body))
    env = os.environ | {"PYTHONPATH": str(REPO), "STARTS_FILE": str(tmp_path / "starts"),
                        "INIT_FILE": str(tmp_path / "inits")}
    return subprocess.run([sys.executable, str(script), db], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def db_2k(table_factory) -> str:
    return str(Path(table_factory(2000, 2).to_lance().uri).parent)


@pytest.mark.parametrize("guarded", [False, True], ids=["unguarded", "guarded"])
def test_loader_workers_work_in_any_script_and_read_every_sample_once(tmp_path, db_2k,
                                                                      guarded):
    done = run_script(tmp_path, db_2k, guarded=guarded)
    assert done.returncode == 0, done.stderr[-3000:]
    ids = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(ids) == list(range(2000))  # the transform ran, every sample exactly once
    starts = (tmp_path / "starts").read_text().split()
    if not guarded:
        assert len(starts) == 1, "workers must not run an unguarded script again"
    assert sorted((tmp_path / "inits").read_text().split()) == ["0", "1"]
    assert "not fork-safe" not in done.stderr  # the fork server's forks are safe: no warning


def test_an_unguarded_script_may_fork_its_workers_itself(tmp_path, db_2k):
    # fork copies the parent and never runs the script again: nothing to refuse (Lance's
    # own fork-safety warning is the user's to weigh).
    done = run_script(tmp_path, db_2k, guarded=False, context=', multiprocessing_context="fork"')
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(json.loads(done.stdout.strip().splitlines()[-1])) == list(range(2000))


def test_an_unguarded_script_with_its_own_start_method_fails_at_once_naming_the_guard(
        tmp_path, db_2k):
    done = run_script(tmp_path, db_2k, guarded=False, context=', multiprocessing_context="spawn"')
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: StreamingDataLoader workers started from line")
    assert 'if __name__ == "__main__":' in last and "multiprocessing_context" in last
    assert "exited unexpectedly" not in done.stderr
