"""A mixture phase's arithmetic: the step at which a phase ends, and the checks that a loaded
phase adds up, from the schedule and what each split has left of each source's pass.

``left[i][s]`` is what split ``s`` has left of source ``i``'s current pass; the ranks' shares
follow from it for any world size, so a refusal can name the world sizes that would load.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..state.mixture import even_world_sizes, ranks_left
from ..stream.mixing import Schedule, end_step

Lefts = Sequence[Sequence[int]]


def phase_end(schedule: Schedule, *, stop: str, left: Lefts, world_size: int, step: int,
              whole: Sequence[bool]) -> int:
    """The step at which a phase at ``step`` ends, every rank being at ``step``."""
    remaining = [ranks_left(s, world_size) for s in left]
    if stop == "first_exhausted":
        return end_step(schedule, [min(r) for r in remaining], stop=stop, start=step)
    check_even(left, world_size)
    return end_step(schedule, [r[0] for r in remaining], stop=stop, start=step, whole=whole)


def check_even(left: Lefts, world_size: int) -> None:
    """Refuse (under ``all_exhausted``) ranks with unequal samples left of a source: they
    would start its next pass at different steps."""
    remaining = [ranks_left(s, world_size) for s in left]
    uneven = [i for i, r in enumerate(remaining) if len(set(r)) > 1]
    if uneven:
        raise ValueError(
            f"this state leaves the {world_size} ranks unequal samples of source(s) "
            f"{uneven} ({[remaining[i] for i in uneven]}), so under stop='all_exhausted' "
            "they would start those sources' next passes at different steps; resume it on "
            f"one of the world sizes {even_world_sizes(left)}, at which every source's "
            "remaining samples split equally over the ranks (stop='first_exhausted' has no "
            "such limit but applies to a new run only: a state loads with its own stop)")


def check_phase(schedule: Schedule, *, stop: str, left: Lefts, world_size: int, rank: int,
                step: int, end: int, common: bool, whole: Sequence[bool]) -> None:
    """Refuse a phase that the state's own sources do not bear out (an edited or corrupt
    state), before it could repeat samples or change the order: its end must follow from its
    step and what each source has left (``common``: every rank is at ``step``)."""
    mine = [ranks_left(s, world_size)[rank] for s in left]
    counts = schedule.counts(step)
    short = [] if stop != "first_exhausted" or step > end else [
        i for i, (a, b, n) in enumerate(zip(counts, schedule.counts(end), mine)) if b - a > n]
    expected = phase_end(schedule, stop=stop, left=left, world_size=world_size, step=step,
                         whole=whole) if common and step <= end else end
    if step > end or short or expected != end:
        raise ValueError(
            f"this mixture state does not add up: its phase runs from step {step} to "
            f"step {end}, but its sources have {mine} samples left on rank {rank}"
            + (f" (too few of source(s) {short})" if short else "")
            + (f", which end the phase at step {expected}" if expected != end else "")
            + "; load the state exactly as state_dict() or merge_state_dicts() returned it")


def check_ended(*, stop: str, left: Lefts, world_size: int, rank: int, common: bool,
                whole: Sequence[bool]) -> None:
    """Refuse a phase said to be over that its sources show is not, by what shows on any
    world size (an ended phase loaded on another one; the group that read it may be gone):
    under ``all_exhausted``, every source not yet read whole has nothing left on ``rank``;
    under ``first_exhausted`` (``common``: the state is the whole group's), some source ran
    dry on some rank, so some split has nothing left of it."""
    mine = [ranks_left(s, world_size)[rank] for s in left]
    if stop == "all_exhausted":
        unread = [i for i, (n, w) in enumerate(zip(mine, whole)) if n and not w]
    else:
        unread = [] if not common or any(0 in s for s in left) else list(range(len(left)))
    if unread:
        raise ValueError(
            "this mixture state does not add up: its phase was read to its end, but source(s) "
            f"{unread} still have samples of their pass left ({[mine[i] for i in unread]} on "
            f"rank {rank}); load the state exactly as state_dict() or merge_state_dicts() "
            "returned it")
