"""Batches delivered on a CUDA device, or in pinned host memory, staged ahead.

The device path: a batch's CPU tensors are packed into one reused host buffer (pinned), copied
to the device with one ``non_blocking`` copy on a side stream, and an event is recorded after
the copy. When the batch is handed over, the consumer's current stream waits on that event
(the host never does) and the device memory is marked as used by that stream. Batches are
pulled and staged on threads of their own, a few ahead of the consumer, so the next batch's
copy runs while the consumer works on the current one. A host buffer is reused only once the
copy that read it is done.

The pinned-host path (``pin_memory=True`` without a device, torch's DataLoader meaning) hands
the host buffer itself to the consumer, who may start copies from it that this module cannot
see; so each batch gets a fresh buffer from torch's caching host allocator, which reuses a
block only after the copies recorded on it are done.

Only :class:`CudaCopier` and :func:`pinned` touch CUDA: the pool, the staging and the
lookahead take an allocator and a copier, so they run (and are tested) on a CPU-only machine
with stand-ins.
"""

from __future__ import annotations

import copy
import itertools
import time
from collections.abc import (
    Callable,
    Generator,
    Iterator,
    Mapping,
    MutableMapping,
    MutableSequence,
    Sequence,
)
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from ..read.ahead import ahead

ALIGN = 256  # bytes between tensors packed into one buffer (CUDA kernels like aligned data)
DEFAULT_SLOTS = 4  # host buffers: the batches staged ahead (DEFAULT_DEPTH + 1), one to fill
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
        # A staging thread's current device is 0 whatever the consumer set: without the
        # device context, leaving the stream context would make device 0 current and so
        # create a CUDA context there (in every rank of a multi-GPU node).
        with torch.cuda.device(self.device), torch.cuda.stream(self.stream):
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
def walk(batch: Any, tensor: Callable[[torch.Tensor], Any], own: Callable[[Any], Any]) -> Any:
    """``batch`` rebuilt as torch's ``pin_memory`` walks it: each dense CPU tensor replaced
    by ``tensor(t)``; each object that pins itself (a ``pin_memory`` method, as a custom
    batch type or ``PackedSequence`` has, or a tensor that is not dense) by ``own(x)``;
    mappings, tuples and other sequences walked, keeping their type where they can (a
    ``BatchEncoding`` stays one); everything else passes through."""
    def visit(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            if x.device.type != "cpu":
                return x
            return tensor(x) if x.layout == torch.strided else own(x)
        if hasattr(x, "pin_memory"):
            return own(x)
        if isinstance(x, (str, bytes)):
            return x
        if isinstance(x, Mapping):
            items = {k: visit(v) for k, v in x.items()}
            if type(x) is dict:
                return items
            try:
                if isinstance(x, MutableMapping):
                    clone = copy.copy(x)
                    clone.update(items)
                    return clone
                return type(x)(items)  # type: ignore[call-arg]
            except TypeError:  # a mapping that cannot be copied or built from a dict
                return items
        if isinstance(x, tuple):
            if hasattr(x, "_fields"):  # a namedtuple
                return type(x)(*(visit(v) for v in x))
            return type(x)(visit(v) for v in x)
        if isinstance(x, Sequence):
            values = [visit(v) for v in x]
            if type(x) is list:
                return values
            try:
                if isinstance(x, MutableSequence):
                    seq = copy.copy(x)
                    for i, v in enumerate(values):
                        seq[i] = v
                    return seq
                return type(x)(values)  # type: ignore[call-arg]
            except TypeError:  # a sequence that cannot be copied or built (range)
                return values
        return x

    return visit(batch)


def leaves(batch: Any) -> list[torch.Tensor]:
    """The dense CPU tensors of a batch, in :func:`walk`'s order."""
    out: list[torch.Tensor] = []
    walk(batch, out.append, lambda x: x)
    return out


def rebuild(batch: Any, new: Iterator[torch.Tensor], own: Callable[[Any], Any]) -> Any:
    """``batch`` with its dense CPU tensors replaced, in :func:`leaves` order, by ``new``'s,
    and the objects that pin themselves by ``own(x)``."""
    return walk(batch, lambda _: next(new), own)


def pin_itself(x: Any) -> Any:
    """``x`` pinned by its own ``pin_memory()``, as torch's DataLoader pins it."""
    return x.pin_memory()


def not_placeable(x: Any) -> Any:
    """Refuse a batch object the device feed cannot copy (it has no dense tensor form)."""
    kind = type(x)
    what = f"a tensor of layout {x.layout}" if isinstance(x, torch.Tensor) else \
        f"a {kind.__module__}.{kind.__qualname__}"
    raise TypeError(
        f"device= copies the dense tensors of dicts, lists and tuples to the device, but this "
        f"batch holds {what}: return dense tensors from collate_fn, or pass device=None "
        "(pin_memory=True pins objects that have a pin_memory() method) and move it yourself")


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
    """Batches handed over; ``starved``: those the consumer asked for before they were
    read (it waited on the reads); ``waited``: the others whose copy had not finished when
    handed over (the copy, not the read, held them up: on CUDA the consumer's stream then
    waits on the copy's event)."""

    handed: int = 0
    waited: int = 0
    starved: int = 0

    @property
    def waited_fraction(self) -> float:
        return self.waited / self.handed if self.handed else 0.0

    @property
    def starved_fraction(self) -> float:
        return self.starved / self.handed if self.handed else 0.0


@dataclass
class Stager:
    """Stages batches (on one thread at a time): into a pool buffer and onto the device
    (``copier`` given), or into a fresh buffer from ``allocate`` (pinned host batches)."""

    allocate: Allocate
    copier: Copier | None = None
    slots: int = DEFAULT_SLOTS
    stats: FeedStats = field(default_factory=FeedStats)

    def __post_init__(self) -> None:
        self.pool = None if self.copier is None else HostPool(self.allocate, self.copier,
                                                              self.slots)

    def stage(self, batch: Any) -> Staged:
        tensors = leaves(batch)
        own = pin_itself if self.copier is None else not_placeable
        if not tensors:
            return Staged(rebuild(batch, iter(()), own))
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
            return Staged(rebuild(batch, iter(views(host, tensors, offsets)), own))
        out, fence = self.copier.start(host[:nbytes])
        slot.fence = fence
        return Staged(rebuild(batch, iter(views(out, tensors, offsets)), own), out, fence)

    def handover(self, staged: Staged, starved: bool = False) -> Any:
        """The staged batch, ready for the consumer (its stream ordered after the copy);
        ``starved``: the consumer asked for it before it was read."""
        self.stats.handed += 1
        self.stats.starved += int(starved)
        if self.copier is not None and staged.device_bytes is not None:
            pending = not self.copier.done(staged.fence)
            self.stats.waited += int(pending and not starved)
            self.copier.handover(staged.device_bytes, staged.fence)
        return staged.batch


# ----------------------------------------------------------------------------- lookahead
Held = Callable[[], AbstractContextManager[list[Callable[[], None]]]]
Changes = list[Callable[[], None]]
Pulled = tuple[Any, Changes, float]  # a batch (or _End), its progress changes, when read
DEFAULT_DEPTH = 2  # batches staged ahead of the one handed over


@dataclass(frozen=True)
class _End:
    """The source ended (``error``: by raising it)."""

    error: BaseException | None = None


def one_ahead(batches: Iterator[Any], holding: Held, stager: Stager,
              depth: int = DEFAULT_DEPTH) -> Generator[Any, None, None]:
    """``batches`` staged by ``stager``, up to ``depth`` batches ahead of the consumer: the
    next batch's copy starts before the current one is handed over, and staging keeps going
    while the consumer works (``batches`` is pulled on a producer thread after its first
    batch, which is pulled here, where the pass begins).

    ``holding()`` collects the progress changes the source makes while a batch is pulled;
    the consumer applies them when it hands that batch over (a prefetched batch never
    counts). An error from the source is raised after the batches before it.
    """

    def pulls() -> Iterator[Pulled]:
        while True:
            with holding() as changes:
                try:
                    batch = next(batches)
                except StopIteration:
                    batch = _End()
                except Exception as exc:  # noqa: BLE001 - raised after the batches before
                    batch = _End(exc)
            yield batch, changes, time.monotonic()
            if isinstance(batch, _End):
                return

    def stage(item: Pulled) -> Pulled:
        batch, changes, read_at = item
        return (batch if isinstance(batch, _End) else stager.stage(batch)), changes, read_at

    source = pulls()
    try:
        asked = time.monotonic()
        first = next(source)
        staged = ahead(stage, itertools.chain([first], source), depth, 1)
        try:
            while True:
                ready, changes, read_at = next(staged)  # the source always ends with _End
                out = None if isinstance(ready, _End) else stager.handover(
                    ready, starved=read_at > asked)
                for change in changes:
                    change()
                if isinstance(ready, _End):
                    if ready.error is not None:
                        raise ready.error
                    return
                yield out
                asked = time.monotonic()
        finally:
            staged.close()  # the producer has left ``batches`` when this returns
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()
