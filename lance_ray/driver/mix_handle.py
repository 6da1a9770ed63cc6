"""``Coordinator.create`` over a mixture: one coordinator per source (its plan, its version
lease, its resizes), and the mixture coordinator that merges the ranks' mixture states."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import ray

from .. import storage
from ..coordinator.client import constructed
from ..coordinator.mixture import MixtureCoordinatorActor
from ..state.mixture import (
    STOPS,
    MixtureRun,
    check_distinct_sources,
    mixture_meta,
    mixture_seed,
    source_meta,
)
from ..state.reporting import ReportPolicy
from ..stream.mixing import integer_weights
from ..topology import splits_per_rank
from ..view.mix_pack import pack_config
from ..view.mixture import Source


def is_sources(data: Any) -> bool:
    """Whether ``Coordinator.create``'s data is a mixture (a list of ``Source``)."""
    return isinstance(data, Sequence) and not isinstance(data, str) and bool(data) and \
        all(isinstance(s, Source) for s in data)


def source_name(name: str, index: int) -> str:
    """The name of the coordinator of source ``index`` of the mixture coordinator ``name``."""
    return f"{name}.source{index}"


def create_mixture(cls: Any, sources: Sequence[Source], name: str, *,
                   storage_path: str, world_size: int, num_splits: int | None, stop: str,
                   shuffle_seed: int | None, epoch: int, namespace: str, detached: bool,
                   storage_options: Any, storage_retry: storage.RetryPolicy | None,
                   report_policy: ReportPolicy | None, actor_options: dict[str, Any],
                   pack: dict[str, Any] | None = None, **plan_kwargs: Any) -> Any:
    """See ``Coordinator.create`` (``cls``: ``Coordinator``, which imports this module):
    ``plan_kwargs`` are the plan arguments every source shares (``shuffle``,
    ``shuffle_clump_size``, ``plan``, ``lease_version``); ``pack``: a packed run's
    ``pack_sequences``, ``eos_id``, ``pad_id`` and ``columns``, as ``MixtureDataset``
    takes them."""
    if stop not in STOPS:
        raise ValueError(f"stop must be one of {STOPS}, got {stop!r}")
    shuffle_seed = mixture_seed(shuffle_seed)
    weights = integer_weights([s.weight for s in sources])
    if pack is not None:  # MixtureDataset's own validation: one token column, integer ids
        columns = pack.pop("columns", None)
        pack = pack_config(dict(pack), columns, None)
    num_splits = world_size if num_splits is None else num_splits
    splits_per_rank(num_splits, world_size)
    policy = report_policy or ReportPolicy()
    made: list[Any] = []  # the sources' Coordinator handles
    try:
        for i, s in enumerate(sources):
            made.append(cls.create(
                s.table, source_name(name, i), storage_path=storage_path,
                world_size=world_size, num_splits=num_splits, shuffle_seed=shuffle_seed,
                epoch=epoch, filter=s.filter, table_version=s.table_version,
                storage_options=storage_options, namespace=namespace, detached=detached,
                storage_retry=storage_retry, report_policy=policy, **plan_kwargs))
        described = ray.get([c.handle.describe.remote() for c in made])
        check_distinct_sources([(t.uri, t.version, s.filter)
                                for s, (t, _) in zip(sources, described)])
        rows = ray.get([c.handle.rows.remote() for c in made])
        short = [i for i, r in enumerate(rows) if r < num_splits]
        if short:
            raise ValueError(f"source(s) {short} have fewer rows after the filter than "
                             f"num_splits={num_splits}; remove them or lower num_splits")
        meta = mixture_meta([source_meta(t.uri, t.version, s.filter, r) for s, (t, _), r
                             in zip(sources, described, rows)],
                            weights, stop, num_splits, shuffle_seed)
        run = MixtureRun(tuple(c.name for c in made), epoch, meta, pack)
        options = {**actor_options, "name": name, "namespace": namespace,
                   "get_if_exists": True, "lifetime": "detached" if detached else None}
        handle: Any = ray.remote(MixtureCoordinatorActor).options(**options).remote(
            name, run, world_size, storage.absolute(storage_path), namespace,
            storage_options, storage_retry, asdict(policy))
        live = constructed(handle, handle.describe.remote(), name, namespace)
    except BaseException:
        for c in made:  # a half-made run leaves no actors or tags of its own (files stay)
            if c.created:  # never one it found alive: that may be a live run's
                if c.leased:  # a tag left would refuse the next create
                    with contextlib.suppress(Exception):
                        c.release_version()
                with contextlib.suppress(Exception):
                    ray.kill(c.handle, no_restart=True)
        raise
    if live != run:
        raise ValueError(f"a live coordinator named {name!r} runs another mixture "
                         f"({live.meta}); use another name, or Coordinator.get({name!r})")
    return cls(handle, name, namespace, sources=made)
