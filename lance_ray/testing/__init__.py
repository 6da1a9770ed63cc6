"""Helpers for trying lance_ray and testing code that uses it: synthetic tables
(:mod:`~lance_ray.testing.tables`), a local S3-compatible server
(:mod:`~lance_ray.testing.local_s3`, needs the ``dev`` extra's ``moto[server]``) and a rank
as a Ray actor (:mod:`~lance_ray.testing.ranks`). Nothing here is imported by ``lance_ray``
itself. See docs/object-storage.md for the local S3 server.
"""

from __future__ import annotations

from .tables import (
    EOS_ID,
    PAD_ID,
    blocks_per_epoch,
    create_table,
    synthetic_batch,
    token_batch,
    token_rows,
)

__all__ = ["EOS_ID", "PAD_ID", "blocks_per_epoch", "create_table", "synthetic_batch",
           "token_batch", "token_rows"]
