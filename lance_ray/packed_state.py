"""Packed-mode checkpoint state: the reference's format, its validation and the merge.

The top-level keys are exactly those of ``lancedb.streaming``'s packed ``state_dict()``
(``samples_consumed_per_split`` counts documents, ``blocks_emitted_per_split`` blocks, and
``pack_buffers`` holds each touched split's partial buffer), so either library loads the
other's states; the ``"lance_ray"`` block is the one row mode writes. Pure: no I/O.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np

from .plan import rank_splits
from .state import EXTRA_KEY, PlanIdentity, Progress, make_state, parse_state
from .stream.packing import PackConfig, SplitProgress

logger = logging.getLogger(__name__)

PACK_KEYS = ("pack_sequences", "eos_id", "pad_id", "blocks_per_epoch")
PACKED_KEYS = ("samples_consumed_per_split", "blocks_emitted_per_split", "pack_buffers")
CONFIG_KEYS = ("shuffle_seed", "num_splits", "epoch", *PACK_KEYS)


@dataclass(frozen=True)
class PackedProgress:
    """A validated packed state: every split's packing progress plus who produced it."""

    splits: tuple[SplitProgress, ...]
    owner: Progress  # world size, rank and step (its counts are the documents consumed)

    @property
    def emitted(self) -> list[int]:
        return [s.emitted for s in self.splits]


def is_packed(state: object) -> bool:
    return isinstance(state, dict) and "pack_buffers" in state


def make_packed_state(identity: PlanIdentity, config: PackConfig, blocks_per_epoch: int,
                      splits: list[SplitProgress], *, world_size: int, rank: int | None,
                      global_step: int | None) -> dict[str, Any]:
    """The state dict for ``splits`` (one entry per split); ``rank=None``: complete."""
    consumed = [s.consumed for s in splits]
    base = make_state(identity, consumed, consumed, world_size=world_size, rank=rank,
                      global_step=global_step)
    buffers = {k: b for k, s in enumerate(splits) if (b := s.buffer()) is not None}
    return {**{k: base[k] for k in ("shuffle_seed", "num_splits", "epoch")},
            "pack_sequences": config.block_len, "eos_id": config.eos_id,
            "pad_id": config.pad_id, "blocks_per_epoch": blocks_per_epoch,
            "samples_consumed_per_split": consumed,
            "blocks_emitted_per_split": [s.emitted for s in splits],
            "pack_buffers": buffers, EXTRA_KEY: base[EXTRA_KEY]}


def _int_list(value: object, what: str) -> list[int]:
    if not isinstance(value, list | tuple) or not all(
            isinstance(x, int | np.integer) and not isinstance(x, bool) for x in value):
        raise ValueError(f"checkpoint {what} must be a list of integers, got {value!r:.80}; "
                         "pass the dict returned by state_dict() unchanged")
    return [int(x) for x in value]


def _buffers(raw: object, num_splits: int) -> dict[int, tuple[list[int], list[int]]]:
    if not isinstance(raw, dict):
        raise ValueError(f"checkpoint field 'pack_buffers' must be a dict, got {raw!r:.80}")
    out: dict[int, tuple[list[int], list[int]]] = {}
    for key, buf in raw.items():
        split = int(key) if isinstance(key, str) and key.isdigit() else key
        if not isinstance(split, int) or isinstance(split, bool) or not 0 <= split < num_splits:
            raise ValueError(f"checkpoint pack_buffers key {key!r} is not a split in "
                             f"[0, {num_splits})")
        if not isinstance(buf, dict) or set(buf) != {"tokens", "starts"}:
            raise ValueError(f"checkpoint pack_buffers[{key!r}] must be a dict with exactly "
                             "'tokens' and 'starts'")
        tokens = _int_list(buf["tokens"], f"pack_buffers[{key!r}]['tokens']")
        starts = _int_list(buf["starts"], f"pack_buffers[{key!r}]['starts']")
        if starts != sorted(set(starts)) or any(not 0 <= s < len(tokens) for s in starts):
            raise ValueError(f"checkpoint pack_buffers[{key!r}]['starts'] must be ascending "
                             f"positions inside its {len(tokens)} tokens, got {starts!r:.80}")
        out[split] = (tokens, starts)
    return out


def parse_packed_state(state: object, split_len: int | None = None) -> PackedProgress:
    """Validate a packed state's structure and return its progress."""
    if not isinstance(state, dict):
        raise TypeError(f"a checkpoint state must be a dict, got {type(state).__name__}")
    missing = [k for k in (*CONFIG_KEYS, *PACKED_KEYS) if k not in state]
    if missing:
        raise ValueError(f"packed checkpoint is missing field(s) {missing}; pass the dict "
                         "returned by state_dict() (or merge_state_dicts()) unchanged")
    owner = parse_state(state, split_len)  # the shared fields, counts and lance_ray block
    num_splits = state["num_splits"]
    per_split = _budget(state) // num_splits
    emitted = _int_list(state["blocks_emitted_per_split"], "'blocks_emitted_per_split'")
    if len(emitted) != num_splits or any(not 0 <= e <= per_split for e in emitted):
        raise ValueError(f"checkpoint 'blocks_emitted_per_split' must hold {num_splits} counts "
                         f"in [0, {per_split}] (blocks_per_epoch / num_splits), got "
                         f"{emitted!r:.80}: the state is corrupt or of another budget")
    buffers = _buffers(state["pack_buffers"], num_splits)
    splits = []
    for k, (consumed, blocks) in enumerate(zip(owner.samples, emitted)):
        tokens, starts = buffers.get(k, (None, None))
        splits.append(SplitProgress(
            consumed, blocks, None if tokens is None else np.asarray(tokens, np.int64),
            None if starts is None else np.asarray(starts, np.int64)))
    return PackedProgress(tuple(splits), owner)


def _budget(state: dict) -> int:
    value = state["blocks_per_epoch"]
    n = state["num_splits"]
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % n:
        raise ValueError(f"checkpoint blocks_per_epoch {value!r} must be a positive multiple "
                         f"of num_splits ({n})")
    return value


def check_packing_matches(state: dict, config: PackConfig, blocks_per_epoch: int) -> None:
    """Raise unless ``state`` was taken with these packing arguments."""
    ours = {"pack_sequences": config.block_len, "eos_id": config.eos_id,
            "pad_id": config.pad_id, "blocks_per_epoch": blocks_per_epoch}
    for key, value in ours.items():
        if state.get(key) != value:
            hint = (" ('auto' resolves per table and library: pass the checkpoint's number)"
                    if key == "blocks_per_epoch" else "")
            raise ValueError(f"{key} mismatch: checkpoint has {state.get(key)!r}, dataset has "
                             f"{value!r}; construct the dataset with {key}={state.get(key)!r}"
                             f"{hint}")


def merge_packed_states(states: list[dict]) -> dict[str, Any]:
    """Merge every rank's packed state, taken at one global step, into one state.

    lance_ray states: each split from the rank that owns it (refusing different steps or
    missing ranks). Reference-format states: the reference's rule (per split, the state with
    the most ``(blocks, documents)``), with a warning. Either way every split must end at the
    same block count, or the states were not taken at one step.
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
        chosen = _owners(states, parsed, num_splits)
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
        extra = {**first[EXTRA_KEY], "rank": None, "owned_splits": None}
        extra.pop("lockstep", None)
        merged[EXTRA_KEY] = extra
    return merged


def _owners(states: list[dict], parsed: list[PackedProgress], num_splits: int
            ) -> list[SplitProgress]:
    from .state import check_same_run

    check_same_run(states, [p.owner for p in parsed])
    chosen: list[SplitProgress | None] = [None] * num_splits
    for p in parsed:
        o = p.owner
        owned = range(num_splits) if o.rank is None else rank_splits(
            o.rank, o.world_size or 1, num_splits)
        for k in owned:
            prev, mine = chosen[k], p.splits[k]
            if prev is not None and (prev.consumed, prev.emitted, prev.buffer()) != (
                    mine.consumed, mine.emitted, mine.buffer()):
                raise ValueError(f"two states claim split {k} with different progress; they "
                                 "were not taken at the same step")
            chosen[k] = mine
    uncovered = [k for k, s in enumerate(chosen) if s is None]
    if uncovered:
        raise ValueError(f"the states do not cover splits {uncovered}: their owning ranks' "
                         "states are missing; pass the state of every rank of the run")
    return [s for s in chosen if s is not None]
