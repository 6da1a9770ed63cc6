"""A reading process keeps its freed buffers for its next reads (``read/malloc``): a buffer of
a read's size, freed and allocated again, reuses its pages instead of faulting them in from
the kernel again; the user's own malloc settings, or the opt-out, win. Each case runs in a
fresh process, since the setting is the process's.

What it is worth on reads is measured, not asserted: ``python -m jobs.bench.ray_cost``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = r"""
import json, resource
import numpy as np
from lance_ray.read.malloc import keep_freed_buffers

kept = keep_freed_buffers()
faults = []
for _ in range(6):
    # Larger than glibc's own threshold ever grows to (32 MB): mapped afresh each time
    # unless the process keeps freed buffers.
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    buffer = np.empty(48 << 20, dtype=np.uint8)
    buffer.fill(1)
    del buffer
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({"kept": kept, "faults": sum(faults[1:]) / 5}))
"""


def _run(**env: str) -> dict:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("MALLOC_") and k != "LANCE_RAY_KEEP_FREED_BUFFERS"}
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env={**clean, **env}, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not hasattr(os, "confstr") or not os.confstr("CS_GNU_LIBC_VERSION"),
                    reason="malloc is tuned on glibc only")
def test_a_reading_process_reuses_freed_buffers_and_a_user_setting_or_opt_out_wins():
    kept, handed_back = _run(), _run(LANCE_RAY_KEEP_FREED_BUFFERS="0")
    users = _run(MALLOC_TRIM_THRESHOLD_="131072")
    assert (kept["kept"], handed_back["kept"], users["kept"]) == (True, False, False)
    # Handed back, every allocation faults its pages in again (12,288 of 4 KB, fewer with
    # huge pages); kept, the second and later reuse the first one's.
    assert handed_back["faults"] >= 16, handed_back
    assert kept["faults"] < handed_back["faults"] / 10, (kept, handed_back)
