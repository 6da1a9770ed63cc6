"""The coordinator of a mixture: the merged progress of every rank of a ``MixtureDataset``.

Each source has its own :class:`~lance_ray.coordinator.actor.CoordinatorActor`, which builds
that source's plan once per pass and serves each view its splits; this actor holds what the
mixture adds: one consistent mixture state. Ranks send their whole mixture state at the
global steps they all send (:mod:`lance_ray.view.mix_attach`); a step is sealed once every
rank of the current world size sent it, and its state is ``merge_state_dicts`` of theirs,
the same merge as the checkpoint route's, so a sealed state loads into any
``MixtureDataset`` of the run, on any world size dividing ``num_splits``. Sealed states are
written atomically as JSON (at every seal: a mixture seals at most every ``every_batches``
steps), so a restarted actor loses none.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections import deque
from dataclasses import asdict
from typing import Any

from .. import storage
from ..checks import non_negative_int
from ..state.ledger import StaleReport
from ..state.merge import merge_state_dicts
from ..state.mixture import (
    MIX_KEY,
    PACK_KEY,
    MixtureRun,
    check_mixture_compatible,
    make_mixture_state,
    parse_mixture,
)
from ..state.reporting import ReportPolicy
from ..topology import Topology, splits_per_rank
from .actor import PERSIST_EVERY_S
from .incarnation import restarted_by_ray
from .throttle import Throttled

logger = logging.getLogger(__name__)

PERSIST_FORMAT = 1
PENDING_STEPS = 16  # steps a rank may send ahead of the slowest before older ones drop
HISTORY_STEPS = 64  # sealed states kept for state_dict(step=...)


def _rows(state: dict[str, Any]) -> int:
    """Samples the state's sources delivered in their current passes."""
    return sum(sum(s["samples_consumed_per_split"]) for s in state["sources"])


def _key(state: dict[str, Any]) -> tuple[int, int]:
    mix = state[MIX_KEY]
    return mix["epoch"], mix["global_step"]


class MixtureCoordinatorActor:
    """The actor body. Use :class:`~lance_ray.driver.handle.Coordinator` to create it
    (``Coordinator.create`` over a list of ``Source``)."""

    def __init__(self, name: str, run: MixtureRun, world_size: int, storage_path: str,
                 namespace: str, storage_options: Any = None,
                 storage_retry: storage.RetryPolicy | None = None,
                 report_policy: dict[str, Any] | None = None):
        import ray

        self._name, self._run = name, run
        self._policy = ReportPolicy(**(report_policy or {}))
        self._sources = [ray.get_actor(n, namespace=namespace) for n in run.sources]
        self._path = storage.join(storage_path, name, "mixture.json")
        self._io: dict[str, Any] = {"storage_options": storage_options, "retry": storage_retry}
        self._lock = threading.RLock()
        self._world_size, self._epoch, self._generation = world_size, run.epoch, 0
        self._sealed: dict[str, Any] | None = None
        self._history: dict[tuple[int, int], dict[str, Any]] = {}
        self._pending: dict[tuple[int, int], dict[int, dict[str, Any]]] = {}
        # rank -> (newest global step it sent, its samples in the phase then): the status
        self._reported: dict[int, tuple[int, int]] = {}
        self._seal_times: deque[tuple[float, int]] = deque(maxlen=64)  # (time, rows)
        self._recorded = self._durable = 0  # reports recorded / held by a durable write
        self._write = Throttled(lambda: self._persist(durable=False), PERSIST_EVERY_S,
                                self._lock)
        self._incarnation = uuid.uuid4().hex  # a new one at each (re)start of the actor
        self._recover()
        self._persist(durable=True)

    # ----------------------------------------------------------------- durability

    def _config(self) -> dict[str, Any]:
        """What a stored run must match to be this run's (its packing too: its states are
        of another format and its blocks hold other tokens). An unpacked run stores no
        ``pack``, as before packed mixtures existed, so such a store still recovers."""
        run = self._run
        return {"sources": list(run.sources), "epoch": run.epoch, "meta": run.meta,
                **({} if run.pack is None else {"pack": run.pack})}

    def _recover(self) -> None:
        if not storage.exists(self._path, **self._io):
            return
        saved = storage.read_json(self._path, **self._io)
        if saved.get("format_version") != PERSIST_FORMAT or saved.get("config") != self._config():
            raise ValueError(f"{self._path} holds coordinator {self._name!r} of another "
                             "mixture; use another coordinator name or storage_path")
        self._world_size, self._epoch = saved["world_size"], saved["epoch"]
        self._generation, self._sealed = saved["generation"], saved["sealed"]
        if restarted_by_ray():  # the same views report on: a view of another size is stale
            self._pending = {(epoch, step): {int(r): state for r, state in ranks.items()}
                             for (epoch, step), ranks in saved.get("pending", [])}
            self._reported = {int(r): (s, n) for r, (s, n) in saved.get("reported", {}).items()}
        # (A new job's views start from the sealed state: the dead job's pending states
        # would never seal, and would refuse the new views' other batch sizes.)
        logger.info("mixture coordinator %s recovered epoch %d, sealed step %s", self._name,
                    self._epoch, self._sealed and _key(self._sealed))

    def _persist(self, *, durable: bool) -> None:
        """Write the sealed state and the ranks' states of steps not sealed yet (a rank
        never sends an acknowledged report again); ``durable`` adds an fsync."""
        if durable:
            self._durable = self._recorded
        storage.write_json_atomic(self._path, {
            "format_version": PERSIST_FORMAT, "config": self._config(),
            "world_size": self._world_size, "epoch": self._epoch,
            "generation": self._generation, "sealed": self._sealed,
            "pending": [[list(key), {str(r): st for r, st in ranks.items()}]
                        for key, ranks in sorted(self._pending.items())],
            "reported": {str(r): list(sn) for r, sn in self._reported.items()}},
            fsync=durable, **self._io)

    def persist(self) -> None:
        """Write the sealed progress now, durably (before a planned stop)."""
        with self._lock:
            self._persist(durable=True)

    def retire(self) -> None:
        """The run is over (``Coordinator.kill``): write its progress durably (its sources
        keep their own generation files)."""
        self.persist()

    def persist_recorded(self) -> str:
        """Make every report recorded so far durable (a view's checkpoint); one write
        serves every view whose reports it holds. Returns this incarnation of the actor
        (another than the one that acknowledged a view's reports: they may be lost)."""
        held = self._recorded  # the caller's reports were recorded before it asked
        with self._lock:
            if self._durable < held:
                self._persist(durable=True)
        return self._incarnation

    # ----------------------------------------------------------------- the run

    def describe(self) -> MixtureRun:
        return self._run

    def report_policy(self) -> dict[str, Any]:
        return asdict(self._policy)

    def attach(self, topology: Topology) -> tuple[dict[str, Any] | None, int, str]:
        """Where a new view of ``topology`` starts: the latest sealed state of the current
        epoch (None: the epoch's start), the epoch, and this incarnation; a new world size
        resizes the run when no view of the current one has reported since the last resize
        or restore."""
        with self._lock:
            if topology.world_size != self._world_size:
                if self._reported:
                    raise ValueError(
                        f"views of world size {self._world_size} are live; a view of world "
                        f"size {topology.world_size} may start only after "
                        f"resize({topology.world_size}) or after restoring a checkpoint "
                        "(load_state_dict)")
                logger.info("mixture coordinator %s: views of world size %d arrived; "
                            "resizing from %d", self._name, topology.world_size,
                            self._world_size)
                self.resize(topology.world_size)
            if not 0 <= topology.rank < topology.world_size:
                raise ValueError(f"rank ({topology.rank}) must be in [0, "
                                 f"{topology.world_size})")
            sealed = self._sealed
            return (sealed if sealed is not None and _key(sealed)[0] >= self._epoch
                    else None), self._epoch, self._incarnation

    def report(self, state: dict[str, Any]) -> int | None:
        """Record a rank's mixture state; returns the global step it sealed, if any."""
        mix = parse_mixture(state)
        with self._lock:
            if mix["world_size"] != self._world_size:
                raise StaleReport(
                    f"a mixture state of world size {mix['world_size']}, but the run was "
                    f"resized to {self._world_size}; restart this view from the coordinator")
            key = _key(state)
            if self._sealed is not None and key <= _key(self._sealed) or key[0] < self._epoch:
                return None  # already sealed, or an epoch the others left
            rank = mix["rank"] or 0
            self._reported[rank] = (key[1], mix["step"] or 0)
            ranks = self._pending.setdefault(key, {})
            ranks[rank] = state
            self._recorded += 1
            if len(ranks) < self._world_size:
                for old in sorted(self._pending)[:-PENDING_STEPS]:
                    del self._pending[old]  # a rank that far behind is gone
                self._write.request()
                return None
            merged = merge_state_dicts([ranks[r] for r in range(self._world_size)])
            for older in [k for k in self._pending if k <= key]:
                del self._pending[older]
            self._seal(merged)
            return key[1]

    def _seal(self, state: dict[str, Any]) -> None:
        self._sealed = state
        self._seal_times.append((time.monotonic(), _rows(state)))
        self._history[_key(state)] = state
        for old in sorted(self._history)[:-HISTORY_STEPS]:
            del self._history[old]
        self._persist(durable=False)

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        """The merged state of the latest sealed step (or of ``step`` of the current
        epoch), made durable first; the run's initial state while none is sealed."""
        with self._lock:
            self._persist(durable=True)
            if step is not None:
                if (self._epoch, step) not in self._history:
                    have = sorted(s for e, s in self._history if e == self._epoch)
                    raise ValueError(f"step {step} of epoch {self._epoch} is not sealed or no "
                                     f"longer kept; sealed steps held: {have or 'none'}")
                return self._history[(self._epoch, step)]
            return self._sealed if self._sealed is not None else self.initial_state()

    def initial_state(self) -> dict[str, Any]:
        """Zero progress at the epoch the run was created for (loads on any world size)."""
        import ray

        run, n = self._run, len(self._sources)
        sources: list[dict[str, Any]] = ray.get([s.initial_state.remote()
                                                 for s in self._sources])
        ws = self._world_size
        # A packed run's ranks start with nothing carried (every rank's carry, so that the
        # state loads on any world size).
        packing = {} if run.pack is None else {PACK_KEY: {**run.pack, "world_size": ws,
                   "carries": {str(r): {"tokens": [], "starts": [], "sources": []}
                               for r in range(ws)}}}
        return make_mixture_state(run.meta, epoch=run.epoch, world_size=ws,
                                  rank=None, step=None, end=0, global_step=0,
                                  passes=[run.epoch] * n, whole=[False] * n, sources=sources,
                                  **packing)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make ``state`` (a merged checkpoint of this mixture) every view's start."""
        mix = parse_mixture(state)
        check_mixture_compatible(mix, self._run.meta)
        if (PACK_KEY in state) != (self._run.pack is not None):
            raise ValueError("this state is of a " + ("packed" if PACK_KEY in state else
                             "unpacked") + " mixture, the coordinator's run is not; create "
                             "the coordinator " + ("with" if PACK_KEY in state else
                                                   "without") + " pack_sequences")
        if mix["rank"] is not None:
            raise ValueError("the coordinator needs a merged state covering every rank; merge "
                             "the ranks' states with merge_state_dicts() first")
        with self._lock:
            self._reported.clear()  # the views before the restore are gone
            if state == self._sealed and mix["epoch"] == self._epoch:
                return  # every rank of a restarted group restores the same checkpoint
            self._sealed, self._epoch = state, mix["epoch"]
            # Steps sealed before the restore belong to abandoned progress: not handed out.
            self._history = {_key(state): state}
            self._pending.clear()
            self._persist(durable=True)

    def resize(self, world_size: int) -> dict[str, Any]:
        """Redistribute the run over ``world_size`` ranks from the latest sealed step: each
        source's coordinator resizes too, so the views of the old size stop at their next
        delivery."""
        import ray

        splits_per_rank(self._run.meta["num_splits"], world_size)
        with self._lock:
            ray.get([s.resize.remote(world_size) for s in self._sources])
            self._world_size = world_size
            self._generation += 1
            self._pending.clear()
            self._reported.clear()
            self._persist(durable=True)
            return self.state_dict()

    def set_epoch(self, epoch: int) -> None:
        """Views of this run start ``epoch`` from its beginning from now on."""
        non_negative_int("epoch", epoch)  # before anything changes
        with self._lock:
            if epoch < self._epoch:
                raise ValueError(f"cannot go back from mixture epoch {self._epoch} to {epoch}")
            if epoch > self._epoch:
                self._epoch = epoch
                self._pending = {k: v for k, v in self._pending.items() if k[0] >= epoch}
                self._reported.clear()
                self._persist(durable=True)

    def status(self) -> dict[str, Any]:
        with self._lock:
            sealed = self._sealed
            mix = sealed[MIX_KEY] if sealed is not None else None
            rate = 0.0
            if len(self._seal_times) >= 2:
                (t0, r0), (t1, r1) = self._seal_times[0], self._seal_times[-1]
                rate = max(0.0, (r1 - r0) / (t1 - t0)) if t1 > t0 else 0.0
            return {
                "name": self._name, "mixture": True, "epoch": self._epoch,
                "world_size": self._world_size, "num_splits": self._run.meta["num_splits"],
                "sealed_epoch": mix and mix["epoch"],
                "sealed_step": -1 if mix is None or mix["epoch"] < self._epoch
                else mix["global_step"],
                "sealed_rows": 0 if sealed is None else _rows(sealed), "epoch_rows": None,
                "rows_per_s": rate,
                "ranks": {r: {"step": s, "rows": n} for r, (s, n) in
                          sorted(self._reported.items())},
                "pending_steps": sorted(self._pending),
                "sources": list(self._run.sources), "generation": self._generation,
                "report_policy": asdict(self._policy), "pid": os.getpid(),
            }
