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

from .format import (
    EXTRA_KEY,
    PLAN_KEYS,
    PlanIdentity,
    Progress,
    make_state,
    parse_state,
    refuse_mixture,
)
from .mixture import is_mixture, parse_mixture

logger = logging.getLogger(__name__)

PACK_KEYS = ("pack_sequences", "eos_id", "pad_id", "blocks_per_epoch")
PACKED_KEYS = ("samples_consumed_per_split", "blocks_emitted_per_split", "pack_buffers")
CONFIG_KEYS = (*PLAN_KEYS, *PACK_KEYS)


@dataclass(frozen=True)
class PackConfig:
    """The packing arguments: block length, separator and padding ids, per-split budget."""

    block_len: int
    eos_id: int
    pad_id: int
    blocks_per_split: int


@dataclass
class SplitProgress:
    """One split's packing state at a block boundary (the reference's state entries).

    ``consumed``: documents consumed (the split's permutation position); ``emitted``: blocks
    emitted; ``tokens``/``starts``: the partial buffer (``None`` when this split was never
    packed, so the state has no ``pack_buffers`` entry for it).
    """

    consumed: int = 0
    emitted: int = 0
    tokens: np.ndarray | None = None
    starts: np.ndarray | None = None

    def counts(self) -> tuple[int, int, int]:
        """``(consumed, emitted, tokens buffered)``, -1 tokens when there is no buffer: what
        the coordinator keeps of this split (it reads the tokens back when it needs them)."""
        return self.consumed, self.emitted, -1 if self.tokens is None else len(self.tokens)

    def key(self) -> tuple[int, int, Any]:
        """Everything a state records for this split, comparable."""
        return self.consumed, self.emitted, self.buffer()

    def buffer(self) -> dict[str, list[int]] | None:
        """The ``pack_buffers`` entry, as plain lists."""
        if self.tokens is None:
            return None
        starts = self.starts if self.starts is not None else np.empty(0, np.int64)
        return {"tokens": self.tokens.tolist(), "starts": starts.tolist()}


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
    return {**{k: base[k] for k in PLAN_KEYS},
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
    refuse_mixture(state)
    missing = [k for k in (*CONFIG_KEYS, *PACKED_KEYS) if k not in state]
    if missing:
        raise ValueError(f"packed checkpoint is missing field(s) {missing}; pass the dict "
                         "returned by state_dict() (or merge_state_dicts()) unchanged")
    owner = parse_state(state, split_len, packed=True)  # shared fields, counts, lance_ray block
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


def check_state(state: object) -> None:
    """Validate a state of any mode (what ``save_state``/``load_state`` accept)."""
    if is_mixture(state):  # a MixtureDataset's: its own part, then each source's state
        parse_mixture(state)
        for sub in state["sources"]:  # type: ignore[index]
            check_state(sub)
    elif is_packed(state):
        parse_packed_state(state)
    else:
        parse_state(state)
