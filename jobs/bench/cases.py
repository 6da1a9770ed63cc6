"""The case registry: every group of configurations and the runner that reads them.

Groups are registered here, once, so the modules that define them (``configs``/``runners``
for the base group, ``packing``, ``transform_runs``) never import each other back:
``python -m jobs.bench --only <group>`` runs one group, ``--only <name>`` one configuration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from . import packing, transform_runs
from .configs import Config, base_configurations
from .runners import Runner, base_runner


@dataclass(frozen=True)
class Group:
    """A group of cases: its configurations (given the run's options) and their runner."""

    configurations: Callable[[bool, bool], list[Config]]  # (include_big, include_wide)
    runner: Callable[[dict[str, Any], Config, str | None], Runner]


GROUPS: dict[str, Group] = {
    "base": Group(base_configurations, base_runner),
    packing.GROUP: Group(lambda big, wide: packing.packing_configurations(),
                         packing.packing_runner),
    transform_runs.GROUP: Group(lambda big, wide: transform_runs.transform_configurations(),
                                transform_runs.transform_runner),
}


def configurations(include_big: bool = False, include_wide: bool = False) -> list[Config]:
    """Every registered case, group by group."""
    return [c for g in GROUPS.values() for c in g.configurations(include_big, include_wide)]


def build_runner(spec: dict[str, Any], cfg: Config, mp_context: str | None = None) -> Runner:
    """How ``cfg`` reads its epoch, from its group's runner."""
    return GROUPS[cfg.group].runner(spec, cfg, mp_context)
