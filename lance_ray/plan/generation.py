"""A coordinator's generation, published on every node for its views to poll.

The coordinator counts its resizes: its *generation*. A view of an older generation is
stale (its world size is gone) and must stop before it hands out another batch, or its
trainer trains on samples the new topology will deliver again. Asking the coordinator
before every batch would cost an actor call per rank and batch (a thousand ranks would
swamp it), and the coalesced progress reports answer only every 100 batches or seconds.

So the generation lives in a 16-byte file in each node's shared memory (``/dev/shm``;
the temp directory where there is none): reading it is one ``pread``, no actor call. A view
writes it on its node when it attaches; ``resize`` raises it on every node that has views
(a zero-CPU task per node) before it returns. Values only grow, and each is stored with a
check word, so a read that races a write is ignored (the next one sees the value), never
taken for a resize.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import struct
import tempfile
from typing import Any

logger = logging.getLogger(__name__)

RECORD = struct.Struct("<QQ")
CHECK = 0x5A17_C0DE_5EED_F00D


def file_name(coordinator_id: str) -> str:
    """The generation file's name for the coordinator actor ``coordinator_id``."""
    return f"lance_ray-coordinator-{coordinator_id}.gen"


def node_path(name: str) -> str:
    """Where this node keeps generation file ``name``."""
    shm = "/dev/shm"
    base = shm if os.path.isdir(shm) and os.access(shm, os.W_OK) else tempfile.gettempdir()
    return os.path.join(base, name)


def _decode(raw: bytes) -> int | None:
    if len(raw) != RECORD.size:
        return None
    value, check = RECORD.unpack(raw)
    return value if value ^ CHECK == check else None


def publish(name: str, generation: int) -> None:
    """Raise this node's generation file ``name`` to at least ``generation``."""
    fd = os.open(node_path(name), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # writers only (views attaching, the coordinator)
        current = _decode(os.pread(fd, RECORD.size, 0))
        if current is None or current < generation:
            os.pwrite(fd, RECORD.pack(generation, generation ^ CHECK), 0)
    finally:
        os.close(fd)  # releases the lock


class GenerationWatch:
    """A view's poll of its coordinator's generation on this node."""

    def __init__(self, name: str, generation: int):
        self.name, self.generation = name, generation
        self._fd: int | None = None

    def newer(self) -> int | None:
        """The published generation if it is newer than the view's, else None (one
        ``pread``: cheap enough before every batch)."""
        if self._fd is None:
            try:
                self._fd = os.open(node_path(self.name), os.O_RDONLY)
            except OSError:
                return None  # not published here: the coalesced reports still tell
        seen = _decode(os.pread(self._fd, RECORD.size, 0))
        return seen if seen is not None and seen > self.generation else None

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"name": self.name, "generation": self.generation}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["name"], state["generation"])  # type: ignore[misc]


# Seconds ``resize`` waits for the nodes' files; a node slower than that (or gone) is
# logged, and its views learn of the resize from their next progress report instead.
PUBLISH_TIMEOUT_S = 10.0


def remove(name: str) -> None:
    """Delete this node's generation file ``name`` (its run is over)."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(node_path(name))


def publish_on_nodes(name: str, generation: int, nodes: set[str]) -> None:
    """Raise generation file ``name`` to ``generation`` on this node and on ``nodes`` (one
    zero-CPU task per other node), waiting for them."""
    on_nodes(publish, (name, generation), nodes,
             f"generation {generation} of {name} was not published on nodes %s: views there "
             "stop at their next progress report instead")


def remove_on_nodes(name: str, nodes: set[str]) -> None:
    """Delete generation file ``name`` on this node and on ``nodes``."""
    on_nodes(remove, (name,), nodes, f"{name} was left on nodes %s")


def on_nodes(fn: Any, args: tuple[Any, ...], nodes: set[str], failed_note: str) -> None:
    """``fn(*args)`` here and on each of ``nodes`` (one zero-CPU task per other node),
    waiting for them; the nodes where it failed are logged with ``failed_note``."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    fn(*args)
    here = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
    task = ray.remote(fn)
    replies = {task.options(num_cpus=0, max_retries=0, scheduling_strategy=(
        NodeAffinitySchedulingStrategy(node, soft=False))).remote(*args): node
        for node in sorted(nodes - {here})}
    if not replies:
        return
    done, late = ray.wait(list(replies), num_returns=len(replies), timeout=PUBLISH_TIMEOUT_S)
    failed = [replies[r] for r in late]
    for reply in done:
        try:
            ray.get(reply)
        except Exception:  # a node that died since its views attached
            failed.append(replies[reply])
    if failed:
        logger.warning(failed_note, failed)
