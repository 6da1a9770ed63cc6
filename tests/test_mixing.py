"""MixtureDataset over real Lance tables: every guarantee of the mixing issue, by name.

A sample is ``(source, id)``: ids are unique within each source's table.
"""

from __future__ import annotations

import itertools
import json
from collections import Counter
from fractions import Fraction

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

import lance_ray
from lance_ray import MixtureDataset, Source
from lance_ray.state.mixture import phase_step
from lance_ray.stream.mixing import Schedule

SIZES = (24, 40, 64, 96, 130)
SETTINGS = settings(max_examples=12, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture,
                                           HealthCheck.too_slow])


def mixture(tables, weights, *, rank=0, world_size=1, num_splits=4, stop="first_exhausted",
            reader="local", **kw):
    return MixtureDataset([Source(t, weight=w) for t, w in zip(tables, weights)],
                          num_splits=num_splits, shuffle_seed=3, rank=rank,
                          world_size=world_size, stop=stop, columns=["id"], reader=reader, **kw)


def distinct(table_factory, sizes) -> list:
    """One table per size; a repeated size gets another table (more fragments), since a
    mixture refuses a table listed twice."""
    return [table_factory(n, fragments=2 + sizes[:i].count(n)) for i, n in enumerate(sizes)]


def samples(batch) -> list[tuple[int, int]]:
    return list(zip(batch["source"].tolist(), batch["id"].tolist()))


def run(ds, batch_size, limit=None) -> list[list[tuple[int, int]]]:
    out = []
    for b in ds.iter_batches(batch_size):
        assert b["source"].dtype.is_floating_point is False and str(b["source"].dtype) == \
            "torch.int64"
        out.append(samples(b))
        if limit is not None and len(out) == limit:
            break
    return out


def flat(batches) -> list[tuple[int, int]]:
    return [s for b in batches for s in b]


def assert_within_one(sources: list[int], weights: list[int]) -> None:
    w = Schedule(weights).weights
    counts = [0] * len(w)
    for k, s in enumerate(sources, 1):
        counts[s] += 1
        for i, c in enumerate(counts):
            assert abs(c - Fraction(k * w[i], sum(w))) < 1, (k, counts, w)


weights_st = st.lists(st.integers(1, 9), min_size=2, max_size=3)
sizes_st = st.lists(st.sampled_from(SIZES), min_size=3, max_size=3)


@SETTINGS
@given(weights_st, sizes_st, st.sampled_from([1, 2, 4]), st.integers(1, 17),
       st.sampled_from(["first_exhausted", "all_exhausted"]))
def test_every_rank_holds_each_source_within_one_sample_of_its_share(
        table_factory, weights, sizes, world_size, batch_size, stop):
    tables = distinct(table_factory, sizes[:len(weights)])
    for rank in range(world_size):
        ds = mixture(tables, weights, rank=rank, world_size=world_size, stop=stop)
        got = flat(run(ds, batch_size))
        assert len(got) == len(ds)
        assert_within_one([s for s, _ in got], weights)


def test_items_and_batches_are_one_sequence_tagged_with_their_source(table_factory):
    tables = [table_factory(n) for n in (96, 40, 24)]
    batches = run(mixture(tables, [7, 2, 1]), 5)
    items = list(mixture(tables, [7, 2, 1]))
    assert [(x["source"], x["id"]) for x in items] == flat(batches)
    assert all(type(x["source"]) is int for x in items)


def test_same_arguments_give_the_same_sequence_whatever_the_reader(table_factory, ray_session):
    tables = [table_factory(n) for n in (96, 40, 24)]
    local = run(mixture(tables, [5, 3, 2], world_size=2, rank=1), 8)
    ray = run(mixture(tables, [5, 3, 2], world_size=2, rank=1, reader="ray"), 8)
    again = run(mixture(tables, [5, 3, 2], world_size=2, rank=1), 3)
    assert local == ray
    assert flat(again) == flat(local)  # and whatever the batch size


@SETTINGS
@given(weights_st, sizes_st, st.sampled_from([1, 2, 4]), st.integers(1, 9))
def test_first_exhausted_never_repeats_and_ends_on_every_rank_at_one_step(
        table_factory, weights, sizes, world_size, batch_size):
    tables = distinct(table_factory, sizes[:len(weights)])
    lengths, everything = set(), []
    exhausted = False
    for rank in range(world_size):
        ds = mixture(tables, weights, rank=rank, world_size=world_size)
        per_source = [len(v) for v in ds.sources]
        got = flat(run(ds, batch_size))
        lengths.add(len(got))
        everything += got
        counts = Counter(s for s, _ in got)
        exhausted |= any(counts[i] == n for i, n in enumerate(per_source))
        nxt = int(ds.progress.schedule.sources(len(got), len(got) + 1)[0])
        assert counts[nxt] == per_source[nxt]  # the next step's source has run dry
    assert len(lengths) == 1
    assert len(everything) == len(set(everything))
    assert exhausted


@SETTINGS
@given(weights_st, sizes_st, st.sampled_from([1, 2]), st.integers(1, 9))
def test_all_exhausted_reads_every_source_whole_and_repeats_only_after_that(
        table_factory, weights, sizes, world_size, batch_size):
    tables = distinct(table_factory, sizes[:len(weights)])
    lengths = set()
    for rank in range(world_size):
        ds = mixture(tables, weights, rank=rank, world_size=world_size, stop="all_exhausted")
        per_source = [len(v) for v in ds.sources]
        got = flat(run(ds, batch_size))
        lengths.add(len(got))
        for i, n in enumerate(per_source):
            mine = [x for s, x in got if s == i]
            assert len(mine) >= n  # read whole
            assert len(set(mine[:n])) == n  # the first pass repeats nothing
            # the mixture ends right after the last source read whole finished its pass
        last = max(Schedule(weights).step_of(i, n) + 1 for i, n in enumerate(per_source))
        assert len(got) == last
        assert_within_one([s for s, _ in got], weights)
    assert len(lengths) == 1


@SETTINGS
@given(weights_st, sizes_st, st.integers(1, 9), st.integers(0, 40),
       st.sampled_from(["first_exhausted", "all_exhausted"]))
def test_a_state_taken_at_any_batch_resumes_the_same_sequence(
        table_factory, weights, sizes, batch_size, at, stop):
    tables = distinct(table_factory, sizes[:len(weights)])
    whole = run(mixture(tables, weights, world_size=2, rank=1, stop=stop), batch_size)
    assume(at <= len(whole))
    ds = mixture(tables, weights, world_size=2, rank=1, stop=stop)
    head = run(ds, batch_size, limit=at) if at else []
    state = json.loads(json.dumps(ds.state_dict()))  # plain JSON data
    resumed = mixture(tables, weights, world_size=2, rank=1, stop=stop)
    resumed.load_state_dict(state)
    assert head + run(resumed, batch_size) == whole
    # one rank's state resumes its peer of the same group too (ranks in lockstep)
    peer = mixture(tables, weights, world_size=2, rank=0, stop=stop)
    peer.load_state_dict(state)
    assert head == [] or flat(run(peer, batch_size)) == flat(
        run(mixture(tables, weights, world_size=2, rank=0, stop=stop), batch_size)
    )[len(flat(head)):]


def resumed_on(new, merged, stop) -> bool:
    """Load ``merged`` on every rank of ``new``; False if refused as documented (under
    all_exhausted, a world size whose ranks would hold unequal shares of a source)."""
    try:
        for ds in new:
            ds.load_state_dict(merged)
    except ValueError as e:
        assert stop == "all_exhausted" and "unequal samples" in str(e)
        return False
    return True


def _pass_part(ds_state, rank, world_size, source) -> int:
    """Samples of ``source``'s current pass the old ``rank`` delivered (per the merged state)."""
    from lance_ray.topology import rank_splits

    sub = ds_state["sources"][source]
    return sum(sub["samples_consumed_per_split"][s]
               for s in rank_splits(rank, world_size, sub["num_splits"]))


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(weights_st, sizes_st, st.sampled_from([1, 2, 4]), st.sampled_from([1, 2, 4]),
       st.integers(1, 7), st.integers(0, 30),
       st.sampled_from(["first_exhausted", "all_exhausted"]))
def test_merged_states_resume_on_any_world_size_each_remaining_sample_once(
        table_factory, weights, sizes, old_ws, new_ws, batch_size, at, stop):
    tables = distinct(table_factory, sizes[:len(weights)])
    old = [mixture(tables, weights, rank=r, world_size=old_ws, stop=stop)
           for r in range(old_ws)]
    assume(at * batch_size <= len(old[0]))
    before = [run(ds, batch_size, limit=at) if at else [] for ds in old]
    merged = lance_ray.merge_state_dicts([ds.state_dict() for ds in old])
    assert MixtureDataset.merge_state_dicts([ds.state_dict() for ds in old]) == merged
    new = [mixture(tables, weights, rank=r, world_size=new_ws, stop=stop)
           for r in range(new_ws)]
    if not resumed_on(new, merged, stop):
        return
    left = [ds.progress.left for ds in new]
    restarted = phase_step(merged, 0, new_ws) is None  # else the same group goes on
    after = [flat(run(ds, batch_size)) for ds in new]
    assert len({len(a) for a in after}) == 1  # every rank ends at one step
    for got in after:
        if restarted:  # the proportions hold from the resume point on
            assert_within_one([s for s, _ in got], weights)
    for i in range(len(weights)):
        # this source's current pass: what the old ranks delivered of it, what the new
        # ranks deliver of it: together each sample at most once, all of it if all_exhausted
        done = []
        for r, b in enumerate(before):
            mine = [x for s, x in flat(b) if s == i]
            k = _pass_part(merged, r, old_ws, i)
            done += mine[len(mine) - k:] if k else []
        now = []
        for r, got in enumerate(after):
            now += [x for s, x in got if s == i][:left[r][i]]
        together = done + now
        assert len(together) == len(set(together))
        per_pass = new[0].sources[i]._plan.split_len * new[0].sources[i].num_splits
        if stop == "all_exhausted" and not merged["lance_ray_mixture"]["read_whole"][i]:
            assert len(together) == per_pass  # a source not yet read whole: all of it


def test_states_of_another_mixture_are_refused_naming_the_fix(table_factory):
    a, b, c = (table_factory(n) for n in (96, 40, 24))
    ds = mixture([a, b, c], [7, 2, 1])
    run(ds, 4, limit=3)
    state = ds.state_dict()
    same = mixture([a, b, c], [14, 4, 2])  # same proportions: the same mixture
    same.load_state_dict(state)
    cases = [
        (mixture([a, b, c], [6, 3, 1]), "weights"),
        (mixture([b, a, c], [7, 2, 1]), "source 0"),
        (mixture([a, b], [7, 2]), "sources"),
        (mixture([a, b, c], [7, 2, 1], stop="all_exhausted"), "stop"),
        (mixture([a, b, c], [7, 2, 1], num_splits=2), "num_splits"),
    ]
    for other, word in cases:
        fresh = other.state_dict()
        with pytest.raises(ValueError, match=word):
            other.load_state_dict(state)
        assert other.state_dict() == fresh  # nothing changed
    with pytest.raises(ValueError, match="single table"):
        ds.load_state_dict(ds.sources[0].state_dict())


def _bump(counts, by):
    counts[0] += by


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
@pytest.mark.parametrize("world_size", [1, 2])
def test_edited_states_are_refused_and_change_nothing(table_factory, stop, world_size):
    """A state whose phase, step or sources' counts no longer agree (edited or corrupt) is
    refused before it could repeat a sample. (Under ``all_exhausted`` every source is read
    whole, so a step or a count moved back within a phase still adds up: not detectable.)"""
    a, b = table_factory(24), table_factory(40)
    ds = mixture([a, b], [3, 1], stop=stop, world_size=world_size)
    run(ds, 3, limit=3)
    good = json.loads(json.dumps(ds.state_dict()))
    mix = good["lance_ray_mixture"]
    edits = {
        "end": lambda s: s["lance_ray_mixture"].update(end=mix["end"] + 7),
        "step": lambda s: s["lance_ray_mixture"].update(step=mix["step"] - 2),
        "counts": lambda s: [_bump(s["sources"][0][k], 1) for k in (
            "samples_consumed_per_split", "positions_consumed_per_split")],
        "positions": lambda s: _bump(s["sources"][0]["positions_consumed_per_split"], 1),
        "weight": lambda s: s["lance_ray_mixture"]["sources"][0].pop("weight"),
    }
    if stop == "all_exhausted":
        del edits["step"], edits["counts"]
    for name, edit in edits.items():
        bad = json.loads(json.dumps(good))
        edit(bad)
        fresh = mixture([a, b], [3, 1], stop=stop, world_size=world_size)
        before = fresh.state_dict()
        with pytest.raises(ValueError, match="state"):
            fresh.load_state_dict(bad)
        assert fresh.state_dict() == before, name
    resumed = mixture([a, b], [3, 1], stop=stop, world_size=world_size)
    resumed.load_state_dict(good)  # the state as saved still loads


def test_a_state_refused_on_another_world_size_changes_nothing_mid_epoch(table_factory):
    """Under ``all_exhausted`` a state that would leave the ranks unequal shares is refused
    when the new phase is computed: the rank goes on from where it was, as if never asked."""
    a, b = table_factory(40), table_factory(24)
    one = mixture([a, b], [3, 1], stop="all_exhausted")
    run(one, 3, limit=1)
    uneven = json.loads(json.dumps(one.state_dict()))
    ds = mixture([a, b], [3, 1], stop="all_exhausted", world_size=2)
    it = ds.iter_batches(3)
    head = [samples(next(it)) for _ in range(2)]
    del it
    before = ds.state_dict()
    with pytest.raises(ValueError, match="unequal samples"):
        ds.load_state_dict(uneven)
    assert ds.state_dict() == before
    assert head + run(ds, 3) == run(mixture([a, b], [3, 1], stop="all_exhausted",
                                            world_size=2), 3)


def test_states_save_and_load_as_json_files(table_factory, tmp_path):
    tables = [table_factory(n) for n in (96, 40)]
    ds = mixture(tables, [3, 1])
    head = run(ds, 4, limit=5)
    lance_ray.save_state(tmp_path / "s.json", ds.state_dict())
    resumed = mixture(tables, [3, 1])
    resumed.load_state_dict(lance_ray.load_state(tmp_path / "s.json"))
    assert head + run(resumed, 4) == run(mixture(tables, [3, 1]), 4)


def test_a_state_of_another_table_version_is_refused(tmp_path):
    from conftest import id_rows, write_table

    t = write_table(str(tmp_path), 64)
    v1 = t.version
    other = write_table(str(tmp_path / "b"), 40, name="b")
    old = MixtureDataset([Source(t, weight=1, table_version=v1), Source(other, weight=1)],
                         num_splits=4, columns=["id"], reader="local")
    state = old.state_dict()
    t.add(id_rows(64, 80, 4))
    new = MixtureDataset([Source(t, weight=1), Source(other, weight=1)], num_splits=4,
                         columns=["id"], reader="local")
    with pytest.raises(ValueError, match="table_version"):
        new.load_state_dict(state)


def test_bad_arguments_are_named(table_factory):
    a = table_factory(40)
    with pytest.raises(ValueError, match="stop"):
        MixtureDataset([Source(a)], stop="never")
    with pytest.raises(ValueError, match="weight"):
        MixtureDataset([Source(a, weight=0)])
    with pytest.raises(ValueError, match="Source"):
        MixtureDataset([a])
    with pytest.raises(ValueError, match="eos_id"):
        MixtureDataset([Source(a)], pack_sequences=16, columns=["id"])
    with pytest.raises(ValueError, match="one token column"):
        MixtureDataset([Source(a)], pack_sequences=16, eos_id=1, pad_id=0)
    with pytest.raises(NotImplementedError, match="blocks_per_epoch"):
        MixtureDataset([Source(a)], pack_sequences=16, eos_id=1, pad_id=0, columns=["id"],
                       blocks_per_epoch=3)
    for dropping in ("skip", "keep_slot"):
        with pytest.raises(ValueError, match="must not drop rows"):
            MixtureDataset([Source(a)], on_transform_error=dropping)
    # numpy scalars are numbers here too, and the state stays plain JSON
    import numpy as np
    numpy_args = MixtureDataset([Source(a, weight=np.int64(2))], num_splits=np.int64(4),
                                shuffle_seed=np.int64(3), world_size=np.int64(1), columns=["id"],
                                reader="local")
    assert flat(run(numpy_args, np.int64(8))) == flat(run(mixture([a], [1]), 8))
    json.dumps(numpy_args.state_dict())
    # "raise" is the default, and saying so is accepted.
    explicit = mixture([a], [1], on_transform_error="raise")
    assert flat(run(explicit, 8)) == flat(run(mixture([a], [1]), 8))


def test_sources_that_cannot_mix_exactly_are_refused_naming_the_fix(table_factory, tmp_path):
    """A random seed per source (shuffle_seed=None), a source listed twice (its rows would
    come twice), or a column of another type in another source (silently promoted) would
    each break the mixture's contract: all are refused when it is made."""
    import lancedb
    import numpy as np
    import pyarrow as pa

    a, b = table_factory(40), table_factory(64)
    with pytest.raises(ValueError, match="one plan seed.*shuffle_seed, got None"):
        MixtureDataset([Source(a), Source(b)], shuffle_seed=None, columns=["id"])
    with pytest.raises(ValueError, match="sources 0 and 2 are the same table.*sum of their"):
        MixtureDataset([Source(a), Source(b), Source(a, weight=2)], columns=["id"])
    other = lancedb.connect(str(tmp_path)).create_table(
        "narrow", pa.table({"id": np.arange(40, dtype=np.int32)}))
    with pytest.raises(ValueError, match="column 'id' is int64 in source 0 but int32 in "
                                         "source 1"):
        MixtureDataset([Source(a), Source(other)], columns=["id"])
    # The same table under another filter is another source.
    halves = MixtureDataset([Source(a, filter="id < 20"), Source(a, filter="id >= 20")],
                            columns=["id"], reader="local")
    assert sorted(i for _, i in flat(run(halves, 8))) == list(range(40))


def test_set_epoch_starts_the_mixture_epoch_over_and_the_next_epoch_follows(table_factory):
    tables = [table_factory(n) for n in (64, 40)]
    ds = mixture(tables, [1, 1])
    first = flat(run(ds, 8))
    second = flat(run(ds, 8))  # iterating an exhausted epoch starts the next
    assert first != second and sorted(first) != [] and ds.epoch == 1
    ds.set_epoch(0)
    assert flat(run(ds, 8)) == first


def test_a_loaders_len_is_what_its_next_iteration_yields(table_factory):
    """After an epoch, iterating starts the next one: len() says the next epoch's batches."""
    loader = lance_ray.StreamingDataLoader(mixture([table_factory(n) for n in (64, 40)],
                                                   [1, 1]), 8)
    for _ in range(2):
        expected = len(loader)
        assert expected == sum(1 for _ in loader) > 0
    assert (loader.dataset.epoch, loader.dataset.num_splits) == (1, 4)  # forwarded


def test_set_epoch_of_the_current_epoch_keeps_a_resumed_position(table_factory):
    """The usual loop calls ``set_epoch(epoch)`` before each epoch, the resumed one too:
    as for a view, the epoch being read is a no-op, so nothing is read twice."""
    tables = [table_factory(n) for n in (64, 40)]
    whole = run(mixture(tables, [2, 1]), 8)
    ds = mixture(tables, [2, 1])
    run(ds, 8, limit=3)
    resumed = mixture(tables, [2, 1])
    resumed.load_state_dict(ds.state_dict())
    resumed.set_epoch(0)
    assert run(resumed, 8) == whole[3:]


# 3 workers do not divide the rank's 4 splits: a plain DataLoader's split share would refuse
# them, the loader's batch share must not (the smaller sources start later passes here).
@pytest.mark.parametrize("num_workers", [0, 2, 3])
def test_a_loader_gives_the_same_batches_with_any_workers_and_exact_states(
        table_factory, num_workers):
    tables = [table_factory(n) for n in (96, 40, 24)]
    want = run(mixture(tables, [5, 3, 2], stop="all_exhausted"), 6)
    ds = mixture(tables, [5, 3, 2], stop="all_exhausted")
    loader = lance_ray.StreamingDataLoader(ds, batch_size=6, num_workers=num_workers)
    got, state = [], None
    for b in loader:
        got.append(samples(b))
        if len(got) == 7:
            state = loader.state_dict()  # exact: counts only batches handed over
    assert got == want
    resumed = mixture(tables, [5, 3, 2], stop="all_exhausted")
    resumed.load_state_dict(state)
    again = lance_ray.StreamingDataLoader(resumed, batch_size=6, num_workers=num_workers)
    assert [samples(b) for b in again] == want[7:]


def _tokens(batch) -> list[list[int]]:
    t = batch["tokens"]
    values, offsets = t["values"].tolist(), t["offsets"].tolist()
    return [values[a:b] for a, b in zip(offsets[:-1], offsets[1:])]


def test_list_columns_and_transforms_keep_each_row_with_its_source(token_table, tmp_path):
    from conftest import write_token_table

    table, docs = token_table
    other, other_docs = write_token_table(str(tmp_path), 40, 12, 2, seed=5)
    sources = [Source(table, weight=2), Source(other, weight=1)]
    ds = MixtureDataset(sources, num_splits=2, columns=["id", "tokens"], reader="local")
    rows = []
    for b in ds.iter_batches(7):
        ids, src = b["id"].tolist(), b["source"].tolist()
        rows += list(zip(src, ids, _tokens(b)))
    assert rows and all(tok == (docs, other_docs)[s][i] for s, i, tok in rows)

    def tag(batch):  # a transform: one dict per row
        return [{"n": len(t), "id": i} for t, i in zip(batch["tokens"].to_pylist(),
                                                       batch["id"].to_pylist())]

    items = list(MixtureDataset(sources, num_splits=2, columns=["id", "tokens"],
                                transform=tag, reader="local"))
    assert [(x["source"], x["id"], x["n"]) for x in items] == [
        (s, i, len(t)) for s, i, t in rows]

    def bare(batch):
        return batch["id"].to_pylist()

    with pytest.raises(TypeError, match="dict"):
        list(MixtureDataset(sources, num_splits=2, columns=["id"], transform=bare,
                            reader="local"))


def test_a_second_live_iterator_is_refused(table_factory):
    ds = mixture([table_factory(n) for n in (64, 40)], [1, 1])
    first = ds.iter_batches(4)
    next(first)
    with pytest.raises(RuntimeError, match="concurrent"):
        next(iter(ds))
    first.close()
    assert next(iter(ds))["source"] in (0, 1)


def _packed(sources, **kw):
    return MixtureDataset(sources, num_splits=4, columns=["tokens"], reader="local",
                          pack_sequences=16, eos_id=1, pad_id=0, **kw)


@pytest.fixture(scope="module")
def doc_sources(tmp_path_factory):
    """Two token tables whose every document is one distinct token repeated (so a token
    names its document): source s, document k: ``[2 + 100 s + k] * (1 + k % 5)``."""
    import lancedb
    import pyarrow as pa

    db = lancedb.connect(str(tmp_path_factory.mktemp("docs")))
    out, lengths = [], {}
    for s, (n, w) in enumerate([(60, 2), (40, 1)]):
        docs = [[2 + 100 * s + k] * (1 + k % 5) for k in range(n)]
        lengths.update({d[0]: len(d) for d in docs})
        t = db.create_table(f"d{s}", pa.table({"id": list(range(n)),
                                              "tokens": pa.array(docs, pa.list_(pa.int32()))}))
        out.append(Source(t, weight=w))
    return out, lengths


def _doc_tokens(batches) -> Counter:
    return Counter(t for b in batches for t in b["input_ids"].reshape(-1).tolist() if t > 1)


def test_packed_blocks_hold_the_mixture_documents_in_order(doc_sources):
    sources, _ = doc_sources
    items = list(MixtureDataset(sources, num_splits=4, columns=["tokens"], reader="local"))
    stream = [t for x in items for t in [*x["tokens"], 1]]
    got = list(_packed(sources).iter_batches(3))
    flat_ids = [t for b in got for t in b["input_ids"].reshape(-1).tolist()]
    assert flat_ids[:len(stream)] == stream and set(flat_ids[len(stream):]) <= {0}
    rows = [row for b in got for row in b["source_ids"].tolist()]
    assert any(len(set(row) - {-1}) == 2 for row in rows)  # blocks mix sources
    src = [s for b in got for s in b["source_ids"].reshape(-1).tolist()]
    assert all((t >= 102) == (s == 1) for t, s in zip(flat_ids, src) if t > 1)


def test_a_packed_mixture_and_its_loader_have_no_len_but_iterate_whole(doc_sources):
    """Its blocks are known only once its documents are read: len() raises TypeError (as
    for an iterable without a length) instead of counting documents as blocks."""
    sources, _ = doc_sources
    ds = _packed(sources)
    loader = lance_ray.StreamingDataLoader(_packed(sources), batch_size=2)
    for sized in (ds, loader):
        with pytest.raises(TypeError, match="packed mixture has no len"):
            len(sized)
    blocks = list(_packed(sources))
    assert len(list(ds)) == len(blocks) and len(list(loader)) == -(-len(blocks) // 2)


@settings(max_examples=10, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.integers(0, 12), st.sampled_from([(1, 1), (2, 2), (2, 1), (2, 4), (1, 2), (4, 2)]),
       st.sampled_from(["first_exhausted", "all_exhausted"]))
def test_packed_mixture_resumes_exactly_and_across_world_sizes(doc_sources, at, sizes, stop):
    sources, lengths = doc_sources
    old_ws, new_ws = sizes
    whole = [list(_packed(sources, rank=r, world_size=old_ws, stop=stop).iter_batches(2))
             for r in range(old_ws)]
    old = [_packed(sources, rank=r, world_size=old_ws, stop=stop) for r in range(old_ws)]
    before = [[b for _, b in zip(range(at), ds.iter_batches(2))] for ds in old]
    merged = lance_ray.merge_state_dicts([json.loads(json.dumps(ds.state_dict())) for ds in old])
    new = [_packed(sources, rank=r, world_size=new_ws, stop=stop) for r in range(new_ws)]
    if not resumed_on(new, merged, stop):
        return
    after = [list(ds.iter_batches(2)) for ds in new]
    if old_ws == new_ws:  # exact resume: the uninterrupted blocks
        for r in range(old_ws):
            assert [b["input_ids"].tolist() for b in before[r] + after[r]] == [
                b["input_ids"].tolist() for b in whole[r]]
    if stop == "first_exhausted":  # no document repeats, and none is cut at the resume
        counts = _doc_tokens([b for x in before + after for b in x])
        assert all(c == lengths[t] for t, c in counts.items())


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
def test_a_packed_mixture_loader_with_workers_gives_the_blocks_and_states_of_no_workers(
        doc_sources, stop):
    """Workers read the documents, this process packs them and commits each as the packer
    takes it: the batches and the state after every batch equal num_workers=0's, and a
    state taken mid-epoch resumes the same blocks through workers."""
    sources, _ = doc_sources

    def run(workers, state=None):
        ds = _packed(sources, rank=1, world_size=2, stop=stop)
        if state is not None:
            ds.load_state_dict(state)
        loader = lance_ray.StreamingDataLoader(ds, batch_size=2, num_workers=workers)
        out = []
        for batch in loader:
            out.append((batch["input_ids"].tolist(), batch["source_ids"].tolist(),
                        json.dumps(loader.state_dict(), sort_keys=True)))
        return out

    alone, workers = run(0), run(2)
    assert workers == alone and len(alone) > 3
    mid = json.loads(alone[2][2])
    assert [b[:2] for b in run(2, mid)] == [b[:2] for b in alone[3:]]


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(st.lists(st.integers(0, 7), min_size=1, max_size=6),
       st.sampled_from(["first_exhausted", "all_exhausted"]), st.booleans())
def test_iterators_closed_anywhere_give_the_epochs_and_states_that_resume_the_rest(
        doc_sources, cuts, stop, packed):
    """One mixture read through iterators closed at any batch, over several epochs (each
    started by iterating on): the same batches as reading on, and at every cut a state
    whose fresh load yields the rest of that epoch. A packed epoch's last, padded block
    belongs to that epoch, even when its iterator was closed just before it."""
    sources, _ = doc_sources

    def make():
        if packed:
            return _packed(sources, stop=stop)
        return MixtureDataset(sources, num_splits=4, columns=["id"], reader="local", stop=stop)

    def key(batch):
        if packed:
            return batch["input_ids"].tolist()
        return list(zip(batch["source"].tolist(), batch["id"].tolist()))

    whole, want, ends = make(), [], []
    while len(want) <= sum(cuts):  # the epochs the cuts reach, and one more
        want += [key(b) for b in whole.iter_batches(2)]
        ends.append(len(want))
    ds, got = make(), []
    for c in cuts:
        got += [key(b) for b in itertools.islice(ds.iter_batches(2), c)]
        fresh = make()
        fresh.load_state_dict(json.loads(json.dumps(ds.state_dict())))
        p = len(got)
        assert [key(b) for b in fresh.iter_batches(2)] == want[p:min(e for e in ends if e >= p)]
    for _ in range(2 * len(ends)):
        if len(got) >= len(want):
            break
        got += [key(b) for b in ds.iter_batches(2)]
    assert got == want


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
def test_a_packed_mixture_loader_closed_near_an_epochs_end_goes_on_and_resumes_exactly(
        doc_sources, stop):
    """Through DataLoader workers: an iterator closed one or two blocks before the epoch's
    end, a new one that finishes the epoch, one that starts the next, and a state taken
    there: the blocks of reading on, and a fresh load yields the rest of that next epoch."""
    sources, _ = doc_sources
    reference = _packed(sources, stop=stop)
    want = [b["input_ids"].tolist() for b in reference.iter_batches(1)]
    epoch0 = len(want)
    want += [b["input_ids"].tolist() for b in reference.iter_batches(1)]

    def blocks(it):
        return [b["input_ids"].tolist() for b in it]

    for cut in (epoch0 - 1, epoch0 - 2):
        ds = _packed(sources, stop=stop)
        loader = lance_ray.StreamingDataLoader(ds, batch_size=1, num_workers=2)
        got = blocks(itertools.islice(iter(loader), cut))
        got += blocks(loader)
        assert len(got) == epoch0 and ds.epoch == 0
        got += blocks(itertools.islice(iter(loader), 1))
        fresh = _packed(sources, stop=stop)
        fresh.load_state_dict(json.loads(json.dumps(loader.state_dict())))
        assert got + blocks(fresh.iter_batches(1)) == want


def test_a_state_loaded_at_its_epochs_end_yields_nothing_then_the_next_epoch_as_a_view(
        table_factory):
    a, b = table_factory(24), table_factory(40)
    for make in (lambda: mixture([a, b], [3, 1]),
                 lambda: lance_ray.StreamingDataset(a, num_splits=4, shuffle_seed=3,
                                                    columns=["id"], reader="local")):
        ds = make()
        first = [i for batch in ds.iter_batches(4) for i in batch["id"].tolist()]
        following = [i for batch in ds.iter_batches(4) for i in batch["id"].tolist()]
        at_end = make()
        list(at_end.iter_batches(4))
        resumed = make()
        resumed.load_state_dict(json.loads(json.dumps(at_end.state_dict())))
        assert list(resumed.iter_batches(4)) == [] and resumed.epoch == 0
        assert [i for batch in resumed.iter_batches(4) for i in batch["id"].tolist()] == \
            following and resumed.epoch == 1 and first
