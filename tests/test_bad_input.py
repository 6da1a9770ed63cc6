"""Bad input to StreamingDataset / StreamingDataLoader: a clear error, and no harm done.

Real Lance tables (conftest's ``table_1k``: 1000 rows, columns id/x/v), in-process reads
(``reader="local"``), no Ray. Every refusal must be immediate, of the documented type,
and name what to fix; a refused checkpoint must leave progress exactly as it was.
"""

from __future__ import annotations

import copy
import re
import signal
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch

from lance_ray import StreamingDataLoader, StreamingDataset
from lance_ray.state.format import EXTRA_KEY

NUM_SPLITS = 4
SPLIT_LEN = 250  # 1000 rows / 4 splits


def make(table, **kwargs) -> StreamingDataset:
    args = {"num_splits": NUM_SPLITS, "shuffle_seed": 3, "reader": "local", **kwargs}
    return StreamingDataset(table, **args)


def ids(batch) -> list[int]:
    return batch["id"].tolist()


class Hang(Exception):
    pass


@contextmanager
def deadline(seconds: float) -> Iterator[None]:
    """Fail (instead of hanging the suite) if the block runs longer than ``seconds``."""

    def expire(signum, frame):
        raise Hang(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ----------------------------------------------------------------------- topology


def test_splits_not_divisible_by_world_size_lists_the_valid_world_sizes(table_1k):
    with pytest.raises(ValueError, match=r"num_splits \(6\) must be divisible by world_size "
                                         r"\(4\).*\[1, 2, 3, 6\]"):
        make(table_1k, num_splits=6, world_size=4)


def test_default_num_splits_is_the_world_size(table_1k):
    ds = StreamingDataset(table_1k, world_size=2, rank=1, reader="local")
    assert ds.num_splits == 2 and len(ds) == 500


@pytest.mark.parametrize(("rank", "world_size"), [(2, 2), (4, 4), (-1, 2), (1, 1)])
def test_rank_out_of_range_is_refused(table_1k, rank, world_size):
    with pytest.raises(ValueError, match=rf"rank \({rank}\) must be in \[0, {world_size}\)"):
        make(table_1k, rank=rank, world_size=world_size)


@pytest.mark.parametrize("rank", [True, 0.0, None])
def test_rank_that_is_not_an_int_is_a_value_error_naming_rank(table_1k, rank):
    """Bug (since the coordinator refactor moved the check into rank_splits): rank=True
    is accepted as rank 1; 0.0 and None escape as TypeErrors from range() and <=."""
    with pytest.raises(ValueError, match="rank"):
        make(table_1k, rank=rank, world_size=2)


@pytest.mark.parametrize("bad", [0, "2"])
def test_bad_world_size_is_named_even_when_num_splits_defaults_to_it(table_1k, bad):
    """Bug: with num_splits=None the error blames num_splits, which was not passed."""
    with pytest.raises(ValueError, match="world_size"):
        StreamingDataset(table_1k, world_size=bad, reader="local")


@pytest.mark.parametrize("name", ["num_splits", "world_size", "read_batch_size",
                                  "shuffle_clump_size", "prefetch_batches"])
@pytest.mark.parametrize("bad", [0, -1, True, 2.0, "4"])
def test_size_that_is_not_a_positive_int_is_refused(table_1k, name, bad):
    with pytest.raises(ValueError, match=rf"{name} must be a positive integer, got {bad!r}"):
        make(table_1k, **{name: bad})


@pytest.mark.parametrize(("name", "bad"), [("shuffle_seed", -1), ("shuffle_seed", 1.5),
                                           ("shuffle_seed", True), ("epoch", -1),
                                           ("epoch", "1"), ("epoch", None)])
def test_negative_or_non_int_seed_or_epoch_is_refused(table_1k, name, bad):
    with pytest.raises(ValueError, match=rf"{name} must be a non-negative integer"):
        make(table_1k, **{name: bad})


@pytest.mark.parametrize("num_splits", [1001, 2000])
def test_more_splits_than_rows_is_refused(table_1k, num_splits):
    with pytest.raises(ValueError, match=rf"num_splits \({num_splits}\) is larger than the "
                                         r"number of rows \(1000\)"):
        make(table_1k, num_splits=num_splits)


def test_more_splits_than_rows_after_the_filter_is_refused(table_1k):
    with pytest.raises(ValueError, match=r"num_splits \(11\) is larger than the number of rows "
                                         r"\(10\) after the filter"):
        make(table_1k, num_splits=11, filter="id < 10")
    with pytest.raises(ValueError, match=r"number of rows \(0\)"):
        make(table_1k, num_splits=1, filter="id < 0")


def test_absurdly_many_splits_is_the_too_many_splits_error(table_1k):
    """The row-count check must come before anything sized by num_splits (rank_splits
    materialises the owned split ids: 2**62 would be a MemoryError)."""
    with pytest.raises(ValueError, match="larger than the number of rows"):
        make(table_1k, num_splits=2**62)


def test_absurd_non_divisible_num_splits_fails_fast(table_1k):
    """The divisibility error lists valid_world_sizes(num_splits) by trial division over
    1..num_splits, so it must only be reached once num_splits <= rows (2**40: hours)."""
    with deadline(2.0), pytest.raises(ValueError, match="larger than the number of rows|"
                                                        "must be divisible by world_size"):
        make(table_1k, num_splits=2**40 + 1, world_size=2)


# ----------------------------------------------------------------------- seeds & sizes


@pytest.mark.parametrize(("name", "value"), [("shuffle_seed", 2**64), ("epoch", 2**60),
                                             ("shuffle_clump_size", 2**64)])
def test_seed_epoch_or_clump_too_large_for_the_shuffler_is_a_value_error(table_1k, name, value):
    """Bug: lancedb's shuffler takes u64 seed and clump size; larger values (or a seed
    whose ``shuffle_seed + 100003 * epoch`` overflows) pass validation and then raise
    ``OverflowError: int too big to convert`` from the Rust binding."""
    with pytest.raises(ValueError, match=name):
        make(table_1k, **{name: value})


def test_set_epoch_whose_seed_overflows_is_a_value_error_and_changes_nothing(table_1k):
    expected = [ids(b) for b in make(table_1k, shuffle_seed=2**64 - 1).iter_batches(10)]
    ds = make(table_1k, shuffle_seed=2**64 - 1)  # the largest u64 seed is accepted
    it = ds.iter_batches(10)
    assert ids(next(it)) == expected[0]
    before = ds.state_dict()
    with pytest.raises(ValueError, match="epoch"):
        ds.set_epoch(1)  # 2**64 - 1 + 100003 does not fit the shuffler's u64 seed
    assert ds.state_dict() == before and ds.epoch == 0
    assert [ids(b) for b in it] == expected[1:]


@pytest.mark.parametrize("bad", [-1, True, 1.0, "1"])
def test_set_epoch_rejects_non_int_and_changes_nothing(table_1k, bad):
    ds = make(table_1k)
    before = ds.state_dict()
    with pytest.raises(ValueError, match="epoch must be a non-negative integer"):
        ds.set_epoch(bad)
    assert ds.state_dict() == before


# ----------------------------------------------------------------------- table, columns, filter


@pytest.mark.parametrize("bad", [None, 42, {"uri": "x"}, [1, 2], object()])
def test_table_of_the_wrong_type_is_a_type_error(bad):
    with pytest.raises(TypeError, match="table must be a LanceDB Table, a lance.LanceDataset"):
        StreamingDataset(bad, reader="local")


def test_uri_without_a_dataset_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no Lance dataset at"):
        StreamingDataset(str(tmp_path / "missing.lance"), reader="local")


def test_table_by_uri_and_by_lance_dataset_is_accepted(table_1k):
    lance_ds = table_1k.to_lance()
    for table in (lance_ds, lance_ds.uri):
        assert len(make(table)) == 1000


@pytest.mark.parametrize("bad", [0, -3, True, "3"])
def test_table_version_that_is_not_a_positive_int_is_refused(table_1k, bad):
    with pytest.raises(ValueError, match="table_version must be a positive integer"):
        make(table_1k, table_version=bad)


def test_missing_table_version_is_reported_as_such_not_as_a_bad_filter(table_1k):
    """Bug: _count_rows wraps every error as "filter None is not a valid SQL predicate"."""
    with pytest.raises(ValueError, match="cannot open version 999") as err:
        make(table_1k, table_version=999)
    assert "filter" not in str(err.value)


def test_storage_options_that_are_not_a_factory_are_refused(table_1k):
    with pytest.raises(TypeError, match="zero-argument callable"):
        make(table_1k, storage_options={"aws_access_key_id": "secret"})


@pytest.mark.parametrize("columns", [["nope"], ["id", "nope", "v"], ["ID"]])
def test_unknown_column_is_named_with_the_table_columns(table_1k, columns):
    with pytest.raises(ValueError, match=r"unknown column\(s\).*table has columns"
                                         r" \['id', 'x', 'v'\]"):
        make(table_1k, columns=columns)


@pytest.mark.parametrize("bad", ["id", ["id", 3], [None]])
def test_columns_that_are_not_a_list_of_names_is_a_type_error(table_1k, bad):
    with pytest.raises(TypeError, match="columns must be a list of column names"):
        make(table_1k, columns=bad)


def test_empty_column_list_is_refused_up_front(table_1k):
    """Bug: ``columns=[]`` is accepted; the first read then fails inside Lance with
    ``OSError: Not found: No data files found for schema: , fragment_id=0``."""
    with pytest.raises(ValueError, match="columns"):
        make(table_1k, columns=[])


@pytest.mark.parametrize("bad", ["id <<< 3", "nope > 1", "id >", "SELECT * FROM t"])
def test_bad_filter_sql_is_named(table_1k, bad):
    with pytest.raises(ValueError, match=re.escape(f"filter {bad!r} is not a valid SQL predicate")):
        make(table_1k, filter=bad)


@pytest.mark.parametrize("bad", ["", "   ", 5, ["id > 1"]])
def test_empty_or_non_string_filter_is_refused(table_1k, bad):
    with pytest.raises(ValueError, match="filter must be a non-empty SQL string"):
        make(table_1k, filter=bad)


def test_unknown_reader_is_refused(table_1k):
    with pytest.raises(ValueError, match=r"reader must be one of \('auto', 'ray', 'local'\)"):
        make(table_1k, reader="threads")


def test_shuffle_that_is_not_a_bool_is_refused(table_1k):
    """Bug: ``bool(shuffle)`` silently turns ``shuffle="false"`` into a shuffled plan."""
    with pytest.raises((TypeError, ValueError), match="shuffle"):
        make(table_1k, shuffle="false")


# ----------------------------------------------------------------------- transform


@pytest.mark.parametrize("bad", [3, "upper", [len]])
def test_non_callable_transform_is_a_type_error(table_1k, bad):
    with pytest.raises(TypeError, match="transform must be callable"):
        make(table_1k, transform=bad)


@pytest.mark.parametrize("transform", [lambda b: [0], lambda b: [], lambda b: [1] * 2000,
                                       lambda b: b.to_pylist()[1:]])
def test_transform_with_the_wrong_item_count_fails_iteration_with_a_value_error(table_1k,
                                                                                transform):
    ds = make(table_1k, transform=transform, read_batch_size=64)
    with pytest.raises(ValueError, match=r"transform returned \d+ items for a batch of 64 rows"):
        next(iter(ds))
    with pytest.raises(ValueError, match="one item per input row"):
        next(ds.iter_batches(8))
    assert ds.samples_remaining == 1000  # nothing was committed


@pytest.mark.parametrize("transform", [lambda b: None, lambda b: 5])
def test_transform_returning_a_non_sequence_names_the_transform(table_1k, transform):
    """Bug: ``list(None)`` escapes as ``TypeError: 'NoneType' object is not iterable``."""
    ds = make(table_1k, transform=transform)
    with pytest.raises(TypeError, match="transform"):
        next(iter(ds))


def test_iter_batches_rejects_a_non_positive_batch_size(table_1k):
    ds = make(table_1k)
    for bad in (0, -1, True, 2.5):
        with pytest.raises(ValueError, match="batch_size must be a positive integer"):
            next(ds.iter_batches(bad))


# ----------------------------------------------------------------------- loader


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"drop_last": True}, "drop_last=True is not supported"),
    ({"persistent_workers": True}, "persistent_workers=True is not supported"),
    ({"sampler": [0, 1, 2]}, "sampler is not supported"),
    ({"batch_sampler": [[0, 1]]}, "batch_sampler is not supported"),
    ({"shuffle": True}, "shuffle is not supported"),
    ({"in_order": False}, "in_order=False is not supported"),
    ({"batch_size": 0}, "batch_size must be a positive integer"),
    ({"batch_size": True}, "batch_size must be a positive integer"),
])
def test_loader_rejects_options_that_break_exact_checkpoints(table_1k, kwargs, message):
    with pytest.raises(ValueError, match=message):
        StreamingDataLoader(make(table_1k), **kwargs)


@pytest.mark.parametrize("bad", [[1, 2, 3], torch.utils.data.TensorDataset(torch.arange(4)),
                                 None])
def test_loader_requires_a_streaming_dataset(bad):
    with pytest.raises(TypeError, match="requires a lance_ray.StreamingDataset"):
        StreamingDataLoader(bad, batch_size=2)


# ----------------------------------------------------------------------- bad checkpoints


def bad_states(good: dict) -> list[tuple[str, object, str]]:
    """(what, state, expected message) for checkpoints that must all be refused."""
    out: list[tuple[str, object, str]] = [
        ("not a dict", None, "must be a dict"),
        ("a list", [good], "must be a dict"),
        ("json text", "{}", "must be a dict"),
    ]

    def variant(what: str, message: str, edit) -> None:
        state = copy.deepcopy(good)
        edit(state)
        out.append((what, state, message))

    for key in ("shuffle_seed", "num_splits", "epoch", "samples_consumed_per_split"):
        variant(f"missing {key}", key, lambda s, k=key: s.pop(k))
    samples, positions = "samples_consumed_per_split", "positions_consumed_per_split"
    variant("epoch + 1", "epoch mismatch", lambda s: s.update(epoch=s["epoch"] + 1))
    variant("other seed", "shuffle_seed mismatch", lambda s: s.update(shuffle_seed=4))
    variant("8 splits", "num_splits is 8", lambda s: s.update(num_splits=8))
    variant("8 splits, 8 counts", "num_splits mismatch",
            lambda s: s.update(num_splits=8, **{samples: [0] * 8, positions: [0] * 8}))
    for key, value in [("table_version", 99), ("plan_fingerprint", "0" * 16),
                       ("filter", "id > 1"), ("shuffle", False), ("shuffle_clump_size", 4),
                       ("split_len", SPLIT_LEN + 1)]:
        variant(f"other {key}", f"{key} mismatch",
                lambda s, k=key, v=value: s[EXTRA_KEY].update({k: v}))
    variant("format_version 2", "format_version", lambda s: s[EXTRA_KEY].update(format_version=2))
    variant("world_size 3", "world_size", lambda s: s[EXTRA_KEY].update(world_size=3))
    variant("rank 5", "rank", lambda s: s[EXTRA_KEY].update(rank=5, world_size=2))
    variant("negative step", "global_step", lambda s: s[EXTRA_KEY].update(global_step=-1))
    variant("identity not a dict", EXTRA_KEY, lambda s: s.update({EXTRA_KEY: "v1"}))
    for key in (samples, positions):
        variant(f"short {key}", "3 entries", lambda s, k=key: s[k].pop())
        variant(f"long {key}", "5 entries", lambda s, k=key: s[k].append(0))
        variant(f"{key} a dict", key, lambda s, k=key: s.update({k: {"0": 1}}))
        for bad in (-1, 2.0, 1.5, True, "7", None, [3]):
            variant(f"{key}[2]={bad!r}", f"{key}'\\[2\\]",
                    lambda s, k=key, b=bad: s[k].__setitem__(2, b))
    variant("beyond split", "beyond the split length 250",
            lambda s: s.update({samples: [251] * 4, positions: [251] * 4}))
    variant("position beyond split", "beyond the split length 250",
            lambda s: s[positions].__setitem__(0, 251))
    variant("positions behind", "behind", lambda s: s[positions].__setitem__(1, 0))
    variant("legacy scalar beyond split", "beyond the split length",
            lambda s: (s.pop(EXTRA_KEY), s.pop(positions), s.update({samples: 251})))
    variant("reference format, other epoch", "epoch mismatch",
            lambda s: (s.pop(EXTRA_KEY), s.update(epoch=1)))
    variant("reference format, positions behind", "behind",
            lambda s: (s.pop(EXTRA_KEY), s[positions].__setitem__(0, 0)))
    return out


def test_refused_checkpoint_leaves_progress_and_iteration_unchanged(table_1k):
    full = [i for b in make(table_1k).iter_batches(40) for i in ids(b)]
    ds = make(table_1k)
    it = ds.iter_batches(40)
    seen = [i for _ in range(3) for i in ids(next(it))]
    before = ds.state_dict()
    assert before["samples_consumed_per_split"] == [30, 30, 30, 30]
    upcoming = ds.sample_positions(0, 40)
    cases = bad_states(before)
    assert len(cases) >= 45
    for what, bad, message in cases:
        kind = TypeError if message == "must be a dict" else ValueError
        with pytest.raises(kind, match=message):
            ds.load_state_dict(bad)  # type: ignore[arg-type]
        assert ds.state_dict() == before, what
        assert ds.samples_remaining == 1000 - 120, what
        assert ds.sample_positions(0, 40) == upcoming, what
    # The running iterator was not superseded and goes on from where it was ...
    seen += ids(next(it))
    it.close()  # (one active iterator per dataset)
    # ... and so does a new one, from the committed state.
    seen += [i for b in ds.iter_batches(40) for i in ids(b)]
    assert seen == full


def test_refused_checkpoint_through_the_loader_changes_nothing(table_1k):
    full = [i for b in make(table_1k).iter_batches(25) for i in ids(b)]
    loader = StreamingDataLoader(make(table_1k), batch_size=25)
    it = iter(loader)
    seen = [i for _ in range(5) for i in ids(next(it))]
    before = loader.state_dict()
    bad = copy.deepcopy(before)
    bad["samples_consumed_per_split"][3] = -5
    with pytest.raises(ValueError, match=r"samples_consumed_per_split'\[3\]"):
        loader.load_state_dict(bad)
    assert loader.state_dict() == before
    seen += [i for b in it for i in ids(b)]
    assert seen == full


def rows_of(batch):
    return batch.to_pylist()


def test_rank_state_not_determining_the_others_is_refused_elsewhere_and_changes_nothing(
        table_1k):
    # Rows that fail may drop out of other ranks' splits: this rank's progress says nothing
    # about theirs, so its own state must not stand for theirs.
    kw = {"world_size": 2, "transform": rows_of, "on_transform_error": "skip"}
    expected = [ids(b) for b in make(table_1k, rank=0, **kw).iter_batches(5)]
    rank0 = make(table_1k, rank=0, **kw)
    rank1 = make(table_1k, rank=1, **kw)
    next(rank1.iter_batches(7))
    theirs = rank1.state_dict()
    it = rank0.iter_batches(5)
    assert ids(next(it)) == expected[0]
    before = rank0.state_dict()
    with pytest.raises(ValueError, match=r"rank 1's own state of a 2-rank run.*"
                                         r"loaded by rank 0 of 2.*merge_state_dicts"):
        rank0.load_state_dict(theirs)
    assert rank0.state_dict() == before
    assert [ids(b) for b in it] == expected[1:]
    single = make(table_1k, transform=rows_of, on_transform_error="skip")
    with pytest.raises(ValueError, match="loaded by rank 0 of 1"):
        single.load_state_dict(theirs)
    assert single.samples_remaining == 1000


def test_legacy_scalar_state_with_absurd_num_splits_is_a_value_error(table_1k):
    """Bug: parse_state expands the scalar to num_splits entries before checking
    num_splits against the plan: MemoryError here, gigabytes for 10**9 (not run)."""
    ds = make(table_1k)
    state = {"shuffle_seed": 3, "num_splits": 2**62, "epoch": 0,
             "samples_consumed_per_split": 0}
    with pytest.raises(ValueError, match="num_splits"):
        ds.load_state_dict(state)
    assert ds.samples_remaining == 1000
