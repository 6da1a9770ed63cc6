"""A Ray-reader iterator left open does not hang the interpreter's exit."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_an_open_ray_reader_iterator_lets_the_interpreter_exit(tmp_path):
    # Ray's own exit handler shuts Ray down; an iterator still open then used to leave Ray
    # Data's prefetch threads waiting on the dead cluster, and the interpreter joins them.
    ray_dir = tempfile.mkdtemp(prefix="lrx")  # short: Ray's socket paths have a length limit
    script = textwrap.dedent(f"""
        import ray
        import lance_ray
        from lance_ray.testing.tables import create_table

        table = create_table({str(tmp_path / "db")!r}, rows=3000, dim=4, fragments=2)
        ray.init(address="local", num_cpus=1, include_dashboard=False,
                 _temp_dir={ray_dir!r})
        it = lance_ray.StreamingDataset(table, reader="ray", read_batch_size=256).iter_batches(64)
        next(it)
        print("read one batch", flush=True)
    """)
    try:
        done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                              timeout=240)
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "read one batch" in done.stdout
