"""Keep a reading process's freed buffers for its next reads instead of giving them back to
the kernel after every read.

With glibc's defaults a buffer of a few MB (a read's rows, the batch made of them) is
mapped fresh for each read and released when freed, so every read pays the kernel for
zeroing its pages again: on wide rows that was most of a read's cost (docs/scaling.md,
``python -m jobs.bench.ray_cost``). Every process that reads calls
:func:`keep_freed_buffers` first: the trainer, DataLoader workers and the Ray reader's
tasks.

It sets two of glibc's ``mallopt`` parameters for the whole process: buffers under
``MMAP_THRESHOLD`` come from the heap, and up to ``TRIM_THRESHOLD`` of free heap is kept.
A process holds at most that much more memory than it would otherwise. Nothing is changed
where the C library is not glibc, where the user set ``MALLOC_MMAP_THRESHOLD_`` or
``MALLOC_TRIM_THRESHOLD_`` (their choice stands), or with ``LANCE_RAY_KEEP_FREED_BUFFERS=0``.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

logger = logging.getLogger(__name__)

# Above the largest buffer a read allocates (reads are taken in pieces of ``TAKE_BYTES``,
# whose decode allocates up to a few times that).
MMAP_THRESHOLD = 64 << 20
TRIM_THRESHOLD = 128 << 20
OPT_OUT = "LANCE_RAY_KEEP_FREED_BUFFERS"
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's malloc.h


def opted_out() -> bool:
    """Whether the user turned off keeping freed buffers (``LANCE_RAY_KEEP_FREED_BUFFERS=0``),
    here and in the consumer's pool of conversion buffers (``buffers``)."""
    return os.environ.get(OPT_OUT, "1") == "0"


@functools.cache
def keep_freed_buffers() -> bool:
    """Set this process's malloc to keep freed read buffers (once; see the module's doc).
    Returns whether it did."""
    if opted_out():
        return False
    if any(name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return False
        libc = ctypes.CDLL(None)
        done = (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1)
    except (AttributeError, OSError, ValueError):  # not glibc, or no confstr name
        return False
    if done:
        logger.debug("malloc keeps freed buffers under %d MiB, up to %d MiB free (pid %d; "
                     "%s=0 turns this off)", MMAP_THRESHOLD >> 20, TRIM_THRESHOLD >> 20,
                     os.getpid(), OPT_OUT)
    return done
