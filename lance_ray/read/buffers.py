"""Large conversion outputs in recycled memory.

The consumer converts each read into tensors with one copy (``convert``), into a new array
of the read's size. The conversion runs on a pool thread, whose malloc heaps are at most
64 MiB: an array that large is mapped fresh and unmapped when freed, and arrays of a few MiB
were faulted in again read after read too, so the kernel zeroed the pages of every read's
output again. On wide rows through the Ray reader that was most of the trainer's CPU
(``python -m jobs.bench.cores`` prints the trainer's kernel time per row).

:func:`empty` hands out arrays backed by buffers this module keeps: when the last array,
view or tensor that uses a buffer is gone, the buffer comes back here for the next read
(a buffer is never handed out twice while anything still uses it; that is what the lease's
finalizer tracks). Free buffers are kept up to the most the process had in use at once (a
pass's run-ahead, which it held anyway), at most ``KEEP_BYTES``; the oldest released go
first. A request that no free buffer fits lets the oldest free one go back to malloc, which
can reuse its memory, so sizes the reads no longer ask for (a new task shape) do not stay
beside the new ones. Smaller outputs use ``numpy.empty``: malloc keeps and reuses those
itself (``malloc``). ``LANCE_RAY_KEEP_FREED_BUFFERS=0`` turns the pool off with malloc's
settings.
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import numpy as np

from .malloc import opted_out

# Outputs at least this large are pooled. A Ray reader spread over many task slots makes
# smaller tasks, whose outputs (tens of MiB, a fraction of a thread's 64 MiB heap) malloc
# kept faulting in afresh; with this floor the trainer's kernel time per row fell to a
# fraction and stayed there (docs/scaling.md). Below it malloc reuses outputs well itself.
POOLED_BYTES = 4 << 20
# Free buffers kept for the next reads: at most what the process's outputs held at once
# (a pass's run-ahead, which it held anyway), and at most this.
KEEP_BYTES = 1 << 30
# Buffers come in whole multiples of this (a huge page), so reads of nearly equal size share.
GRAIN = 2 << 20
# A free buffer serves a request up to this factor smaller than itself.
SLACK = 1.25


class _Lease:
    """What a pooled array views: numpy keeps it as the array's base, so it lives as long as
    any array, view or tensor made from the array, and its end returns the buffer."""

    __slots__ = ("__array_interface__", "buffer", "__weakref__")

    def __init__(self, buffer: np.ndarray, shape: tuple[int, ...], dtype: np.dtype[Any]):
        self.buffer = buffer
        self.__array_interface__ = {"shape": shape, "typestr": dtype.str, "version": 3,
                                    "data": (buffer.ctypes.data, False)}


class BufferPool:
    """Buffers for arrays of at least ``pooled_bytes``, in multiples of ``grain``. Free ones
    are kept up to the most that were in use at once (``peak``), at most ``keep_bytes``;
    the oldest released go first, and one goes whenever no free one fits a request."""

    def __init__(self, keep_bytes: int = KEEP_BYTES, pooled_bytes: int = POOLED_BYTES,
                 grain: int = GRAIN):
        self.keep_bytes, self.pooled_bytes, self.grain = keep_bytes, pooled_bytes, grain
        self._free: list[np.ndarray] = []  # oldest first
        self._lock = threading.Lock()
        self.made = 0  # buffers allocated (a steady stream of reads reuses them)
        self._in_use = 0  # bytes of buffers handed out and not back yet
        self.peak = 0  # the most bytes in use at once

    def empty(self, shape: int | Sequence[int], dtype: Any) -> np.ndarray:
        """A new uninitialised array of ``shape`` and ``dtype``, in a recycled buffer when
        it is large."""
        dt = np.dtype(dtype)
        dims = (shape,) if isinstance(shape, int) else tuple(int(d) for d in shape)
        nbytes = int(np.prod(dims, dtype=np.int64)) * dt.itemsize
        if nbytes < self.pooled_bytes or dt.hasobject or dt.names is not None \
                or opted_out():
            return np.empty(dims, dt)
        buffer = self._take(nbytes)
        lease = _Lease(buffer, dims, dt)
        weakref.finalize(lease, self._give_back, buffer)
        return np.asarray(lease)

    def free_bytes(self) -> int:
        """Bytes of free buffers held now."""
        with self._lock:
            return sum(b.nbytes for b in self._free)

    def _take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            best = None  # the smallest free buffer that fits
            for i, b in enumerate(self._free):
                if nbytes <= b.nbytes <= nbytes * SLACK + self.grain and (
                        best is None or b.nbytes < self._free[best].nbytes):
                    best = i
            buffer = self._free.pop(best) if best is not None else None
            if buffer is None:
                self.made += 1
                size = -(-nbytes // self.grain) * self.grain
                if self._free:
                    # No free buffer fits: give the oldest back to malloc, which can reuse
                    # its memory, rather than keep sizes the reads no longer ask for.
                    self._free.pop(0)
            else:
                size = buffer.nbytes
            self._in_use += size
            self.peak = max(self.peak, self._in_use)
        return np.empty(size, np.uint8) if buffer is None else buffer

    def _give_back(self, buffer: np.ndarray) -> None:
        with self._lock:
            self._in_use -= buffer.nbytes
            self._free.append(buffer)
            held = sum(b.nbytes for b in self._free)
            while self._free and held > min(self.keep_bytes, self.peak):
                held -= self._free.pop(0).nbytes

    def _after_fork(self) -> None:
        # A forked child (a DataLoader worker) starts with no free buffers and a free lock:
        # another thread may have held it at the fork.
        self._free, self._lock = [], threading.Lock()
        self._in_use = self.peak = 0  # the parent's buffers are not the child's to return


POOL = BufferPool()
os.register_at_fork(after_in_child=POOL._after_fork)


def empty(shape: int | Sequence[int], dtype: Any) -> np.ndarray:
    """``numpy.empty``, from the process's pool of recycled buffers when large."""
    return POOL.empty(shape, dtype)


def concatenate(arrays: Sequence[np.ndarray]) -> np.ndarray:
    """``numpy.concatenate`` of arrays along their first axis, into :func:`empty`."""
    first = arrays[0]
    out = empty((sum(len(a) for a in arrays), *first.shape[1:]),
                np.result_type(*arrays))
    return np.concatenate(arrays, out=out)


def take(values: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """``values[rows]`` (rows along the first axis), into :func:`empty`."""
    out = empty((len(rows), *values.shape[1:]), values.dtype)
    return np.take(values, rows, axis=0, out=out)
