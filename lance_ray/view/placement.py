"""Where ``iter_batches`` and ``StreamingDataLoader`` put batches: the ``device`` and
``pin_memory`` arguments checked (errors name the fix), and the device feed they choose."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from .core import ViewCore
from .device import (
    DEFAULT_SLOTS,
    Allocate,
    Copier,
    CudaCopier,
    FeedStats,
    Stager,
    one_ahead,
)
from .device import pageable as pageable_buffer
from .device import pinned as pinned_buffer

# torch's DataLoader says this when pin_memory=True finds no accelerator; so does lance_ray.
NO_ACCELERATOR = ("'pin_memory' argument is set as true but no accelerator is found, then "
                  "device pinned memory won't be used.")


@dataclass(frozen=True)
class Placement:
    """Batches copied to CUDA ``device`` (staged in pinned host buffers when ``pin``), or,
    without a device, delivered in pinned host memory."""

    device: torch.device | None
    pin: bool


def _cuda_available() -> bool:
    return torch.cuda.is_available()


def _bool_or_none(name: str, value: Any) -> None:
    if value is not None and not isinstance(value, bool):
        raise TypeError(f"{name} must be True, False or None, got {value!r}")


def _parse(device: Any, what: str,
           accepted: str = "None, 'cpu', 'cuda', 'cuda:N', N or a torch.device") -> torch.device:
    """``device`` as a ``torch.device`` of type CPU or CUDA (an int N is torch's ``cuda:N``);
    raises naming the values ``accepted``."""
    if isinstance(device, int) and not isinstance(device, bool):
        device = f"cuda:{device}"  # torch.device(N) would need an accelerator to name N's
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"{what} must be {accepted}, got {device!r} ({exc})") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{what}={device!r}: lance_ray places batches on 'cpu' or CUDA "
                         "devices only; pass device=None and move the batches yourself with "
                         f"tensor.to({str(dev)!r})")
    return dev


def _indexed(dev: torch.device, what: str) -> torch.device:
    """``dev`` with its index (the current device's when it has none), checked to exist."""
    index = torch.cuda.current_device() if dev.index is None else dev.index
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"{what}={str(dev)!r} but this process sees {count} CUDA device(s): "
                         f"pass an index below {count} (CUDA_VISIBLE_DEVICES limits them)")
    return torch.device("cuda", index)


# The user's call, for a warning: placement <- iter_batches or the loader's __init__ <- the
# wrapper that accepts numpy scalars (checks.numpy_scalars_accepted) <- the user; the
# loader's __init__ is also wrapped to take DataLoader's positional arguments.
USER_FRAME = 4
LOADER_USER_FRAME = USER_FRAME + 1


def placement(device: Any = None, pin_memory: bool | None = None, *,
              cuda: bool | None = None) -> Placement | None:
    """Where ``iter_batches(device=, pin_memory=)`` puts batches; None: in host memory, as
    without the arguments. ``cuda`` overrides CUDA's availability (tests)."""
    _bool_or_none("pin_memory", pin_memory)
    dev = None if device is None else _parse(device, "device")
    is_cpu = dev is not None and dev.type == "cpu"
    if dev is None or is_cpu:
        if not pin_memory:
            return None  # CUDA is not even probed: the probe can break a later fork
        if is_cpu:
            raise ValueError("pin_memory=True pins host memory for copies to a CUDA device, "
                             "but device='cpu' keeps batches in host memory: pass "
                             "device='cuda' (batches arrive on the GPU) or drop pin_memory")
        if not (_cuda_available() if cuda is None else cuda):
            warnings.warn(NO_ACCELERATOR, stacklevel=USER_FRAME)
            return None
        return Placement(None, True)
    if not (_cuda_available() if cuda is None else cuda):
        raise RuntimeError(f"device={device!r} but CUDA is not available (torch "
                           f"{torch.__version__}, torch.cuda.is_available() is False): pass "
                           "device=None or 'cpu' to keep batches in host memory, or run on a "
                           "machine with a GPU and a CUDA build of torch")
    return Placement(_indexed(dev, "device"), pin_memory is not False)


# torch 2.13's DataLoader says this when pin_memory_device is given with pin_memory, and
# ignores it; so does lance_ray.
PIN_DEVICE_IGNORED = ("pin_memory_device is deprecated, the current accelerator will be used "
                      "as the device,ignore pin_memory_device='{}'.")


def loader_placement(pin_memory: Any, pin_memory_device: Any, *,
                     cuda: bool | None = None) -> Placement | None:
    """``StreamingDataLoader(pin_memory=, pin_memory_device=)`` as torch's DataLoader means
    them: any true ``pin_memory`` pins batches in host memory, for copies to the current
    CUDA device (``pin_memory_device`` is deprecated there: a warning, and ignored); without
    CUDA a warning and ordinary memory."""
    if not pin_memory:
        return None  # CUDA is not even probed: the probe can break a later fork
    if pin_memory_device:
        warnings.warn(PIN_DEVICE_IGNORED.format(pin_memory_device), stacklevel=LOADER_USER_FRAME)
    if not (_cuda_available() if cuda is None else cuda):
        warnings.warn(NO_ACCELERATOR, stacklevel=LOADER_USER_FRAME)
        return None
    return Placement(None, True)


def stager_for(where: Placement, stats: FeedStats, *, allocate: Allocate | None = None,
               copier: Copier | None = None, slots: int = DEFAULT_SLOTS) -> Stager:
    """The stager for ``where`` (counting into ``stats``); ``allocate`` and ``copier``
    replace the CUDA ones (tests)."""
    if allocate is None:
        allocate = pinned_buffer if where.pin else pageable_buffer
    if copier is None and where.device is not None:
        copier = CudaCopier(where.device)
    return Stager(allocate, copier, slots, stats)


def placed_in_turn(batches: Iterator[Any], where: Placement) -> Iterator[Any]:
    """``batches`` placed ``where``, each as it is asked for, none ahead: for a source that
    counts a batch as made when it makes it (a mixture), so nothing may run ahead of it."""
    stager = stager_for(where, FeedStats())
    try:
        for batch in batches:
            yield stager.handover(stager.stage(batch))
    finally:
        close = getattr(batches, "close", None)
        if close is not None:
            close()


def placed(start: Callable[[], Iterator[Any]], where: Placement | None, view: ViewCore
           ) -> Iterator[Any]:
    """The batches of ``start()``, placed ``where`` (unchanged when None), a few batches ahead,
    each batch's progress changes applied when it is handed over (``view.holding``)."""
    if where is None:
        return start()
    return one_ahead(start(), view.holding, stager_for(where, view.device_stats))
