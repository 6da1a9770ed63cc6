"""How many reads run at once: sized from the cores this process may use, bounded by the
bytes a reader may hold. One rule for every reader that runs takes on threads or tasks."""

from __future__ import annotations

import os

# Lance's random takes of 4 KB rows on a 16-core machine's disk (4096 sorted ids a call)
# gained up to 8 concurrent streams and lost a little at 16: past that, more streams only
# hold more bytes.
MOST_TAKE_STREAMS = 16
# Two takes of clumped rows beat one even on 2 cores: never fewer, however few cores.
FEWEST_TAKE_STREAMS = 2


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity, not the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def take_streams(cores: int, read_bytes: int | None, budget_bytes: int | None) -> int:
    """Reads to run at once: one per core (a take waits on the disk, then decodes and
    converts on its own core), at least ``FEWEST_TAKE_STREAMS`` and at most
    ``MOST_TAKE_STREAMS``, and no more than ``budget_bytes`` holds reads of ``read_bytes``
    (a read beyond that would only wait for room). Unknown sizes bound nothing."""
    streams = max(FEWEST_TAKE_STREAMS, min(cores, MOST_TAKE_STREAMS))
    if read_bytes and budget_bytes:
        streams = min(streams, max(1, budget_bytes // read_bytes))
    return streams
