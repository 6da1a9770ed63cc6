"""Batches delivered on a CUDA device, or in pinned host memory, staged one batch ahead.

The device path: a batch's CPU tensors are packed into one reused host buffer (pinned), copied
to the device with one ``non_blocking`` copy on a side stream, and an event is recorded after
the copy. When the batch is handed over, the consumer's current stream waits on that event
(the host never does) and the device memory is marked as used by that stream. The next batch
is staged, on a thread of its own, before the current one is handed over, so its copy
overlaps the consumer's step. A host buffer is reused only once the copy that read it is done.

The pinned-host path (``pin_memory=True`` without a device, torch's DataLoader meaning) hands
the host buffer itself to the consumer, who may start copies from it that this module cannot
see; so each batch gets a fresh buffer from torch's caching host allocator, which reuses a
block only after the copies recorded on it are done.

Only :class:`CudaCopier` and :func:`pinned` touch CUDA: the pool, the staging and the
lookahead take an allocator and a copier, so they run (and are tested) on a CPU-only machine
with stand-ins.
"""

from __future__ import annotations

from collections.abc import Callable, Generator, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

ALIGN = 256  # bytes between tensors packed into one buffer (CUDA kernels like aligned data)
DEFAULT_SLOTS = 3  # host buffers: the batch handed over, the next one's copy, one to fill
Allocate = Callable[[int], torch.Tensor]  # nbytes -> a 1-D uint8 host tensor


class Copier(Protocol):
    """Copies host bytes to the device without the host waiting."""

    def start(self, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Start copying ``host`` (1-D uint8); the destination and a fence for the copy."""

    def done(self, fence: Any) -> bool:
        """Whether the copy behind ``fence`` has finished (never waits)."""

    def wait(self, fence: Any) -> None:
        """Block this (staging) thread until the copy behind ``fence`` has finished."""

    def handover(self, out: torch.Tensor, fence: Any) -> None:
        """Order the consumer's use of ``out`` after the copy (on CUDA: its current stream
        waits on the event; the host does not)."""


def pinned(nbytes: int) -> torch.Tensor:
    """A page-locked host buffer (from torch's caching host allocator)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


def pageable(nbytes: int) -> torch.Tensor:
    """An ordinary host buffer (``pin_memory=False``)."""
    return torch.empty(nbytes, dtype=torch.uint8)


class CudaCopier:
    """Copies on a side stream of ``device``; the fence is a CUDA event recorded after it."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def start(self, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        with torch.cuda.stream(self.stream):
            out = torch.empty(host.shape, dtype=host.dtype, device=self.device)
            out.copy_(host, non_blocking=True)
            event = torch.cuda.Event()
            event.record(self.stream)
        return out, event

    def done(self, fence: Any) -> bool:
        return bool(fence.query())

    def wait(self, fence: Any) -> None:
        fence.synchronize()

    def handover(self, out: torch.Tensor, fence: Any) -> None:
        consumer = torch.cuda.current_stream(self.device)
        consumer.wait_event(fence)
        # Allocated on the side stream: without this, memory freed by the consumer could be
        # handed to the next copy while the consumer's kernels still read it.
        out.record_stream(consumer)


# ----------------------------------------------------------------------------- batch shapes
def leaves(batch: Any) -> list[torch.Tensor]:
    """The CPU tensors of a (nested dict/list/tuple) batch, in a fixed traversal order."""
    out: list[torch.Tensor] = []

    def visit(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            if x.device.type == "cpu":
                out.append(x)
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                visit(v)

    visit(batch)
    return out


def rebuild(batch: Any, new: Iterator[torch.Tensor]) -> Any:
    """``batch`` with its CPU tensors replaced, in :func:`leaves` order, by ``new``'s;
    everything else (strings, numbers, tensors already elsewhere) passes through."""
    if isinstance(batch, torch.Tensor):
        return next(new) if batch.device.type == "cpu" else batch
    if isinstance(batch, dict):
        return {k: rebuild(v, new) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(rebuild(v, new) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(rebuild(v, new) for v in batch)
    return batch


def layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Byte offsets of ``tensors`` packed into one buffer (each aligned), and its size."""
    offsets, end = [], 0
    for t in tensors:
        offsets.append(end)
        end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
    return offsets, end


def views(buffer: torch.Tensor, tensors: list[torch.Tensor], offsets: list[int]
          ) -> list[torch.Tensor]:
    """Tensors shaped and typed like ``tensors``, viewing ``buffer`` at ``offsets``."""
    return [buffer[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
            for t, o in zip(tensors, offsets)]


# ----------------------------------------------------------------------------- the pool
@dataclass(eq=False)
class Slot:
    """One reusable host buffer and the copy that last read it."""

    buffer: torch.Tensor | None = None
    fence: Any = None


@dataclass
class PoolStats:
    """What a pool did: buffers allocated (grown included) and waits for a copy to finish."""

    allocations: int = 0
    waits: int = 0


class HostPool:
    """At most ``slots`` host buffers, reused round-robin: a buffer is reused only once the
    copy that read it has finished (the staging thread waits for it when every buffer is
    still being read) and reallocated only when a batch outgrows it."""

    def __init__(self, allocate: Allocate, copier: Copier, slots: int = DEFAULT_SLOTS):
        if slots < 1:
            raise ValueError(f"a host pool needs at least one buffer, got slots={slots}")
        self.allocate, self.copier = allocate, copier
        self.slots = [Slot() for _ in range(slots)]
        self.next = 0
        self.stats = PoolStats()

    def acquire(self, nbytes: int) -> Slot:
        """A slot whose buffer holds at least ``nbytes`` and is read by no copy in flight."""
        n = len(self.slots)
        turns = [(self.next + k) % n for k in range(n)]
        index = next((i for i in turns if self._free(self.slots[i])), self.next)
        slot = self.slots[index]
        self.next = (index + 1) % n
        if slot.fence is not None and not self.copier.done(slot.fence):
            self.stats.waits += 1
            self.copier.wait(slot.fence)
        slot.fence = None
        if slot.buffer is None or slot.buffer.numel() < nbytes:
            # Headroom, so batches of varying size (ragged columns) rarely grow it again.
            slot.buffer = self.allocate(-(-(nbytes + nbytes // 8) // ALIGN) * ALIGN)
            self.stats.allocations += 1
        return slot

    def _free(self, slot: Slot) -> bool:
        return slot.fence is None or self.copier.done(slot.fence)


# ----------------------------------------------------------------------------- staging
@dataclass(eq=False)
class Staged:
    """One batch on its way: the batch with its tensors replaced, and the copy's fence."""

    batch: Any
    device_bytes: torch.Tensor | None = None
    fence: Any = None


@dataclass
class FeedStats:
    """Batches handed over, and those for which the consumer had to wait on their staging
    or copy (on CUDA: the copy's event had not completed when the batch was handed over)."""

    handed: int = 0
    waited: int = 0

    @property
    def waited_fraction(self) -> float:
        return self.waited / self.handed if self.handed else 0.0


@dataclass
class Stager:
    """Stages batches on one background thread: into a pool buffer and onto the device
    (``copier`` given), or into a fresh buffer from ``allocate`` (pinned host batches)."""

    allocate: Allocate
    copier: Copier | None = None
    slots: int = DEFAULT_SLOTS
    stats: FeedStats = field(default_factory=FeedStats)

    def __post_init__(self) -> None:
        self.pool = None if self.copier is None else HostPool(self.allocate, self.copier,
                                                              self.slots)
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="lance_ray_device")

    def submit(self, batch: Any) -> Future[Staged]:
        return self.thread.submit(self.stage, batch)

    def stage(self, batch: Any) -> Staged:
        tensors = leaves(batch)
        offsets, nbytes = layout(tensors)
        if self.pool is None:
            host = self.allocate(nbytes)
        else:
            slot = self.pool.acquire(nbytes)
            assert slot.buffer is not None
            host = slot.buffer
        for dst, src in zip(views(host, tensors, offsets), tensors):
            dst.copy_(src)
        if self.copier is None or self.pool is None:
            return Staged(rebuild(batch, iter(views(host, tensors, offsets))))
        out, fence = self.copier.start(host[:nbytes])
        slot.fence = fence
        return Staged(rebuild(batch, iter(views(out, tensors, offsets))), out, fence)

    def handover(self, staged: Future[Staged]) -> Any:
        """The staged batch, ready for the consumer (its stream ordered after the copy)."""
        waited = not staged.done()
        done = staged.result()
        if self.copier is not None and done.device_bytes is not None:
            waited = waited or not self.copier.done(done.fence)
            self.copier.handover(done.device_bytes, done.fence)
        self.stats.handed += 1
        self.stats.waited += int(waited)
        return done.batch

    def close(self) -> None:
        self.thread.shutdown(wait=True, cancel_futures=True)


# ----------------------------------------------------------------------------- lookahead
Held = Callable[[], AbstractContextManager[list[Callable[[], None]]]]
_END = object()


def one_ahead(batches: Iterator[Any], holding: Held, stager: Stager
              ) -> Generator[Any, None, None]:
    """``batches`` staged by ``stager``, the next one's staging started before the current
    one is handed over. ``holding()`` collects the progress changes the source makes while
    a batch is pulled; they are applied when that batch is handed over (a prefetched batch
    never counts). An error pulling the next batch is raised after the current one."""

    def pull() -> tuple[Any, list[Callable[[], None]], BaseException | None]:
        with holding() as changes:
            try:
                batch = next(batches)
            except StopIteration:
                return _END, changes, None
            except Exception as exc:  # noqa: BLE001 - raised after the batch before it
                return _END, changes, exc
        return stager.submit(batch), changes, None

    try:
        staged, changes, error = pull()
        while staged is not _END:
            following = pull()
            out = stager.handover(staged)
            for change in changes:
                change()
            yield out
            staged, changes, error = following
        for change in changes:  # the source's own end (its epoch is read to the end)
            change()
        if error is not None:
            raise error
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()
        stager.close()

