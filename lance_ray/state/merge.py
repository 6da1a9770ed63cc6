"""Merging the states of every rank of one run, taken at one global step, into one state."""

from __future__ import annotations

import logging
from typing import Any

from ..topology import rank_splits
from .format import EXTRA_KEY, IDENTITY_FIXES, PLAN_KEYS, Progress, parse_state

logger = logging.getLogger(__name__)


def merge_state_dicts(states: list[dict]) -> dict[str, Any]:
    """Merge the states of every rank of one run, taken at one global step, into one state.

    Each split's progress comes from the rank that owned it. Raises ``ValueError`` when
    the states disagree on the plan, were taken at different global steps, or do not cover
    every rank. States in the reference format (no owner information) are merged by
    element-wise maximum, as the reference does, with a logged warning.
    """
    if not isinstance(states, list | tuple) or not states:
        raise ValueError("merge_state_dicts requires at least one state dict (a non-empty list)")
    parsed = [parse_state(s) for s in states]
    first = states[0]
    for s in states[1:]:
        for key in PLAN_KEYS:
            if s[key] != first[key]:
                raise ValueError(
                    f"{key} mismatch across state dicts: {s[key]} != {first[key]}; merge only "
                    "states saved by the ranks of one run at one step"
                )
    extras = [s.get(EXTRA_KEY) for s in states]
    if not all(extras):
        if any(extras):
            raise ValueError(
                "cannot merge lance_ray states with reference-format states; merge states "
                "saved by one library"
            )
        logger.warning(
            "merging reference-format states by element-wise maximum: their owners and "
            "steps are unknown, so a state saved at another step cannot be detected"
        )
        samples = [max(c) for c in zip(*(p.samples for p in parsed))]
        positions = [max(c) for c in zip(*(p.positions for p in parsed))]
        return {**{k: first[k] for k in PLAN_KEYS},
                "samples_consumed_per_split": samples,
                "positions_consumed_per_split": positions}
    return _merge_owned(states, parsed)


def _merge_owned(states: list[dict], parsed: list[Progress]) -> dict[str, Any]:
    first_extra = states[0][EXTRA_KEY]
    for s in states[1:]:
        for key in ("plan", *IDENTITY_FIXES):
            if s[EXTRA_KEY].get(key) != first_extra.get(key):
                raise ValueError(
                    f"{key} mismatch across state dicts: {s[EXTRA_KEY].get(key)!r} != "
                    f"{first_extra.get(key)!r}; these states come from different plans"
                )
    steps = {p.global_step for p in parsed}
    if len(steps) > 1:
        raise ValueError(
            f"states were captured at different global steps {sorted(steps, key=str)}; "
            "save every rank's state at the same step (e.g. right after the same "
            "optimizer step) and merge those"
        )
    num_splits = states[0]["num_splits"]
    owner_of: list[Progress | None] = [None] * num_splits
    for p in parsed:
        owned = (
            range(num_splits) if p.rank is None
            else rank_splits(p.rank, p.world_size or 1, num_splits)
        )
        for k in owned:
            prev = owner_of[k]
            if prev is not None and (prev.samples[k], prev.positions[k]) != (
                p.samples[k], p.positions[k]
            ):
                raise ValueError(
                    f"two states claim split {k} with different progress "
                    f"({prev.samples[k]} vs {p.samples[k]} samples); they were not taken "
                    "at the same step"
                )
            owner_of[k] = p
    uncovered = [k for k, p in enumerate(owner_of) if p is None]
    if uncovered:
        raise ValueError(
            f"the states do not cover splits {uncovered}: their owning ranks' states are "
            "missing; pass the state of every rank of the run"
        )
    samples = [p.samples[k] for k, p in enumerate(owner_of)]  # type: ignore[union-attr]
    positions = [p.positions[k] for k, p in enumerate(owner_of)]  # type: ignore[union-attr]
    for p in parsed:
        # A lockstep state's other splits are derived, not lower bounds: only owners count.
        if not p.lockstep and any(a > b for a, b in zip(p.samples, samples)):
            raise ValueError(
                "a state records more progress on a split it does not own than the owner "
                "does; the states were not taken at the same step"
            )
    merged_extra = {**first_extra, "rank": None, "owned_splits": None,
                    "global_step": parsed[0].global_step}
    merged_extra.pop("lockstep", None)
    return {**{k: states[0][k] for k in PLAN_KEYS},
            "samples_consumed_per_split": samples,
            "positions_consumed_per_split": positions,
            EXTRA_KEY: merged_extra}
