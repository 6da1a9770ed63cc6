"""The shared conformance check of every stateful iteration path (in the spirit of
torchdata's save/load conformance test, Grain's ``get_state``/``set_state`` and Energon's
savables): save a state at any unit boundary, load it into a fresh view, and

* the rest of the epoch follows exactly (``before + after == uninterrupted``);
* the next epoch after a resume is the uninterrupted next epoch;
* a state taken after the epoch's last unit rolls over: the epoch yields nothing more, and
  the next epoch is the uninterrupted next epoch (as ``lancedb.streaming`` does);
* every state is plain JSON, with the same keys and value shapes at every boundary (the
  same types, per-split arrays of the same lengths).

A ``Path`` says how to iterate a view and read sample ids off what it yields; test files
import ``Path`` and ``check_resumes_exactly`` from here (``tests/`` is on ``sys.path``).
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from lance_ray.state.contract import ResumableIterable


def next_epoch_by_set_epoch(view: Any, epoch: int) -> None:
    """The default way to start another epoch: the view's ``set_epoch``."""
    view.set_epoch(epoch)


@dataclass(frozen=True)
class Path:
    """One way to iterate a view: ``iterate(view)`` yields units (a sample or a batch) and
    ``ids(unit)`` reads their sample ids.

    ``boundaries`` is how many boundaries to resume from (slow paths check fewer; both ends
    are always among them). ``next_epoch`` starts epoch ``e`` on a view (None: the path has
    no next epoch of its own to compare, and the epoch checks are skipped)."""

    name: str
    iterate: Callable[[Any], Iterator[Any]]
    ids: Callable[[Any], list[Any]]
    reader: str = "local"
    boundaries: int = 6
    next_epoch: Callable[[Any, int], None] | None = next_epoch_by_set_epoch


def batch_ids(batch: Any) -> list[int]:
    """The ``id`` column of a collated batch."""
    return batch["id"].tolist()


def boundaries(units: int, wanted: int) -> list[int]:
    """Up to ``wanted`` distinct boundaries spread over 0..units, always with 0 and
    ``units``, then 1 (when ``wanted`` > 2)."""
    step = max(1, units // max(1, wanted - 1))
    inner = sorted({0, 1, *range(0, units, step)} - {units})
    return sorted({*inner[: max(1, wanted - 1)], units})


def _string_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _string_keys(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_string_keys(v) for v in value]
    return value


def plain(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` through JSON, as a checkpoint file carries it; it must come back equal (no
    tuples, no numpy scalars). Integer dict keys are allowed: the reference's packed state
    keys ``pack_buffers`` by split, which JSON turns into strings, and the loaded JSON form
    is what the check resumes from."""
    again = json.loads(json.dumps(state))
    assert again == _string_keys(state), "the state is not plain JSON: json.dumps changes it"
    return again


def _by_split(value: dict[Any, Any]) -> bool:
    """A dict keyed by split (``pack_buffers``): which splits it holds is progress."""
    return bool(value) and all(str(k).isdigit() for k in value)


def shape(value: Any, where: str = "", entries: dict[str, set[str]] | None = None) -> Any:
    """The structure of a state: keys, value types, and the lengths of per-split arrays
    (keys ending ``_per_split``); other lists are data (tokens of a buffer), so only their
    being lists counts. A dict keyed by split holds the splits touched so far: its shape is
    ``"by split"``, and the shape of its entries goes into ``entries[where]``."""
    if isinstance(value, dict):
        if _by_split(value) or (not value and where.endswith("buffers")):
            if entries is not None:
                entries.setdefault(where, set()).update(
                    json.dumps(shape(v, where + "/*", entries)) for v in value.values())
            return "by split"
        return {str(k): shape(v, f"{where}/{k}", entries) for k, v in sorted(value.items())}
    if isinstance(value, list):
        if where.endswith("_per_split"):
            return ["list", len(value), sorted({type(v).__name__ for v in value})]
        return "list"
    return type(value).__name__


def _ids(path: Path, units: Iterator[Any]) -> list[list[Any]]:
    return [path.ids(u) for u in units]


@dataclass(frozen=True)
class Run:
    """What a check saw: the uninterrupted epoch's units' ids, and the state taken at each
    boundary (as loaded: through JSON), for a test's own assertions on them."""

    whole: list[list[Any]]
    states: dict[int, dict[str, Any]]


def check_resumes_exactly(make_view: Callable[[], Any], path: Path,
                          also: Iterable[int] = ()) -> Run:
    """Every check of the module docstring for ``path`` over the views ``make_view`` makes
    (each a fresh view of one configuration), at ``path.boundaries`` boundaries and at the
    ``also`` ones (a property's drawn stop; clipped to the epoch)."""
    first = make_view()
    assert isinstance(first, ResumableIterable), f"{path.name}: not a ResumableIterable"
    epoch = first.epoch
    whole = _ids(path, path.iterate(first))
    assert whole, f"{path.name}: the view yields nothing: the check would prove nothing"

    stops = sorted({*boundaries(len(whole), path.boundaries),
                    *(min(max(0, k), len(whole)) for k in also)})
    # The next-epoch checks cost a second epoch: mid-epoch and at the end only. They run
    # after every resume (a coordinator's epoch is the whole run's: starting the next one
    # first would start the fresh views of the later boundaries in it).
    epoch_checks = {stops[len(stops) // 2], len(whole)}
    finished: dict[int, Any] = {}
    shapes: dict[int, Any] = {}
    states: dict[int, dict[str, Any]] = {}
    entries: dict[str, set[str]] = {}
    for k in stops:
        view = make_view()
        it = path.iterate(view)
        before = _ids(path, itertools.islice(it, k))
        state = states[k] = plain(view.state_dict())
        shapes[k] = shape(state, entries=entries)
        close = getattr(it, "close", None)
        if close is not None:
            close()
        resumed = make_view()
        resumed.load_state_dict(state)
        after = _ids(path, path.iterate(resumed))
        assert before + after == whole, f"{path.name}: resuming after {k} units"
        if k in epoch_checks:
            finished[k] = resumed
    differ = {k: s for k, s in shapes.items() if s != shapes[0]}
    assert not differ, (f"{path.name}: the state's shape changes: at 0 units {shapes[0]}, "
                        f"then {differ}")
    mixed = {k: v for k, v in entries.items() if len(v) > 1}
    assert not mixed, f"{path.name}: entries keyed by split differ in shape: {mixed}"
    if path.next_epoch is not None:
        path.next_epoch(first, epoch + 1)
        following = _ids(path, path.iterate(first))
        assert following, f"{path.name}: the next epoch yields nothing"
        for k, resumed in finished.items():
            path.next_epoch(resumed, epoch + 1)
            assert _ids(path, path.iterate(resumed)) == following, (
                f"{path.name}: the epoch after a resume from {k} of {len(whole)} units "
                f"differs from the uninterrupted next epoch")
    return Run(whole, states)
