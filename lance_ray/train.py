"""Ray Train helpers: a rank's view, and checkpoints that carry the data state.

Inside ``train_loop_per_worker``::

    ds = lance_ray.train.get_dataset("my-run")          # rank/world size from Ray Train
    model = ...; model.load_state_dict(lance_ray.train.load_model_state() or model.state_dict())
    for batch in ds.iter_batches(64):
        ...
        if ds.global_step % 50 == 0:
            lance_ray.train.report({"loss": loss}, ds, model_state=model.state_dict())

Every rank writes its own data state into the checkpoint it reports (the report is a
barrier, so they are all taken at the same global step). On a restart, or a new run with the
same ``RunConfig(name, storage_path)``, :func:`get_dataset` merges those states and resumes
from *them*: the data state that belongs to the model checkpoint Ray Train restores, never
live progress past it (the restored model never trained on that).

Checkpoints are read straight from their own filesystem, never through
``Checkpoint.as_directory()``: for a remote checkpoint that downloads into one temporary
directory per node, shared by the node's workers and deleted when the last reader leaves, and
a worker that arrives while it is being deleted can be handed it empty. (Seen in CI on S3:
one of four ranks on one node found no data state, started the epoch over, and the other
ranks' DDP step waited for it forever.)
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.fs as pafs

from . import storage
from .checks import positive_int
from .coordinator.client import DEFAULT_NAMESPACE
from .driver.handle import Coordinator
from .state.jsonio import load_state, save_state
from .state.merge import merge_state_dicts
from .storage import StorageOptionsFactory
from .topology import valid_world_sizes
from .view.dataset import StreamingDataset
from .view.mixture import MixtureDataset

logger = logging.getLogger(__name__)

STATE_FILE = "lance_ray_state_rank{rank}.json"
MODEL_FILE = "model.pt"
_STATE_RE = re.compile(r"lance_ray_state_rank(\d+)\.json$")


def check_world_sizes(num_workers: int | tuple[int, int], num_splits: int,
                      global_batch: int | None = None) -> None:
    """Refuse, before training starts, world sizes that cannot read ``num_splits`` splits,
    and a ``global_batch`` (samples per global step, all ranks together) that a resize
    could not keep in lockstep.

    ``num_workers`` is a ``ScalingConfig.num_workers``: an int, or ``(min, max)`` for
    elastic training, where every size in the range must divide ``num_splits``.
    ``global_batch`` must be a multiple of ``num_splits``: a rank reads its splits in turn,
    so only then does every step take as many samples from each split, and a checkpoint
    leaves every split equally consumed. Otherwise, after a resize, ranks can have different
    numbers of batches left (DDP then waits for the ranks that finished) and the global
    steps differ from an uninterrupted run's.
    """
    lo, hi = (num_workers, num_workers) if isinstance(num_workers, int) else num_workers
    positive_int("num_workers", lo)
    positive_int("num_workers", hi)
    positive_int("num_splits", num_splits)
    positive_int("global_batch", global_batch, allow_none=True)
    if lo > hi:
        raise ValueError(f"num_workers={num_workers!r}: the minimum world size is above the "
                         "maximum; pass (min, max)")
    sizes = range(lo, hi + 1)
    every = math.lcm(*sizes)  # the num_splits that every world size divides are its multiples
    bad = [w for w in sizes if num_splits % w]
    if bad:
        raise ValueError(
            f"world sizes {bad} in num_workers={num_workers!r} do not divide num_splits "
            f"({num_splits}); valid world sizes are {valid_world_sizes(num_splits)}: "
            + ("narrow the range, or " if lo < hi else "")
            + f"use a num_splits that every world size divides (a multiple of {every}, "
            f"e.g. {every * max(1, -(-num_splits // every))})"
        )
    if global_batch is not None and global_batch % num_splits:
        fits = [d for d in range(every, global_batch + 1, every) if global_batch % d == 0]
        fix = (f"use a num_splits that divides global_batch and that every world size divides "
               f"(here: {fits[:6]}), or change global_batch" if fits else
               f"no num_splits both divides it and is a multiple of {every} (what every world "
               f"size divides): use a global_batch that is a multiple of num_splits, e.g. "
               f"{num_splits * max(1, global_batch // num_splits)}")
        raise ValueError(
            f"global_batch ({global_batch}) is not a multiple of num_splits ({num_splits}): "
            "each step would take more samples from some splits than from others, so after "
            "a resize the ranks could have different numbers of batches left and DDP would "
            f"wait on the ranks that finished. {fix[0].upper()}{fix[1:]}"
        )


def run_storage(storage_path: str | Path) -> dict[str, Any]:
    """``RunConfig`` keyword arguments for ``storage_path``, a shared local path or a URI.

    For ``s3://`` the filesystem is built from the environment (``AWS_ENDPOINT_URL`` for an
    S3-compatible store, credentials from ``AWS_*`` on every node) with bounded request
    timeouts; it holds no keys, so Ray may pickle it to every worker. Other URIs are left to
    Ray Train; a local path is made absolute.
    """
    uri = storage.absolute(storage_path)
    if uri.startswith("s3://"):
        return {"storage_path": uri.removeprefix("s3://"),
                "storage_filesystem": storage.s3_filesystem_from_env()}
    storage.resolve(uri)  # an unknown scheme fails here, not as a local directory
    return {"storage_path": uri}


def checkpoint_data_state(checkpoint_dir: str | Path, *,
                          storage_options: StorageOptionsFactory | None = None,
                          merge: Callable[[list[dict[str, Any]]], dict[str, Any]]
                          = merge_state_dicts,
                          filesystem: pafs.FileSystem | None = None) -> dict[str, Any] | None:
    """The merged data state stored in a checkpoint directory, a local path or a URI such as
    ``s3://bucket/runs/my-run/checkpoint_...``, or a path inside ``filesystem`` (None if it
    has none). ``merge`` combines the ranks' states (e.g.
    ``lancedb.streaming.StreamingDataset.merge_state_dicts`` for states a reference dataset
    reported)."""
    files = [p for p in storage.list_files(checkpoint_dir, storage_options=storage_options,
                                           filesystem=filesystem)
             if _STATE_RE.search(storage.basename(p))]
    if not files:
        return None
    return merge([load_state(p, storage_options=storage_options, filesystem=filesystem)
                  for p in files])


def restored_data_state(merge: Callable[[list[dict[str, Any]]], dict[str, Any]]
                        = merge_state_dicts) -> dict[str, Any] | None:
    """The merged data state of the checkpoint Ray Train is restoring in this worker, or
    None when it restores none. Call it inside ``train_loop_per_worker``.

    Raises ``ValueError`` for a checkpoint without a data state: resuming the model while
    the data starts over would train twice on what the model already saw.
    """
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    state = checkpoint_data_state(checkpoint.path, merge=merge,
                                  filesystem=checkpoint.filesystem)
    if state is None:
        raise ValueError(
            f"the checkpoint being restored ({checkpoint.path}) holds no lance_ray data state "
            f"({STATE_FILE.format(rank='<rank>')}); resuming from it would restart the data "
            "while the model resumes. Report checkpoints with lance_ray.train.report(metrics, "
            "dataset) on every rank")
    return state


def get_dataset(coordinator: str, *, namespace: str = DEFAULT_NAMESPACE,
                **view_kwargs: Any) -> StreamingDataset | MixtureDataset:
    """This worker's view, resumed from the data state of the checkpoint being restored (a
    ``MixtureDataset`` when the coordinator is a mixture's).

    With no checkpoint the run starts the coordinator's epoch from its beginning (a model
    that starts from scratch must see every sample). ``view_kwargs`` go to
    :meth:`StreamingDataset.from_coordinator` (``columns``, ``transform``, ``reader``, ...).
    Call it on every rank: the ranks check that they restore the same state (a rank that
    resumed elsewhere would otherwise leave the others waiting in a collective).
    """
    import ray.train

    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    coord = Coordinator.get(coordinator, namespace)
    state = restored_data_state()
    if state is None:
        state = coord.initial_state()
    else:
        logger.info("rank %d resumes from the checkpoint's data state at global step %s",
                    rank, _global_step(state))  # a mixture coordinator's state too
    _check_ranks_agree(state, rank)
    coord.load_state_dict(state)  # idempotent: every rank restores the same state
    ds = coord.view(rank, world_size, **view_kwargs)
    ds.load_state_dict(state)
    if isinstance(ds, StreamingDataset):  # a mixture's ranks step in lockstep by design
        _check_samples_left(ds, rank)
    return ds


def get_mixture(sources: list[Any], **mixture_kwargs: Any) -> MixtureDataset:
    """This worker's :class:`~lance_ray.MixtureDataset` over ``sources``, resumed from the
    (merged) data state of the checkpoint being restored, else from its epoch's start.

    ``mixture_kwargs`` go to ``MixtureDataset`` (``num_splits``, ``stop``, ``columns``...);
    rank and world size come from Ray Train. Checkpoint it with :func:`report` as a view.
    """
    import ray.train

    ctx = ray.train.get_context()
    rank, world_size = ctx.get_world_rank(), ctx.get_world_size()
    ds = MixtureDataset(sources, rank=rank, world_size=world_size, **mixture_kwargs)
    state = restored_data_state()
    if state is not None:
        _check_ranks_agree(state, rank)
        ds.load_state_dict(state)
        logger.info("rank %d resumes the mixture at global step %d", rank, ds.global_step)
    return ds


def _check_ranks_agree(state: dict[str, Any], rank: int) -> None:
    from ray.train.collective import broadcast_from_rank_zero

    mine = hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()
    ours = broadcast_from_rank_zero(mine if rank == 0 else None)
    if mine != ours:
        raise RuntimeError(
            f"rank {rank} restores a different data state (global step "
            f"{_global_step(state)}) than rank 0 does; the ranks of one group "
            "must resume from one checkpoint. Refusing to train: its steps would not line up")


def _check_samples_left(ds: StreamingDataset, rank: int) -> None:
    """Refuse to start ranks that have different numbers of samples left: they would run
    different numbers of steps, and the ranks that finish first would leave the others
    waiting in a DDP collective until it times out."""
    from ray.train.collective import broadcast_from_rank_zero

    mine = ds.samples_remaining
    ours = broadcast_from_rank_zero(mine if rank == 0 else None)
    if mine != ours:
        raise RuntimeError(
            f"rank {rank} has {mine} samples left after restoring and rank 0 has {ours}: the "
            "ranks would run different numbers of steps. The checkpoint left its splits "
            "unequally consumed, which a global batch that is not a multiple of num_splits "
            "does (lance_ray.train.check_world_sizes(num_workers, num_splits, global_batch) "
            "refuses it before training); resume on the world size it was saved with")


def _global_step(state: dict[str, Any]) -> Any:
    return (state.get("lance_ray") or state.get("lance_ray_mixture") or {}).get("global_step")


def report(metrics: dict[str, Any], dataset: StreamingDataset | MixtureDataset, *,
           model_state: dict[str, Any] | None = None, wait_committed: bool = True) -> None:
    """``ray.train.report`` with a checkpoint holding this rank's data state (and, from
    rank 0, ``model_state``). Call it on every rank at the same global step; ``dataset`` is
    this rank's view (a ``StreamingDataset`` or a ``MixtureDataset``).

    With ``wait_committed`` (the default) it returns only once Ray Train's controller has
    registered the checkpoint, so a worker that dies right after cannot take it down with
    it. ``ray.train.report`` alone only queues the report in the worker process; the
    controller collects it at its next health-check poll (every
    ``RAY_TRAIN_HEALTH_CHECK_INTERVAL_S``, 2 s by default), and a report still queued in a
    dead worker, or collected from only some ranks, is dropped when the group restarts.
    The wait costs up to one poll interval per checkpoint.
    """
    import ray.train
    import torch

    with tempfile.TemporaryDirectory() as d:
        save_state(Path(d) / STATE_FILE.format(rank=dataset.rank), dataset.state_dict())
        if model_state is not None and dataset.rank == 0:
            torch.save(model_state, Path(d) / MODEL_FILE)
        ray.train.report({**metrics, "global_step": dataset.global_step},
                         checkpoint=ray.train.Checkpoint.from_directory(d))
    if wait_committed:
        # COMMITTED: returns when the controller's checkpoint manager has registered
        # this rank's latest report (and saved its snapshot), i.e. every rank's report of
        # this step was collected and the checkpoint is what a restart will restore.
        ray.train.get_all_reported_checkpoints(
            consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED)


def load_model_state() -> dict[str, Any] | None:
    """The model state saved by :func:`report` in the checkpoint being restored, if any."""
    import ray.train
    import torch

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    fs, files = checkpoint.filesystem, storage.list_files(checkpoint.path,
                                                           filesystem=checkpoint.filesystem)
    model = [p for p in files if storage.basename(p) == MODEL_FILE]
    if not model:
        return None
    # weights_only: a checkpoint must never run code when it is loaded.
    return torch.load(io.BytesIO(storage.read_bytes(model[0], filesystem=fs)),
                      weights_only=True)
