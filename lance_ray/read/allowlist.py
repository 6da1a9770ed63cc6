"""Row-address allowlists for Lance scans, encoded with numpy.

``row_addr_allowlist`` takes Lance's serialized row-id tree map: a ``u32`` count of
fragments, then for each, ascending, its ``u32`` id, the ``u32`` byte length of its bitmap
and the bitmap in the portable Roaring format (no run containers: a ``u32`` cookie 12346 and
container count, each container's ``u16`` key and cardinality - 1, the ``u32`` offsets of the
containers, then each container: sorted ``u16`` values up to 4,096 of them, else 8 KB of
bits). pylance builds it from a Python list of ints (``serialize_row_addrs``), whose cost
is a sizeable fraction of the read itself; numpy does it several times faster.

The format is pylance's own, so the first encoding in each process is compared byte for
byte with ``serialize_row_addrs``; if a pylance release changes it, every read falls back to
pylance's encoder (logged once) and stays correct.
"""

from __future__ import annotations

import functools
import logging
import struct

import numpy as np

logger = logging.getLogger(__name__)

NO_RUN_COOKIE = 12346
ARRAY_MAX = 4096  # a Roaring container holds at most this many values as an array
LOW = np.uint64(0xFFFFFFFF)


def _bitmap(low: np.ndarray) -> list[bytes]:
    """One fragment's offsets (ascending ``uint32``) as a portable Roaring bitmap."""
    keys = (low >> 16).astype(np.uint16)
    cuts = np.flatnonzero(keys[1:] != keys[:-1]) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [len(low)]))
    cards = ends - starts
    header = np.empty(2 * len(starts), "<u2")
    header[0::2], header[1::2] = keys[starts], cards - 1
    sizes = np.where(cards <= ARRAY_MAX, 2 * cards, 8192)
    first = 8 + 8 * len(starts)  # cookie and count, then a key/cardinality and an offset each
    offsets = first + np.concatenate(([0], np.cumsum(sizes)[:-1]))
    out = [struct.pack("<II", NO_RUN_COOKIE, len(starts)), header.tobytes(),
           offsets.astype("<u4").tobytes()]
    values = (low & 0xFFFF).astype("<u2")
    for lo, hi in zip(starts.tolist(), ends.tolist()):
        if hi - lo <= ARRAY_MAX:
            out.append(values[lo:hi].tobytes())
        else:
            bits = np.zeros(1 << 16, bool)
            bits[values[lo:hi]] = True
            out.append(np.packbits(bits, bitorder="little").tobytes())
    return out


def encode(ids: np.ndarray) -> bytes:
    """The allowlist of ``ids``: strictly ascending ``uint64`` row addresses."""
    fragments = (ids >> np.uint64(32)).astype(np.uint32)
    cuts = np.flatnonzero(fragments[1:] != fragments[:-1]) + 1
    out = [struct.pack("<I", len(cuts) + 1 if len(ids) else 0)]
    for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(ids)] if len(ids) else []):
        bitmap = _bitmap((ids[lo:hi] & LOW).astype(np.uint32))
        out += [struct.pack("<II", int(fragments[lo]), sum(map(len, bitmap))), *bitmap]
    return b"".join(out)


# Offsets that make the check meet both container kinds and several fragments.
_PROBE = np.concatenate([np.arange(5, dtype=np.uint64),
                         (2 << 32) + np.arange(0, 140_000, 3).astype(np.uint64),
                         np.array([(7 << 32) + 70_000], np.uint64)])


@functools.cache
def _matches_pylance() -> bool:
    from lance.dataset import serialize_row_addrs

    same = encode(_PROBE) == serialize_row_addrs(_PROBE.tolist())
    if not same:
        logger.warning("this pylance encodes row-address allowlists differently from "
                       "lance_ray's encoder; using pylance's (slower) serialize_row_addrs")
    return same


def allowlist(ids: np.ndarray) -> bytes:
    """``row_addr_allowlist`` for the strictly ascending ``uint64`` row addresses ``ids``."""
    if _matches_pylance():
        return encode(ids)
    from lance.dataset import serialize_row_addrs

    return serialize_row_addrs(ids.tolist())
