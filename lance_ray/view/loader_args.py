"""A loader's arguments as torch's ``DataLoader`` takes them: positionally too, in its order
(the reference's loader forwards them to ``DataLoader``), ``batch_size=None``, and
``pin_memory`` reported as given."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader

# DataLoader's parameters after ``batch_size``, in its order.
DATALOADER_ARGS = ("shuffle", "sampler", "batch_sampler", "num_workers", "collate_fn",
                   "pin_memory", "drop_last", "timeout", "worker_init_fn",
                   "multiprocessing_context", "generator")


def dataloader_arguments(init: Callable[..., None]) -> Callable[..., None]:
    """``init(self, dataset, batch_size, **kwargs)`` also called as ``DataLoader(dataset,
    batch_size, shuffle, sampler, ...)``: positional arguments are given their names."""
    @functools.wraps(init)
    def named(self: Any, dataset: Any = None, batch_size: Any = 1, *args: Any,
              **kwargs: Any) -> None:
        cls = type(self).__name__
        if len(args) > len(DATALOADER_ARGS):
            raise TypeError(f"{cls}() takes at most {len(DATALOADER_ARGS) + 2} positional "
                            f"arguments, as DataLoader does ({len(args) + 2} given)")
        for name, value in zip(DATALOADER_ARGS, args):
            if name in kwargs:
                raise TypeError(f"{cls}() got multiple values for argument {name!r}")
            kwargs[name] = value
        init(self, dataset, batch_size, **kwargs)
    return named


class EachSample:
    """torch's ``batch_size=None``: every sample alone, through ``collate_fn`` (default
    ``default_convert``), made by the loader as batches of one sample."""

    def __init__(self, collate_fn: Callable[[Any], Any] | None):
        self.collate_fn = collate_fn

    def __call__(self, items: list[Any]) -> Any:
        (item,) = items
        if self.collate_fn is None:
            from torch.utils.data import default_convert

            return default_convert(item)
        return self.collate_fn(item)


class PinsItself(DataLoader):
    """A loader that pins its batches itself (``placement``) and reports ``pin_memory`` and
    ``pin_memory_device`` as given, as torch's ``DataLoader`` does; torch's iterator, which
    would pin them again (and warn again without CUDA), sees ``pin_memory=False``."""

    def _report_pinning(self, pin_memory: Any, pin_memory_device: Any) -> None:
        self.__dict__.update(pin_memory=pin_memory, pin_memory_device=pin_memory_device)

    def _get_iterator(self) -> Any:
        shown = self.__dict__["pin_memory"]
        self.__dict__["pin_memory"] = False
        try:
            return super()._get_iterator()
        finally:
            self.__dict__["pin_memory"] = shown
