"""How a view reads, as one value: the options every way of making a view shares."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..checks import positive_int
from ..read.scale import check_remote_args
from ..read.transform import TransformPolicy
from .compat import DEFAULT_PREFETCH_BATCHES, ReferenceOptions

# Reads are sized by bytes (read.requests.ReadSizing), at most this many rows: on narrow rows
# larger reads give the local reader markedly more rows/s than 16,384-row ones.
DEFAULT_READ_BATCH_SIZE = 65536
READERS = ("auto", "ray", "local")  # "auto": view.readers.choose_reader


@dataclass(frozen=True)
class ReadOptions:
    """What a view reads and how: its columns, transform policy, read size, prefetch depth,
    reader, Ray task options, and the reference's own reading arguments. Checked when made."""

    columns: list[str] | None = None
    transform: TransformPolicy | None = None
    read_batch_size: int = DEFAULT_READ_BATCH_SIZE
    prefetch_batches: int = DEFAULT_PREFETCH_BATCHES
    reader: str = "auto"
    ray_remote_args: dict[str, Any] | None = None
    reference: ReferenceOptions = field(default_factory=ReferenceOptions)
    read_bytes: int | None = None  # None: the reader's default (view.readers.read_sizing)
    prefetch_bytes: int | None = None  # None: read.requests.PREFETCH_BUDGET_BYTES

    def __post_init__(self) -> None:
        positive_int("read_batch_size", self.read_batch_size)
        positive_int("prefetch_batches", self.prefetch_batches)
        if self.reader not in READERS:
            raise ValueError(f"reader must be one of {READERS}, got {self.reader!r}")
        if self.ray_remote_args is not None and not isinstance(self.ray_remote_args, dict):
            raise TypeError("ray_remote_args must be a dict of Ray task options, got "
                            f"{type(self.ray_remote_args).__name__}")
        if self.ray_remote_args:
            check_remote_args(self.ray_remote_args)
