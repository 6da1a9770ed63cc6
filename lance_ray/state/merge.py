"""Merging the states of every rank of one run, taken at one global step, into one state."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from ..checks import numpy_scalars_accepted
from ..topology import rank_splits
from .format import EXTRA_KEY, IDENTITY_FIXES, PLAN_KEYS, Progress, parse_state
from .mixture import is_mixture, merge_mixture_states
from .packed import CONFIG_KEYS, is_packed, parse_packed_state

logger = logging.getLogger(__name__)


@numpy_scalars_accepted
def merge_state_dicts(states: list[dict]) -> dict[str, Any]:
    """Merge the states of every rank of one run, taken at one global step, into one state.

    Each split's progress comes from the rank that owned it. Raises ``ValueError`` when
    the states disagree on the plan, were taken at different global steps, or do not cover
    every rank. States in the reference format (no owner information) are merged by
    element-wise maximum, as the reference does, with a logged warning.
    """
    if not isinstance(states, list | tuple) or not states:
        raise ValueError("merge_state_dicts requires at least one state dict (a non-empty list)")
    if any(is_packed(s) for s in states):
        return merge_packed_states(list(states))
    if any(is_mixture(s) for s in states):  # MixtureDataset states: each source by owner
        return merge_mixture_states(list(states), merge_state_dicts)
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


def check_same_run(states: list[dict], parsed: list[Progress]) -> None:
    """Raise unless lance_ray ``states`` come from one plan and one global step."""
    first_extra = states[0][EXTRA_KEY]
    for s in states[1:]:
        for key in ("plan", *IDENTITY_FIXES):
            if s[EXTRA_KEY].get(key) != first_extra.get(key):
                raise ValueError(
                    f"{key} mismatch across state dicts: {s[EXTRA_KEY].get(key)!r} != "
                    f"{first_extra.get(key)!r}; these states come from different plans"
                )
    # A state saved before commits were recorded has none: not known, not a mismatch.
    commits = sorted({s[EXTRA_KEY].get("table_commit") for s in states} - {None})
    if len(commits) > 1:
        raise ValueError(f"table_commit mismatch across state dicts: {commits}; these states "
                         "come from different tables (one dropped and created again?)")
    steps = {p.global_step for p in parsed}
    if len(steps) > 1:
        raise ValueError(
            f"states were captured at different global steps {sorted(steps, key=str)}; "
            "save every rank's state at the same step (e.g. right after the same "
            "optimizer step) and merge those"
        )


def split_owners(parsed: list[Progress], num_splits: int,
                 progress: Callable[[int, int], tuple[object, str]]) -> list[int]:
    """For each split, the index of the state whose rank owned it. ``progress(i, k)`` is
    state i's progress on split k and how to describe it; two owners must agree on it."""
    owner_of: list[int | None] = [None] * num_splits
    for i, p in enumerate(parsed):
        owned = (
            range(num_splits) if p.rank is None
            else rank_splits(p.rank, p.world_size or 1, num_splits)
        )
        for k in owned:
            prev = owner_of[k]
            if prev is not None and progress(prev, k)[0] != progress(i, k)[0]:
                raise ValueError(
                    f"two states claim split {k} with different progress "
                    f"({progress(prev, k)[1]} vs {progress(i, k)[1]}); they were not taken "
                    "at the same step"
                )
            owner_of[k] = i
    uncovered = [k for k, i in enumerate(owner_of) if i is None]
    if uncovered:
        raise ValueError(
            f"the states do not cover splits {uncovered}: their owning ranks' states are "
            "missing; pass the state of every rank of the run"
        )
    return [i for i in owner_of if i is not None]


def _merged_extra(states: list[dict], step: int | None) -> dict[str, Any]:
    extra = {**states[0][EXTRA_KEY], "rank": None, "owned_splits": None, "global_step": step}
    extra.pop("lockstep", None)
    return extra


def _merge_owned(states: list[dict], parsed: list[Progress]) -> dict[str, Any]:
    check_same_run(states, parsed)
    lockstep = [p for p in parsed if p.lockstep]
    if len({(p.samples, p.positions) for p in lockstep}) > 1:
        # Each is a function of its rank's sample count alone (so ranks in lockstep write
        # the same one): states that differ cannot say whose splits are whose.
        raise ValueError(
            "these lockstep states differ: each assumes that every rank delivered as many "
            "samples as its own, and these ranks did not (a different batch size on some "
            "rank?). Give every rank one batch size, or checkpoint such a run through a "
            "Coordinator, whose views report each rank's own splits")
    owner = split_owners(parsed, states[0]["num_splits"], lambda i, k: (
        (parsed[i].samples[k], parsed[i].positions[k]), f"{parsed[i].samples[k]} samples"))
    samples = [parsed[i].samples[k] for k, i in enumerate(owner)]
    positions = [parsed[i].positions[k] for k, i in enumerate(owner)]
    for p in parsed:
        # A lockstep state's other splits are derived, not lower bounds: only owners count.
        if not p.lockstep and any(a > b for a, b in zip(p.samples, samples)):
            raise ValueError(
                "a state records more progress on a split it does not own than the owner "
                "does; the states were not taken at the same step"
            )
    return {**{k: states[0][k] for k in PLAN_KEYS},
            "samples_consumed_per_split": samples,
            "positions_consumed_per_split": positions,
            EXTRA_KEY: _merged_extra(states, parsed[0].global_step)}


def merge_packed_states(states: list[dict]) -> dict[str, Any]:
    """Merge every rank's packed state, taken at one global step, into one state.

    lance_ray states: each split from the rank that owns it (refusing different steps or
    missing ranks). Reference-format states: the reference's rule (per split, the state with
    the most ``(blocks, documents)`` and its buffer), with a warning. Either way every split
    must end at the same block count, or the states were not taken at one step.
    """
    if not all(is_packed(s) for s in states):
        raise ValueError("cannot merge packed and unpacked state dicts")
    parsed = [parse_packed_state(s) for s in states]
    first = states[0]
    for s in states[1:]:
        for key in CONFIG_KEYS:
            if s[key] != first[key]:
                raise ValueError(f"{key} mismatch across state dicts: {s[key]!r} != "
                                 f"{first[key]!r}; merge only states of one run at one step")
    extras = [s.get(EXTRA_KEY) for s in states]
    if any(extras) and not all(extras):
        raise ValueError("cannot merge lance_ray states with reference-format states; merge "
                         "states saved by one library")
    num_splits = first["num_splits"]
    if all(extras):
        owners = [p.owner for p in parsed]
        check_same_run(states, owners)
        owner = split_owners(owners, num_splits, lambda i, k: (
            parsed[i].splits[k].key(), f"{parsed[i].splits[k].emitted} blocks"))
        chosen = [parsed[i].splits[k] for k, i in enumerate(owner)]
    else:
        logger.warning("merging reference-format packed states by the most progress per "
                       "split: their owners and steps are unknown")
        chosen = [max((p.splits[k] for p in parsed), key=lambda s: (s.emitted, s.consumed))
                  for k in range(num_splits)]
    if len({s.emitted for s in chosen}) > 1:
        raise ValueError("packed state dicts were not captured at the same global step or do "
                         "not cover every rank (merged blocks_emitted_per_split differ)")
    merged = {**first, "samples_consumed_per_split": [s.consumed for s in chosen],
              "blocks_emitted_per_split": [s.emitted for s in chosen],
              "pack_buffers": {k: b for k, s in enumerate(chosen)
                               if (b := s.buffer()) is not None}}
    if all(extras):
        merged[EXTRA_KEY] = _merged_extra(states, parsed[0].owner.global_step)
    return merged
