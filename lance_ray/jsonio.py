"""Plain JSON files and objects, written atomically and read without ever unpickling.

The names lance_ray has always used; the I/O itself (a local path or a URI such as
``s3://bucket/run/state.json``, pyarrow filesystems, one-upload atomic writes, bounded
retries) lives in :mod:`lance_ray.storage`.
"""

from __future__ import annotations

from .storage import read_json, write_json_atomic

__all__ = ["read_json", "write_json_atomic"]
