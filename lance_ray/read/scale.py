"""How a Ray reader's transformed pipeline sizes itself from the cluster.

Three things follow from the cluster rather than from fixed counts: how many read tasks may
run at once (the task *slots*: the CPUs, or the resources ``ray_remote_args`` ask for, that
the reads may use), how many rows each task takes (the pass spread over the slots in a few
waves, each task between a minimum that pays for Ray's fixed cost per task and a maximum,
at the transform's measured cost per row), and how many bytes of output may be in flight
(a few tasks' output per slot: one running, the rest waiting, within the object store's
share). The user's ``prefetch_bytes`` only caps that memory. While a pass runs,
``NodeWatch`` says when no node is left that can run its tasks. Pure functions, Ray at the
edge (``capacity``, ``nodes_short``).
"""

from __future__ import annotations

import logging
import math
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .requests import ChunkRequest

logger = logging.getLogger(__name__)

# Tasks per slot over a pass: a few waves, so that the last tasks end close together.
WAVES = 3
# A task's work, at the measured cost per row: at least MIN (a Ray task's fixed cost, tens of
# milliseconds of CPU, is then small next to it), at most MAX (checkpoint-sized steps, and
# memory for transforms whose output is large).
MIN_TASK_SECONDS = 0.25
MAX_TASK_SECONDS = 2.0
# Task outputs per slot the run-ahead holds: one running and the rest done, waiting for the
# consumer. Two left slots idle behind the driver's own latency in moving blocks (a block
# reached the consumer up to a second after its task ended on a loaded machine).
OUTPUTS_PER_SLOT = 4
# The share of the object store one pipeline's outputs may fill (Ray Data's own executor
# limit is half of it; the rest is other work's).
STORE_SHARE = 0.25


def consumer_outputs(prefetch: int) -> int:
    """Task outputs the consuming process itself may hold, on top of the run-ahead.

    Ray Data counts a block against its pipeline until every reference to it is gone, so
    the blocks the trainer's process holds take the budget like blocks not yet sent: Ray
    Data's window of ``prefetch`` blocks, as many being converted (``ahead``'s depth) and
    one pulled and waiting for room, the block being cut into batches, and the one the last
    batch handed over still views. Left out of the budget, they took all but one task's
    room on two slots: one task ran at a time, the other slot idle.
    """
    return 2 * prefetch + 3


@dataclass(frozen=True)
class Capacity:
    """What the reads may use: task ``slots`` (tasks that can run at once) and the
    ``store_bytes`` of object store the pipeline's outputs may fill."""

    slots: int
    store_bytes: int


@dataclass(frozen=True)
class TaskShape:
    """A transformed pass's tasks: ``rows`` each, and the run-ahead ``budget`` in bytes
    (``task_bytes`` of output each); ``short`` is the line to log when memory cannot hold
    one task's output per slot."""

    rows: int
    task_bytes: int
    budget: int
    short: str | None = None


# What Ray Data's read_datasource takes as its read tasks' options (Ray 2.60's named
# parameters): any other key would reach the datasource itself and fail as the pass starts.
READ_TASK_OPTIONS = ("num_cpus", "num_gpus", "memory", "resources", "label_selector",
                     "fallback_strategy", "max_calls", "accelerator_type", "runtime_env")


# How often a read task is retried: Ray Data takes these as its tasks' ``ray_remote_args``.
RETRY_OPTIONS = ("max_retries", "retry_exceptions")
# Ray Data retries a task whose worker died without end (by default): a row whose transform
# crashes its process (native code, sys.exit, out of memory) then hung the pass for ever.
# Ray's own default for a task is 3; -1 in ray_remote_args retries without end.
DEFAULT_MAX_RETRIES = 3


def check_remote_args(remote_args: Mapping[str, Any]) -> None:
    """Raise, naming ``ray_remote_args``, unless the read (and transform) tasks can take
    ``remote_args`` as their Ray options."""
    import ray

    other = sorted(set(remote_args) - set(READ_TASK_OPTIONS) - set(RETRY_OPTIONS))
    if other:
        raise ValueError(f"ray_remote_args cannot hold {other}: Ray Data's read tasks take "
                         f"only {list(READ_TASK_OPTIONS + RETRY_OPTIONS)} (place tasks with "
                         "resources or label_selector)")
    try:
        ray.remote(_no_task).options(**remote_args)  # Ray's own check of the values
    except (TypeError, ValueError) as e:
        raise ValueError(f"ray_remote_args={dict(remote_args)!r}: {e}") from None


def task_options(remote_args: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``remote_args`` as Ray Data takes them: its read's named options (placement), and the
    retry options (``DEFAULT_MAX_RETRIES`` unless given), which go in ``ray_remote_args``."""
    named = {k: v for k, v in remote_args.items() if k not in RETRY_OPTIONS}
    retries: dict[str, Any] = {"max_retries": DEFAULT_MAX_RETRIES}
    retries.update((k, remote_args[k]) for k in RETRY_OPTIONS if k in remote_args)
    if isinstance(retries.get("retry_exceptions"), tuple):  # Ray Data takes a list
        retries["retry_exceptions"] = list(retries["retry_exceptions"])
    return named, retries


def _no_task() -> None:
    """What ``check_remote_args`` hands Ray to check options against (never run)."""


def task_demand(remote_args: Mapping[str, Any] | None) -> dict[str, float]:
    """What one read task asks of a node: a CPU (or ``num_cpus``) and any ``resources``."""
    args = dict(remote_args or {})
    need = {"CPU": float(args.get("num_cpus", 1.0))}
    if args.get("num_gpus"):
        need["GPU"] = float(args["num_gpus"])
    need.update({k: float(v) for k, v in (args.get("resources") or {}).items()})
    return {k: v for k, v in need.items() if v > 0}


def slots_on(nodes: Sequence[Mapping[str, float]], need: Mapping[str, float]) -> int:
    """How many tasks asking ``need`` fit at once on ``nodes`` (each a node's total
    resources): per node, the fewest of its resources divided by the demand."""
    total = 0
    for node in nodes:
        fits = [math.floor(node.get(k, 0.0) / v + 1e-9) for k, v in need.items()]
        total += min(fits) if fits else int(node.get("CPU", 0))
    return total


def capacity(remote_args: Mapping[str, Any] | None) -> Capacity:
    """The connected cluster's :class:`Capacity` for tasks with ``remote_args``. While no
    node can run one such task it waits for one to join (an autoscaler may add it), saying
    so at once, and raises after ``LANCE_RAY_NODE_WAIT_S`` (default 300 s): Ray would
    otherwise hold the tasks, and the trainer, for ever."""
    import ray

    need = task_demand(remote_args)
    waited_since = None
    while True:
        nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
        usable = [n for n in nodes if slots_on([n], need)]
        if usable:
            break
        what = no_node(need, nodes, remote_args)
        wait_s = float(os.environ.get("LANCE_RAY_NODE_WAIT_S", "300"))
        if waited_since is None:
            waited_since = time.monotonic()
            logger.warning("%s: waiting up to %.0f s (LANCE_RAY_NODE_WAIT_S) for a node "
                           "that has it to join", what, wait_s)
        if time.monotonic() - waited_since >= wait_s:
            raise ValueError(f"{what}, and none joined in {wait_s:.0f} s: lower the request "
                             "in ray_remote_args, or add a node that has it")
        time.sleep(min(1.0, wait_s))
    store = sum(int(n.get("object_store_memory", 0)) for n in usable)
    return Capacity(max(1, slots_on(usable, need)), int(store * STORE_SHARE))


def no_node(need: Mapping[str, float], nodes: Sequence[Mapping[str, float]],
            remote_args: Mapping[str, Any] | None) -> str:
    """What to say when none of ``nodes`` can run a read task that needs ``need``."""
    have = sorted({tuple(sorted((k, n.get(k, 0.0)) for k in need)) for n in nodes})
    return (f"no node of the Ray cluster can run a read task asking for {dict(need)} "
            f"(ray_remote_args={dict(remote_args or {})!r}); its nodes have "
            f"{[dict(h) for h in have]}")


def nodes_short(remote_args: Mapping[str, Any] | None) -> str | None:
    """:func:`no_node`'s line if no live node can run a read task now, else None."""
    import ray

    need = task_demand(remote_args)
    nodes = [n["Resources"] for n in ray.nodes() if n.get("Alive")]
    return None if slots_on(nodes, need) else no_node(need, nodes, remote_args)


class NodeWatch:
    """While a pass's blocks stop arriving, checks every ``every_s`` whether any node can
    still run its tasks (``short()``: what to say if not): Ray holds tasks that no node can
    run without a word, so a pass whose only fitting node was lost hung silently. Logs one
    warning when that happens and one line when a node that fits joins."""

    def __init__(self, short: Callable[[], str | None], every_s: float = 10.0):
        self.short, self.every_s = short, every_s
        self._arrived = time.monotonic()
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="lance_ray_nodes", daemon=True).start()

    def arrived(self) -> None:
        """A block arrived: the pipeline is making progress."""
        self._arrived = time.monotonic()

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        warned = False
        while not self._stop.wait(self.every_s):
            if time.monotonic() - self._arrived < self.every_s:
                continue
            try:
                short = self.short()
            except Exception:  # noqa: BLE001 - a watch must never break the pass
                logger.debug("lance_ray: could not check the cluster's nodes", exc_info=True)
                continue
            if short is not None and not warned:
                logger.warning("lance_ray: the pass is waiting: %s, so its tasks wait until "
                               "one joins (the node that ran them was lost?)", short)
            elif short is None and warned:
                logger.warning("lance_ray: a node that can run the pass's tasks joined")
            warned = short is not None


def pipeline_memory(cap: Capacity, budget_cap: int | None) -> int:
    """The memory one pipeline's outputs may fill: the object store's share, within the
    user's ``prefetch_bytes`` (``budget_cap``) if set."""
    return cap.store_bytes if budget_cap is None else min(cap.store_bytes, budget_cap)


def task_shape(total_rows: int, cap: Capacity, *, seconds_per_row: float | None,
               in_row_bytes: int, out_row_bytes: int | None, read_bytes: int,
               most_rows: int, budget_cap: int | None, consumer: int) -> TaskShape:
    """Rows per task and the run-ahead budget for ``total_rows`` transformed rows.

    The pass is spread over ``cap.slots`` in ``WAVES``; with a measured ``seconds_per_row``
    a task holds ``MIN_TASK_SECONDS`` to ``MAX_TASK_SECONDS`` of work. A task reads and
    writes at most ``read_bytes`` (its one take), at most ``most_rows`` rows when its output
    size is unknown (``out_row_bytes`` None: items that travel as pickles), and two tasks'
    output per slot, with the ``consumer``'s own (``consumer_outputs``), fit in the memory
    (the object store's share, ``budget_cap`` if the user set one).
    """
    rows = max(1, math.ceil(total_rows / (cap.slots * WAVES)))
    if seconds_per_row:
        rows = min(max(rows, int(MIN_TASK_SECONDS / seconds_per_row)),
                   max(1, int(MAX_TASK_SECONDS / seconds_per_row)))
    memory = pipeline_memory(cap, budget_cap)
    out = out_row_bytes if out_row_bytes is not None else in_row_bytes
    rows = min(rows, read_bytes // max(in_row_bytes, out, 1))
    if out_row_bytes is None:
        rows = min(rows, most_rows)
    fitting = memory // max((2 * cap.slots + consumer) * out, 1)
    short = None
    if fitting < rows:
        wanted = rows
        rows = fitting
        if memory < cap.slots * wanted * out:
            short = (f"the memory for this pipeline's output ({memory >> 20} MiB: "
                     f"{'prefetch_bytes' if memory == budget_cap else 'the object store share'}"
                     f") cannot hold one task's output per CPU ({cap.slots} x "
                     f"{wanted * out >> 20} MiB); running tasks of {max(rows, 1)} rows, "
                     f"{max(1, memory // max(max(rows, 1) * out, 1))} at most in flight")
    rows = max(1, rows)
    task_bytes = rows * out
    if out_row_bytes is None:
        # Outputs of unknown size: the run-ahead bound counts what Ray Data measures of
        # them, within the memory.
        return TaskShape(rows, task_bytes, memory, short)
    return TaskShape(rows, task_bytes,
                     run_ahead_budget(task_bytes, cap, budget_cap, consumer), short)


def run_ahead_budget(task_bytes: int, cap: Capacity, budget_cap: int | None,
                     consumer: int) -> int:
    """The bytes a pipeline of tasks of ``task_bytes`` output each may hold in flight (the
    one rule for plain reads and transformed tasks alike): ``OUTPUTS_PER_SLOT`` outputs per
    slot and the ``consumer``'s own (``consumer_outputs``), within the object store's share
    and the user's ``prefetch_bytes`` (``budget_cap``) if set, but always one task."""
    wanted = (OUTPUTS_PER_SLOT * cap.slots + consumer) * task_bytes
    return max(task_bytes, min(pipeline_memory(cap, budget_cap), wanted))


def rechunked(requests: Sequence[ChunkRequest], rows: int) -> list[ChunkRequest]:
    """The rows of ``requests`` (one-span or many, no per-row splits) cut into reads of
    ``rows`` rows each (the last shorter), in the same order; each read's spans are the
    runs of consecutive stream positions it holds."""
    if not requests:
        return []
    ids = np.concatenate([r.row_ids for r in requests])
    seq = np.concatenate([np.arange(lo, hi, dtype=np.int64)
                          for r in requests for lo, hi in r.spans])
    out = []
    for lo in range(0, len(ids), max(1, rows)):
        part = seq[lo : lo + rows]
        cuts = (np.flatnonzero(np.diff(part) != 1) + 1).tolist()
        spans = tuple((int(part[a]), int(part[b - 1]) + 1)
                      for a, b in zip([0, *cuts], [*cuts, len(part)]))
        out.append(ChunkRequest(spans, ids[lo : lo + rows]))
    return out


def split_rows(requests: Sequence[ChunkRequest], rows: int
               ) -> tuple[list[ChunkRequest], list[ChunkRequest]]:
    """The first ``rows`` rows of ``requests`` and the rest, as reads of at most the
    original reads' rows (a read is cut where the boundary falls)."""
    head: list[ChunkRequest] = []
    for k, request in enumerate(requests):
        n = len(request.row_ids)
        if rows <= 0:
            return head, list(requests[k:])
        if n <= rows:
            head.append(request)
            rows -= n
            continue
        first, *others = rechunked([request], rows)
        return [*head, first], [*rechunked(others, n), *requests[k + 1:]]
    return head, []

