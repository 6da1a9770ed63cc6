"""The driver-side handle of a coordinator: create or find the actor, and call it."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import ray

from .. import storage
from ..checks import numpy_scalars_accepted
from ..coordinator.actor import CoordinatorActor
from ..coordinator.client import (
    DEFAULT_NAMESPACE,
    constructed,
    find_coordinator,
    wait_name_free,
)
from ..coordinator.run_file import drawn_seed, run_identity, same_run
from ..plan.pack_args import pack_options
from ..plan.remote import is_remote_table
from ..plan.resolve import resolve_plan
from ..plan.table import StorageOptionsFactory, release_lease, table_commit, take_lease
from ..state.mixture import MixtureRun
from ..state.reporting import ReportPolicy
from ..topology import splits_per_rank
from ..view.dataset import StreamingDataset
from ..view.mixture import MixtureDataset, Source
from .mix_handle import create_mixture, is_sources

logger = logging.getLogger(__name__)

_ACTOR_OPTIONS = {"num_cpus": 0, "max_restarts": -1, "max_task_retries": -1,
                  "max_concurrency": 4}


class Coordinator:
    """Driver-side handle of a coordinator actor."""

    created = False  # whether ``create`` made the actor (False: it found it alive)
    leased = False  # whether ``create`` made the tag that pins the run's table version

    def __init__(self, handle: Any, name: str, namespace: str,
                 sources: list[Coordinator] | None = None):
        self.handle, self.name, self.namespace = handle, name, namespace
        self._sources = sources  # a mixture's per-source coordinators; None: not asked yet

    @property
    def sources(self) -> list[Coordinator] | None:
        """A mixture coordinator's per-source coordinators, in order (None: one table)."""
        if self._sources is None:
            run = ray.get(self.handle.describe.remote())
            self._sources = [Coordinator.get(n, self.namespace) for n in run.sources] \
                if isinstance(run, MixtureRun) else []
        return self._sources or None

    @classmethod
    @numpy_scalars_accepted
    def create(
        cls,
        table: Any | Sequence[Source],
        name: str,
        *,
        storage_path: str,
        world_size: int,
        num_splits: int | None = None,
        shuffle: bool = True,
        shuffle_seed: int | None = 0,
        epoch: int = 0,
        shuffle_clump_size: int | None = None,
        filter: str | None = None,
        table_version: int | None = None,
        storage_options: StorageOptionsFactory | None = None,
        namespace: str = DEFAULT_NAMESPACE,
        detached: bool = False,
        lease_version: bool = True,
        plan: str = "lancedb",
        storage_retry: storage.RetryPolicy | None = None,
        report_policy: ReportPolicy | None = None,
        columns: list[str] | None = None,
        pack_sequences: int | None = None,
        eos_id: int | None = None,
        pad_id: int | None = None,
        blocks_per_epoch: int | str | None = None,
        stop: str | None = None,
    ) -> Coordinator:
        """Create the coordinator ``name`` (or attach to the live one of that name).

        Call this from the job driver (or pass ``detached=True`` so it outlives the job),
        never from a train worker: a non-detached actor dies with its creator.
        ``storage_path`` (a shared path or an ``s3://``/``gs://``/``az://`` URI) must be
        reachable from every node; sealed progress is kept there (``storage_retry``: how long
        writes retry while the store is down before failing).
        Keep the returned handle alive while the run needs the actor: a non-detached actor
        is stopped when its last handle goes away. With ``lease_version`` the pinned table
        version is tagged so that version cleanup cannot remove it while the run needs it;
        :meth:`release_version` drops the tag when the run is over. ``plan`` is the plan
        mode, as in ``StreamingDataset`` (``"index"`` past lancedb's builder limit).
        ``report_policy`` says how often views send their progress (default: every 100
        batches or 0.5 s, 2 s at 1,024 ranks, and at every checkpoint and epoch end); the
        status lags each rank by about that much.

        ``pack_sequences``, ``eos_id``, ``pad_id``, ``blocks_per_epoch`` and ``columns`` (the
        one token column) make it a packed run, with ``StreamingDataset``'s semantics and
        validation: every attached view packs those blocks, and the coordinator's states are
        the reference's packed format. They belong to the run, so views take them from here.

        ``table`` may be a list of :class:`~lance_ray.Source` (each with its weight, filter
        and version): a coordinator of that ``MixtureDataset`` run (``stop``, default
        ``"first_exhausted"``, as there), whose :meth:`view` is a ``MixtureDataset`` and
        whose states are mixture states (docs/mixing.md). Each source gets its own
        coordinator (``<name>.source<i>``, its plan and version lease). With
        ``pack_sequences``, ``eos_id``, ``pad_id`` and ``columns`` (the token column) the
        mixture's views pack blocks across sources, as a packed ``MixtureDataset``.
        """
        if is_sources(table):
            given = {k for k, v in {"filter": filter, "table_version": table_version,
                                    "blocks_per_epoch": blocks_per_epoch}.items()
                     if v is not None}
            if given or (columns is not None and pack_sequences is None):
                raise ValueError(
                    f"a mixture coordinator does not take {sorted(given) or ['columns']}: "
                    "give each Source its filter and table_version, and pass columns to "
                    "the views (a packed mixture: columns=[token column] with "
                    "pack_sequences; blocks_per_epoch is not implemented for a mixture)")
            pack = None if pack_sequences is None else {
                "pack_sequences": pack_sequences, "eos_id": eos_id, "pad_id": pad_id,
                "columns": columns}
            return create_mixture(
                cls, table, name, storage_path=storage_path, world_size=world_size,
                num_splits=num_splits, stop=stop or "first_exhausted",
                shuffle_seed=shuffle_seed, epoch=epoch, namespace=namespace,
                detached=detached, storage_options=storage_options,
                storage_retry=storage_retry, report_policy=report_policy,
                actor_options=_ACTOR_OPTIONS, pack=pack, shuffle=shuffle,
                shuffle_clump_size=shuffle_clump_size, plan=plan, lease_version=lease_version)
        if stop is not None:
            raise ValueError("stop is a mixture's argument: pass a list of lance_ray.Source "
                             "to create a mixture coordinator")
        if is_remote_table(table):
            raise ValueError(
                "the coordinator needs a Lance dataset (a local or object-store table), not a "
                "remote LanceDB table: read it with StreamingDataset(table, "
                "connection_factory=...) on every rank instead"
            )
        if not detached and ray.get_runtime_context().get_actor_id() is not None:
            raise RuntimeError(
                "create the coordinator in the job driver (or with detached=True), not inside "
                "an actor or train worker: it would die with that worker"
            )
        num_splits = world_size if num_splits is None else num_splits
        splits_per_rank(num_splits, world_size)
        storage.resolve(storage_path, storage_options)  # an unknown scheme fails here
        resolved = resolve_plan(table, num_splits=num_splits, shuffle=shuffle,
                                shuffle_seed=shuffle_seed, epoch=epoch,
                                shuffle_clump_size=shuffle_clump_size, filter=filter, plan=plan,
                                table_version=table_version, storage_options=storage_options)
        ref, spec, rows = resolved.table, resolved.spec, resolved.rows
        packing = pack_options(ref, columns, None, num_splits, pack_sequences, eos_id, pad_id,
                               blocks_per_epoch)
        if packing is None and columns is not None:
            raise ValueError("Coordinator.create takes columns only with pack_sequences (the "
                             "token column); pass columns to each view instead")
        path = storage.absolute(storage_path)
        asked = run_identity(ref, spec, packing, table_commit(ref))
        live = _live_actor(name, namespace)
        if live is not None:  # a restarted driver attaches to its run's live coordinator
            try:
                identity = ray.get(live.identity.remote())
            except ray.exceptions.RayActorError:  # dead (a refused create): its name frees
                ray.kill(live, no_restart=True)
                wait_name_free(name, namespace)
            else:
                _check_same_run(name, identity, asked)
                return cls(live, name, namespace)
        leased = lease_version and take_lease(ref, name)
        options = {**_ACTOR_OPTIONS, "name": name, "namespace": namespace,
                   "get_if_exists": True, "lifetime": "detached" if detached else None}
        try:
            handle: Any = ray.remote(CoordinatorActor).options(**options).remote(
                name, ref, asdict(spec), rows, world_size, path, storage_retry,
                asdict(report_policy or ReportPolicy()),
                None if packing is None else asdict(packing))
            # Surfaces construction errors here; another driver may have made it meanwhile.
            _check_same_run(name, constructed(handle, handle.identity.remote(), name, namespace),
                            asked)
        except BaseException:
            if leased:  # a failed create leaves no tag that would refuse the next one
                with contextlib.suppress(Exception):
                    release_lease(ref, name)
            raise
        coordinator = cls(handle, name, namespace)
        coordinator.created, coordinator.leased = True, bool(leased)
        return coordinator

    @classmethod
    def get(cls, name: str, namespace: str = DEFAULT_NAMESPACE) -> Coordinator:
        """Find the live coordinator ``name`` in ``namespace``."""
        return cls(find_coordinator(name, namespace), name, namespace)

    @numpy_scalars_accepted
    def view(self, rank: int, world_size: int, **kwargs: Any) -> Any:
        """A ``StreamingDataset`` for ``(rank, world_size)`` attached to this coordinator (a
        ``MixtureDataset`` for a mixture's)."""
        if self.sources:
            return MixtureDataset.from_coordinator(self.name, rank=rank, world_size=world_size,
                                                   namespace=self.namespace, **kwargs)
        return StreamingDataset.from_coordinator(self.name, rank=rank, world_size=world_size,
                                                 namespace=self.namespace, **kwargs)

    def state_dict(self, step: int | None = None) -> dict[str, Any]:
        return ray.get(self.handle.state_dict.remote(step))

    @numpy_scalars_accepted
    def load_state_dict(self, state: dict[str, Any]) -> None:
        ray.get(self.handle.load_state_dict.remote(state))

    def initial_state(self) -> dict[str, Any]:
        """The state of a run that starts from scratch (zero progress, creation epoch)."""
        return ray.get(self.handle.initial_state.remote())

    @numpy_scalars_accepted
    def resize(self, world_size: int) -> dict[str, Any]:
        """Redistribute the splits over ``world_size`` ranks from the latest sealed step."""
        return ray.get(self.handle.resize.remote(world_size))

    @numpy_scalars_accepted
    def set_epoch(self, epoch: int) -> None:
        ray.get(self.handle.set_epoch.remote(epoch))

    def status(self) -> dict[str, Any]:
        return ray.get(self.handle.status.remote())

    def release_version(self) -> None:
        """Drop the tag that pins the run's table version (when the run is over)."""
        if self.sources:
            for source in self.sources:
                source.release_version()
            return
        table, _ = ray.get(self.handle.describe.remote())
        release_lease(table, self.name)

    def kill(self) -> None:
        """Stop the actor for good, first writing its sealed progress (which stays) and
        deleting the small files through which its views hear of resizes."""
        try:
            ray.get(self.handle.retire.remote(), timeout=10)
        except Exception:  # already dead or unreachable: what it wrote before stays
            logger.warning("coordinator %s did not write its progress before being stopped",
                           self.name, exc_info=True)
        sources = self._sources
        if sources is None:  # found by name: ask whether it is a mixture while it answers
            with contextlib.suppress(Exception):
                sources = self.sources
        ray.kill(self.handle, no_restart=True)
        for source in sources or []:  # a mixture's: after the mixture's own write
            source.kill()


def _live_actor(name: str, namespace: str) -> Any | None:
    """The live actor ``name`` in ``namespace``, if there is one."""
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        return None


def _check_same_run(name: str, live: dict[str, Any], asked: dict[str, Any]) -> None:
    """Refuse to attach ``create`` to a live coordinator of another run."""
    differ = same_run(live, asked)
    if differ:
        shown = "; ".join(f"{k}: live {a!r}, asked {b!r}" for k, (a, b) in sorted(differ.items()))
        resume = (f"; to resume it, pass table_version={live['table_version']}"
                  if set(differ) == {"table_version"} else "")
        if (seed := drawn_seed(differ)) is not None:  # shuffle_seed=None draws anew
            resume = f"; to resume it, pass shuffle_seed={seed}"
        raise ValueError(
            f"a live coordinator named {name!r} runs another run ({shown[:600]}): use another "
            f"name, or end that run first (Coordinator.get(name).kill()){resume}")
