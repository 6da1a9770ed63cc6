"""States as plain JSON files and objects, written atomically and read without ever unpickling.

The I/O itself (a local path or a URI such as ``s3://bucket/run/state.json``, pyarrow
filesystems, one-upload atomic writes, bounded retries) lives in :mod:`lance_ray.storage`.
"""

from __future__ import annotations

import os
from typing import Any

import pyarrow.fs as pafs

from ..storage import StorageOptionsFactory, read_json, write_json_atomic
from .packed import check_state


def save_state(path: str | os.PathLike[str], state: dict, *,
               storage_options: StorageOptionsFactory | None = None) -> None:
    """Validate ``state`` and write it as JSON atomically (local path or URI)."""
    check_state(state)
    write_json_atomic(path, state, storage_options=storage_options)


def load_state(path: str | os.PathLike[str], *,
               storage_options: StorageOptionsFactory | None = None,
               filesystem: pafs.FileSystem | None = None) -> dict[str, Any]:
    """Read and validate a state written by :func:`save_state` (local path or URI, or a
    path inside ``filesystem``)."""
    state = read_json(path, storage_options=storage_options, filesystem=filesystem)
    check_state(state)
    return state
