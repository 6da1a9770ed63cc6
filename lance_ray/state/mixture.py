"""A mixture's checkpoint: its format, its strict checks, its merge, and what each rank has
left of every source (pure: no Ray, no torch, no I/O).

A mixture state is ``{"lance_ray_mixture": {...}, "sources": [one state per source]}``.
Each source's state is an ordinary ``StreamingDataset`` state of that source's current
pass (its plan epoch), so every per-source guarantee (exact progress, merges by owner) is
the one single tables have. The mixture's own part says which mixture it belongs to (the
sources' tables, versions, filters and weights, in order; ``stop``; the plan arguments),
where its phase stands (``step``: samples this rank delivered since the phase began) and,
per source, its pass and whether it was already read whole in this mixture epoch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..checks import is_int
from ..topology import rank_splits, valid_world_sizes
from .format import EXTRA_KEY, MIX_KEY, parse_state

PACK_KEY = "pack"  # a packed mixture's packing and every rank's carry
MIX_FORMAT_VERSION = 1
STOPS = ("first_exhausted", "all_exhausted")
# What must agree between a state and the mixture loading it, and how to fix each.
MIX_FIXES = {
    "stop": "construct the MixtureDataset with the checkpoint's stop",
    "num_splits": "construct the MixtureDataset with the checkpoint's num_splits",
    "shuffle_seed": "construct the MixtureDataset with the checkpoint's shuffle_seed",
}
SOURCE_FIXES = {
    "table": "pass the checkpoint's sources, in the checkpoint's order",
    "table_version": "open each source at the checkpoint's version (Source(table_version=...))",
    "filter": "give each source the checkpoint's filter",
    "rows": "pass the checkpoint's sources, in the checkpoint's order (these rows differ)",
    "weight": "give the sources the checkpoint's weights (their proportions must match)",
}


def is_mixture(state: object) -> bool:
    return isinstance(state, dict) and MIX_KEY in state


def make_mixture_state(meta: dict[str, Any], *, epoch: int, world_size: int, rank: int | None,
                       step: int | None, end: int, global_step: int, passes: Sequence[int],
                       whole: Sequence[bool], sources: list[dict[str, Any]],
                       **extra: Any) -> dict[str, Any]:
    """A mixture state; ``meta`` is :func:`mixture_meta`'s description of the mixture;
    ``extra``: a packed mixture's ``pack``."""
    return {**extra, MIX_KEY: {"format_version": MIX_FORMAT_VERSION, **meta, "epoch": epoch,
                      "world_size": world_size, "rank": rank, "step": step, "end": end,
                      "global_step": global_step, "passes": [int(p) for p in passes],
                      "read_whole": [bool(w) for w in whole]},
            "sources": sources}


def source_meta(uri: str, table_version: int, filter: str | None, rows: int) -> dict[str, Any]:
    """What identifies one source in a mixture state: its table's name (the last part of
    its URI, so a moved table still loads), version, filter and rows after the filter."""
    return {"table": uri.rstrip("/").rsplit("/", 1)[-1], "table_version": table_version,
            "filter": filter, "rows": rows}


@dataclass(frozen=True)
class MixtureRun:
    """A coordinator's mixture: the coordinators of its sources (one per source, in the
    mixture's order; each holds that source's plan), the epoch it was created for, and the
    mixture's :func:`mixture_meta`, which every state of the run carries."""

    sources: tuple[str, ...]
    epoch: int
    meta: dict[str, Any]
    pack: dict[str, Any] | None = None  # a packed run's packing (MixtureDataset's)


def mixture_meta(sources: Sequence[dict[str, Any]], weights: Sequence[int], stop: str,
                 num_splits: int, shuffle_seed: int) -> dict[str, Any]:
    """What identifies a mixture: ``sources`` are ``{"table", "table_version", "filter",
    "rows"}`` (rows after the filter)."""
    return {"sources": [{**s, "weight": int(w)} for s, w in zip(sources, weights)],
            "stop": stop, "num_splits": num_splits, "shuffle_seed": shuffle_seed}


def mixture_seed(shuffle_seed: object) -> int:
    """``shuffle_seed`` of a mixture: one integer that every source's plan shares (a random
    one, drawn per source, would give states that no other mixture can load)."""
    if not is_int(shuffle_seed) or shuffle_seed < 0:
        raise ValueError("a mixture's sources share one plan seed: pass a non-negative "
                         f"integer shuffle_seed, got {shuffle_seed!r}")
    return shuffle_seed


def check_distinct_sources(keys: Sequence[tuple[str, int, str | None]]) -> None:
    """Refuse a source listed twice: the same ``(table URI, version, filter)`` would
    deliver each of its rows twice per pass."""
    seen: dict[tuple[str, int, str | None], int] = {}
    for i, key in enumerate(keys):
        if key in seen:
            raise ValueError(
                f"sources {seen[key]} and {i} are the same table, version and filter "
                f"({key[0]!r} at version {key[1]}, filter {key[2]!r}), so each of its rows "
                "would be delivered twice; list it once, with the sum of their weights")
        seen[key] = i


def phase_step(state: dict[str, Any], rank: int, world_size: int) -> int | None:
    """The step at which rank ``rank`` of ``world_size`` continues the state's phase, or None
    when it starts a new phase (another world size, or ranks' steps unknown)."""
    mix = state[MIX_KEY]
    if mix["world_size"] != world_size:
        return None
    if mix["step"] is not None:
        return int(mix["step"])
    steps = state.get("rank_steps")
    if isinstance(steps, list) and len(steps) == world_size and is_int(steps[rank]) \
            and steps[rank] >= 0:
        return int(steps[rank])
    return None


def phase_over(state: dict[str, Any]) -> bool:
    """Whether the state's phase was read to its end (nothing of its epoch is left to read
    on any rank of the group that saved it)."""
    mix = state[MIX_KEY]
    return mix["step"] is not None and mix["step"] == mix["end"]


def parse_mixture(state: object) -> dict[str, Any]:
    """The validated mixture part of ``state`` (its sources' states are checked by their
    views when they load them)."""
    if not isinstance(state, dict):
        raise TypeError(f"a checkpoint state must be a dict, got {type(state).__name__}")
    if MIX_KEY not in state:
        raise ValueError("this is a single table's state, not a MixtureDataset's: load it "
                         "into a StreamingDataset, or pass a MixtureDataset.state_dict()")
    mix = state[MIX_KEY]
    version = mix.get("format_version") if isinstance(mix, dict) else None
    if not isinstance(mix, dict) or version != MIX_FORMAT_VERSION:
        raise ValueError(f"mixture state format_version {version!r} is not supported (this "
                         f"lance_ray reads {MIX_FORMAT_VERSION}); upgrade lance_ray to load it")
    missing = [k for k in ("sources", "stop", "num_splits", "shuffle_seed", "epoch",
                           "world_size", "rank", "step", "end", "global_step", "passes",
                           "read_whole")
               if k not in mix]
    if missing:
        raise ValueError(f"mixture state is missing field(s) {missing}; pass the dict "
                         "returned by state_dict() (or merge_state_dicts()) unchanged")
    fields = ("table", "table_version", "filter", "rows", "weight")
    if not isinstance(mix["sources"], list) or not all(
            isinstance(m, dict) and all(k in m for k in fields) for m in mix["sources"]):
        raise ValueError(f"mixture state sources must be a list of {{{', '.join(fields)}}} "
                         "dicts, one per source; pass the dict returned by state_dict() (or "
                         "merge_state_dicts()) unchanged")
    n = len(mix["sources"])
    subs = state.get("sources")
    if not isinstance(subs, list) or len(subs) != n or len(mix["passes"]) != n \
            or len(mix["read_whole"]) != n:
        raise ValueError(f"mixture state must hold one state, pass and flag per source ({n})")
    for i, sub in enumerate(subs):
        # A mixture's transform never drops rows, so each source read exactly the samples it
        # delivered: positions that differ say the state was edited, or is not a mixture's.
        if isinstance(sub, dict) and "positions_consumed_per_split" in sub and \
                sub["positions_consumed_per_split"] != sub.get("samples_consumed_per_split"):
            raise ValueError(f"source {i}'s state has positions_consumed_per_split different "
                             "from samples_consumed_per_split, but a mixture drops no rows: "
                             "the state is corrupt; load it exactly as state_dict() or "
                             "merge_state_dicts() returned it")
    for key in ("epoch", "world_size", "global_step", "end"):
        if not is_int(mix[key]) or mix[key] < 0:
            raise ValueError(f"mixture state {key} {mix[key]!r} must be a non-negative integer")
    if mix["step"] is not None and (not is_int(mix["step"]) or mix["step"] < 0):
        raise ValueError(f"mixture state step {mix['step']!r} must be null or an integer >= 0")
    return mix


def check_mixture_compatible(mix: dict[str, Any], meta: dict[str, Any]) -> None:
    """Raise, naming the fix, unless ``mix`` belongs to the mixture ``meta`` describes."""
    for key, fix in MIX_FIXES.items():
        if mix[key] != meta[key]:
            raise ValueError(f"{key} mismatch: checkpoint has {mix[key]!r}, mixture has "
                             f"{meta[key]!r}; {fix}")
    theirs, ours = mix["sources"], meta["sources"]
    if len(theirs) != len(ours):
        raise ValueError(f"the checkpoint has {len(theirs)} sources, this mixture "
                         f"{len(ours)}; {SOURCE_FIXES['table']}")
    ratio = [t["weight"] for t in theirs], [o["weight"] for o in ours]
    for i, (t, o) in enumerate(zip(theirs, ours)):
        for key, fix in SOURCE_FIXES.items():
            if key == "weight":
                continue
            if t.get(key) != o.get(key):
                raise ValueError(f"source {i}: {key} mismatch: checkpoint has {t.get(key)!r}, "
                                 f"mixture has {o.get(key)!r}; {fix}")
    if ratio[0] != ratio[1]:
        raise ValueError(f"weights mismatch: checkpoint's are in proportions {ratio[0]}, "
                         f"this mixture's {ratio[1]}; {SOURCE_FIXES['weight']}")


def merge_mixture_states(states: list[dict],
                         merge_one: Callable[[list[dict]], dict[str, Any]]) -> dict[str, Any]:
    """Merge every rank's mixture state, taken at one global step, into one state that
    loads on any world size dividing ``num_splits``. ``merge_one`` merges one source's
    per-rank states (``lance_ray.merge_state_dicts``)."""
    mixes = [parse_mixture(s) for s in states]
    first = mixes[0]
    for m in mixes[1:]:
        check_mixture_compatible(m, first)
        for key in ("epoch", "passes", "read_whole", "world_size", "global_step", "end"):
            if m[key] != first[key]:
                raise ValueError(
                    f"{key} differs across the mixture states ({m[key]!r} != "
                    f"{first[key]!r}): save every rank's state at the same step (e.g. right "
                    "after the same optimizer step) and merge those")
    sources = [merge_one([s["sources"][i] for s in states]) for i in range(len(first["sources"]))]
    packs = [s.get(PACK_KEY) for s in states]
    steps = {m["step"] for m in mixes}
    # Ranks at different steps (e.g. packed ranks, whose documents differ in length): each
    # rank's step, so that the same group resumes exactly; another size starts a new phase.
    by_rank = {m["rank"]: m["step"] for m in mixes}
    rank_steps = [by_rank.get(r) for r in range(first["world_size"])] \
        if len(steps) > 1 and None not in by_rank else None
    meta = {k: first[k] for k in ("sources", "stop", "num_splits", "shuffle_seed")}
    # One phase step on every rank: the same-size group continues the phase exactly.
    return make_mixture_state(meta, epoch=first["epoch"], world_size=first["world_size"],
                              rank=None, step=steps.pop() if len(steps) == 1 else None,
                              end=first["end"],
                              global_step=first["global_step"], passes=first["passes"],
                              whole=first["read_whole"], sources=sources,
                              **({PACK_KEY: merge_pack_states(packs)} if any(packs) else {}),
                              **({"rank_steps": rank_steps} if rank_steps else {}))


def merge_pack_states(parts: list[Any]) -> dict[str, Any]:
    """Every rank's carry of a packed mixture, in one state."""
    if not all(parts):
        raise ValueError("cannot merge packed and unpacked mixture states")
    first = parts[0]
    for p in parts[1:]:
        if {k: v for k, v in p.items() if k != "carries"} != \
                {k: v for k, v in first.items() if k != "carries"}:
            raise ValueError("the packed mixture states disagree on their packing or world "
                             "size; merge the states of one run's ranks at one step")
    carries: dict[str, Any] = {}
    for p in parts:
        carries.update(p["carries"])
    return {**first, "carries": carries}


def split_left(source_state: dict) -> list[int]:
    """Samples left of a source's pass in each split, from a state that holds every split's
    progress (a merged, one-rank or lockstep state)."""
    split_len = source_state[EXTRA_KEY]["split_len"]
    return [split_len - n for n in parse_state(source_state).samples]


def ranks_left(left: Sequence[int], world_size: int) -> list[int]:
    """Samples each rank of ``world_size`` has left, from each split's ``left``."""
    return [sum(left[s] for s in rank_splits(r, world_size, len(left)))
            for r in range(world_size)]


def even_world_sizes(lefts: Sequence[Sequence[int]]) -> list[int]:
    """The world sizes at which every source's ``lefts`` (per split) leave each rank the
    same number of samples."""
    return [w for w in valid_world_sizes(len(lefts[0]))
            if all(len(set(ranks_left(left, w))) == 1 for left in lefts)]


def rank_own(source_state: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """A source view's state as rank ``rank``'s own: its splits exact, the others at zero
    (a lower bound, which a merge takes from their owners).

    A packed mixture's ranks read different numbers of documents of a source, so a source
    view's lockstep state (every split derived as if all ranks had read what this one did)
    would claim wrong progress for the other ranks' splits, and the merge would refuse it.
    """
    extra = source_state[EXTRA_KEY]
    if not extra.get("lockstep"):
        return source_state
    owned = rank_splits(rank, world_size, source_state["num_splits"])
    mine = set(owned)

    def own(key: str) -> list[int]:
        return [v if k in mine else 0 for k, v in enumerate(source_state[key])]

    extra = {k: v for k, v in extra.items() if k != "lockstep"}
    return {**source_state, "samples_consumed_per_split": own("samples_consumed_per_split"),
            "positions_consumed_per_split": own("positions_consumed_per_split"),
            EXTRA_KEY: {**extra, "rank": rank, "owned_splits": owned}}
