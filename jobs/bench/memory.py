"""Resident memory from /proc: one process's current and peak RSS, a process tree's sum.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable


def current_rss_mb(pid: int | str = "self") -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, IndexError, ValueError):
        return 0.0


def peak_rss_mb(pid: int | str = "self") -> float:
    """VmHWM: the process's own peak RSS since its exec.

    Unlike ``ru_maxrss``, which Linux carries over ``execve`` from the parent (so a child
    started by a large parent reports at least the parent's size), VmHWM belongs to the
    process's own address space.
    """
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except (OSError, IndexError, ValueError):
        pass
    return 0.0


def descendants(root: int) -> list[int]:
    """Pids of all processes below ``root`` (from /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    out, stack = [], list(children.get(root, []))
    while stack:
        pid = stack.pop()
        out.append(pid)
        stack.extend(children.get(pid, []))
    return out


def tree_rss_mb(root: int, *, include_root: bool = True) -> float:
    """Sum of the current RSS of ``root``'s descendants (and of ``root``)."""
    pids = descendants(root) + ([root] if include_root else [])
    return sum(current_rss_mb(pid) for pid in pids)


class TreeSampler(threading.Thread):
    """Peak of ``measure()`` (an RSS sum from /proc), sampled every ``every_s``."""

    def __init__(self, measure: Callable[[], float], every_s: float = 1.0) -> None:
        super().__init__(daemon=True)
        self.measure, self.peak, self.every_s = measure, 0.0, every_s
        self._stop_event = threading.Event()

    def sample(self) -> None:
        self.peak = max(self.peak, self.measure())

    def run(self) -> None:
        while not self._stop_event.is_set():
            self.sample()
            self._stop_event.wait(self.every_s)

    def stop(self) -> float:
        self._stop_event.set()
        return self.peak

