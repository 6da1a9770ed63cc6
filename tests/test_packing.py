"""Sequence packing (``pack_sequences``): the reference's blocks and states, exact resume and
merge on every world size, elastic global steps, validation, the exact "auto" budget and the
count of left-out tokens. ``lancedb.streaming.StreamingDataset`` is the oracle throughout."""

from __future__ import annotations

import itertools
import json
from collections import Counter

import numpy as np
import pytest
from conformance import Path, check_resumes_exactly
from conftest import write_token_table
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs
from lancedb.streaming import StreamingDataset as Reference

import lance_ray
from lance_ray import StreamingDataset
from lance_ray.topology import valid_world_sizes

EOS, PAD = 1, 0
CORPORA = [(24, 12, 2), (60, 30, 3), (36, 3, 1)]  # documents, longest document, fragments


@pytest.fixture(scope="module")
def corpora(tmp_path_factory, token_table):
    return [write_token_table(str(tmp_path_factory.mktemp(f"tokens{i}")), *shape)
            if shape != (60, 30, 3) else token_table for i, shape in enumerate(CORPORA)]


def packed(**kw):
    return dict(pack_sequences=kw.pop("L"), eos_id=EOS, pad_id=PAD, columns=["tokens"], **kw)


def blocks_of(items) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return [(tuple(b["input_ids"].tolist()), tuple(b["doc_ids"].tolist())) for b in items]


def reference_keys(state: dict) -> dict:
    return {k: v for k, v in state.items() if k != "lance_ray"}


def take(it, n):
    return [next(it) for _ in range(n)]


FIXTURE = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow]


@settings(max_examples=40, deadline=None, suppress_health_check=FIXTURE)
@given(corpus=hs.integers(0, len(CORPORA) - 1), L=hs.integers(1, 16),
       num_splits=hs.sampled_from([1, 2, 3, 4]), shuffle=hs.booleans(),
       seed=hs.integers(0, 5), data=hs.data())
def test_packed_blocks_and_states_match_the_reference(corpora, corpus, L, num_splits, shuffle,
                                                      seed, data):
    table, docs = corpora[corpus]
    world_size = data.draw(hs.sampled_from(valid_world_sizes(num_splits)))
    rank = data.draw(hs.integers(0, world_size - 1))
    tokens = sum(len(d) + 1 for d in docs)
    per_split = data.draw(hs.integers(1, tokens // L // num_splits + 3))
    kw = packed(L=L, num_splits=num_splits, shuffle=shuffle, shuffle_seed=seed, rank=rank,
                world_size=world_size, blocks_per_epoch=per_split * num_splits,
                filter=data.draw(hs.sampled_from([None, "id % 3 != 1"])))
    ref = Reference(table, **kw)
    reads = data.draw(hs.sampled_from([4, 7, 4096]))  # several reads per split, or one
    ours = StreamingDataset(table, reader="local", read_batch_size=reads, **kw)
    assert len(ours) == per_split * (num_splits // world_size)
    # Stop both at the same cycle boundary: the same state; then the same rest of the epoch.
    cycles = data.draw(hs.integers(0, per_split))
    k = num_splits // world_size
    ref_it, our_it = iter(ref), iter(ours)
    first = blocks_of(take(our_it, cycles * k))
    assert blocks_of(take(ref_it, cycles * k)) == first
    assert reference_keys(ours.state_dict()) == ref.state_dict()
    assert ours.consumed_rows == ref.consumed_rows  # documents the packer took
    assert blocks_of(our_it) == blocks_of(ref_it)
    assert reference_keys(ours.state_dict()) == ref.state_dict()
    assert ours.consumed_rows == ref.consumed_rows


@pytest.mark.parametrize("world_size, rank", [(1, 0), (2, 1)])
def test_packed_states_load_in_both_libraries(corpora, world_size, rank):
    table, _ = corpora[1]
    kw = packed(L=8, num_splits=4, shuffle_seed=1, rank=rank, world_size=world_size,
                blocks_per_epoch=40)
    whole = blocks_of(StreamingDataset(table, reader="local", **kw))
    cut = 2 * (4 // world_size)
    ours = StreamingDataset(table, reader="local", **kw)
    blocks_of(take(iter(ours), cut))
    theirs = Reference(table, **kw)
    theirs.load_state_dict(json.loads(json.dumps(ours.state_dict())))  # as saved to disk
    assert blocks_of(theirs) == whole[cut:]
    ref = Reference(table, **kw)
    take(iter(ref), cut)
    back = StreamingDataset(table, reader="local", **kw)
    back.load_state_dict(ref.state_dict())
    assert blocks_of(back) == whole[cut:]


@pytest.mark.parametrize("kind, eos", [("int32", EOS), ("uint16", EOS), ("int16", 40_000)])
def test_long_documents_in_narrow_types_pack_and_resume_as_the_reference(tmp_path, kind,
                                                                         eos):
    """Documents of 32 tokens or more are joined in the read in the column's own type, and
    the packer keeps it until the batch's copy (``int16`` with an ``eos_id`` it cannot hold
    is widened): the blocks and a resumed state's remainder are still the reference's."""
    import pyarrow as pa

    table, _ = write_token_table(str(tmp_path), 40, 120, 2, shortest=32,
                                 kind=getattr(pa, kind)())
    kw = {**packed(L=48, num_splits=2, shuffle_seed=3, blocks_per_epoch=80), "eos_id": eos}
    whole = blocks_of(Reference(table, **kw))
    ours = StreamingDataset(table, reader="local", read_batch_size=7, **kw)
    first = [b for batch in itertools.islice(ours.iter_batches(4), 5)
             for b in zip(batch["input_ids"].tolist(), batch["doc_ids"].tolist())]
    assert [(tuple(i), tuple(d)) for i, d in first] == whole[:20]
    state = json.loads(json.dumps(ours.state_dict()))
    resumed = StreamingDataset(table, reader="local", read_batch_size=5, **kw)
    resumed.load_state_dict(state)
    assert blocks_of(resumed) == whole[20:]
    theirs = Reference(table, **kw)
    theirs.load_state_dict(state)
    assert blocks_of(theirs) == whole[20:]


def rank_blocks(ds: StreamingDataset, batch: int, steps: int | None = None):
    """(global step, split, block index, block) of the batches ``ds`` yields from its state."""
    k = len(ds._owned)
    start = ds.mode.emitted()[ds._owned[0]]
    step0 = ds.global_step
    out, t = [], 0
    for b, out_batch in enumerate(itertools.islice(ds.iter_batches(batch), steps)):
        for ids, doc in zip(out_batch["input_ids"].tolist(), out_batch["doc_ids"].tolist()):
            out.append((step0 + b, ds._owned[t % k], start + t // k, (tuple(ids), tuple(doc))))
            t += 1
    return out


@settings(max_examples=12, deadline=None, suppress_health_check=FIXTURE)
@given(num_splits=hs.sampled_from([2, 4, 6]), per_split=hs.integers(2, 9),
       per_rank_cycles=hs.integers(1, 2), data=hs.data())
def test_merged_packed_states_resume_every_block_exactly_once_on_every_world_size(
        corpora, num_splits, per_split, per_rank_cycles, data):
    table, _ = corpora[1]
    kw = packed(L=6, num_splits=num_splits, shuffle_seed=2, blocks_per_epoch=per_split * num_splits)
    truth = {(s, i): blk for _, s, i, blk in rank_blocks(
        StreamingDataset(table, reader="local", **kw), num_splits * per_rank_cycles)}
    before_ws = data.draw(hs.sampled_from(valid_world_sizes(num_splits)))
    k = num_splits // before_ws
    steps = data.draw(hs.integers(0, -(-per_split // per_rank_cycles)))
    views = [StreamingDataset(table, reader="local", rank=r, world_size=before_ws, **kw)
             for r in range(before_ws)]
    before = [x for v in views for x in rank_blocks(v, k * per_rank_cycles, steps)]
    merged = lance_ray.merge_state_dicts([v.state_dict() for v in views])
    for after_ws in valid_world_sizes(num_splits):
        after = []
        for r in range(after_ws):
            v = StreamingDataset(table, reader="local", rank=r, world_size=after_ws, **kw)
            v.load_state_dict(merged)
            after += rank_blocks(v, (num_splits // after_ws) * per_rank_cycles)
        seen = Counter((s, i) for _, s, i, _ in before + after)
        assert set(seen) == set(truth) and max(seen.values()) == 1
        assert all(blk == truth[(s, i)] for _, s, i, blk in before + after)


@pytest.mark.parametrize("num_splits", [4, 6])
def test_global_steps_hold_the_same_blocks_on_every_world_size(corpora, num_splits):
    table, _ = corpora[1]
    kw = packed(L=5, num_splits=num_splits, shuffle_seed=4, blocks_per_epoch=7 * num_splits)
    global_batch = 2 * num_splits
    steps = []
    for ws in valid_world_sizes(num_splits):
        per_step: dict[int, Counter] = {}
        for r in range(ws):
            view = StreamingDataset(table, reader="local", rank=r, world_size=ws, **kw)
            for step, _, _, blk in rank_blocks(view, global_batch // ws):
                per_step.setdefault(step, Counter())[blk] += 1
        steps.append(per_step)
    assert all(s == steps[0] for s in steps[1:])
    assert len(steps[0]) == 4  # 7 blocks per split, 2 per step: the last step is short


def test_a_packed_state_between_the_splits_of_a_cycle_is_refused(corpora):
    table, _ = corpora[0]
    ds = StreamingDataset(table, reader="local", **packed(L=4, num_splits=2,
                                                           blocks_per_epoch=8))
    it = iter(ds)
    next(it)
    with pytest.raises(RuntimeError, match="multiple of this rank's 2 splits"):
        ds.state_dict()
    next(it)  # a cycle boundary: a plain JSON state
    assert json.loads(json.dumps(ds.state_dict()))["blocks_emitted_per_split"] == [1, 1]


def test_one_ranks_packed_state_is_refused_on_another_topology_until_merged(corpora):
    table, _ = corpora[0]
    kw = packed(L=4, num_splits=4, blocks_per_epoch=8)
    rank0 = StreamingDataset(table, reader="local", rank=0, world_size=2, **kw)
    next(iter(rank0.iter_batches(2)))
    other = StreamingDataset(table, reader="local", rank=1, world_size=2, **kw)
    with pytest.raises(ValueError, match="merge_state_dicts"):
        other.load_state_dict(rank0.state_dict())
    mid_cycle = {**rank0.state_dict(), "blocks_emitted_per_split": [1, 0, 0, 0]}
    with pytest.raises(ValueError, match="not aligned"):
        StreamingDataset(table, reader="local", rank=0, world_size=2, **kw).load_state_dict(
            mid_cycle)
    with pytest.raises(ValueError, match=r"do not cover splits \[2, 3\]"):
        lance_ray.merge_state_dicts([rank0.state_dict()])
    rank1 = StreamingDataset(table, reader="local", rank=1, world_size=2, **kw)
    with pytest.raises(ValueError, match="different global steps"):
        lance_ray.merge_state_dicts([rank0.state_dict(), rank1.state_dict()])


@pytest.mark.parametrize("change, message", [
    (dict(pack_sequences=0), "pack_sequences must be greater than 0"),
    (dict(eos_id=None), "eos_id is required"),
    (dict(pad_id=None), "pad_id is required"),
    (dict(blocks_per_epoch=None), "blocks_per_epoch is required"),
    (dict(blocks_per_epoch=0), "blocks_per_epoch must be greater than 0"),
    (dict(blocks_per_epoch=7), r"must be divisible by num_splits \(2\)"),
    (dict(blocks_per_epoch="many"), "positive integer or 'auto'"),
    (dict(transform=lambda b: b.to_pylist()), "transform cannot be combined"),
    (dict(columns=["tokens", "id"]), "exactly one"),
    (dict(columns=["id"]), "list-typed token column"),
])
def test_packing_arguments_are_validated_as_in_the_reference(corpora, change, message):
    table, _ = corpora[0]
    kw = {**packed(L=4, num_splits=2, blocks_per_epoch=8), **change}
    with pytest.raises(ValueError, match=message):
        StreamingDataset(table, reader="local", **kw)
    with pytest.raises(ValueError):
        Reference(table, **kw)


@pytest.mark.parametrize("change, message", [
    (dict(pad_id=EOS), "must be a token reserved for padding"),
    (dict(eos_id=1.5), "eos_id must be an integer"),
    # the reference refuses these too, but only at the first read (ValueError there as well)
    (dict(eos_id=2**63), "eos_id 9223372036854775808 does not fit"),
    (dict(pad_id=-2**63 - 1), "pad_id -9223372036854775809 does not fit"),
    (dict(pack_sequences=None, pack_position_ids=True), "require pack_sequences"),
])
def test_packing_arguments_the_reference_accepts_at_construction_are_refused(
        corpora, change, message):
    table, _ = corpora[0]
    kw = {**packed(L=4, num_splits=2, blocks_per_epoch=8), **change}
    if kw["pack_sequences"] is None:
        kw["blocks_per_epoch"] = None
    with pytest.raises(ValueError, match=message):
        StreamingDataset(table, reader="local", **kw)


def test_packed_and_row_states_do_not_load_into_each_other(corpora):
    table, _ = corpora[0]
    rows = StreamingDataset(table, reader="local", num_splits=2, columns=["tokens"])
    blocks = StreamingDataset(table, reader="local", **packed(L=4, num_splits=2,
                                                               blocks_per_epoch=8))
    # the reference's words first (docs/migrating.md), then what to do
    with pytest.raises(ValueError, match="pack_sequences mismatch: checkpoint has 4, dataset "
                                         "has None; this is a packed state"):
        rows.load_state_dict(blocks.state_dict())
    with pytest.raises(ValueError, match="pack_sequences mismatch: checkpoint has None, "
                                         "dataset has 4; .*without pack_sequences"):
        blocks.load_state_dict(rows.state_dict())
    with pytest.raises(ValueError, match="blocks_per_epoch mismatch"):
        StreamingDataset(table, reader="local", **packed(L=4, num_splits=2, blocks_per_epoch=10)
                         ).load_state_dict(blocks.state_dict())


@pytest.mark.parametrize("per_split", [1, 3, 40])
@pytest.mark.parametrize("where", [None, "id % 2 = 0"])
def test_auto_budget_is_exact_and_left_out_tokens_are_counted(corpora, per_split, where):
    table, docs = corpora[2]  # 36 documents (18 even ids): every one is planned on 2 splits
    total = sum(len(d) + 1 for i, d in enumerate(docs) if where is None or i % 2 == 0)
    auto = StreamingDataset(table, reader="local", filter=where,
                            **packed(L=4, num_splits=2, blocks_per_epoch="auto"))
    assert auto.state_dict()["blocks_per_epoch"] == (total // 4) - (total // 4) % 2
    ds = StreamingDataset(table, reader="local", filter=where,
                          **packed(L=4, num_splits=2, blocks_per_epoch=2 * per_split))
    real = sum(int((b["input_ids"] != PAD).sum()) for b in ds)
    assert ds.stats.tokens_left_out == total - real
    assert (ds.stats.tokens_left_out > 0) == (per_split * 2 * 4 < total)


def test_position_ids_and_cu_seqlens_describe_each_blocks_documents(corpora):
    table, _ = corpora[0]
    ds = StreamingDataset(table, reader="local", pack_position_ids=True, pack_cu_seqlens=True,
                          **packed(L=8, num_splits=2, blocks_per_epoch=6))
    batch = next(iter(ds.iter_batches(4)))
    assert batch["input_ids"].shape == batch["position_ids"].shape == (4, 8)
    cu = batch["cu_seqlens"].tolist()
    assert cu[0] == 0 and cu[-1] == 32 and batch["max_seqlen"] == max(np.diff(cu))
    flat_docs = batch["doc_ids"].reshape(-1).tolist()
    for lo, hi in zip(cu[:-1], cu[1:]):  # one segment: one document of one block
        assert len(set(flat_docs[lo:hi])) == 1 and lo // 8 == (hi - 1) // 8
        assert batch["position_ids"].reshape(-1)[lo:hi].tolist() == list(range(hi - lo))


def test_the_loader_without_workers_yields_the_packed_batches(corpora):
    table, _ = corpora[1]
    kw = packed(L=8, num_splits=2, blocks_per_epoch=20)
    loader = lance_ray.StreamingDataLoader(StreamingDataset(table, reader="local", **kw),
                                           batch_size=4)
    assert sum((loader_blocks(b) for b in loader), []) == blocks_of(Reference(table, **kw))


def test_a_collate_fn_gets_the_blocks_that_iteration_yields(corpora):
    """A ``collate_fn`` receives ``[L]`` blocks, as ``__iter__`` yields them: with
    ``default_collate`` the loader's batches are the reference DataLoader's, ``[b, L]``."""
    from torch.utils.data import DataLoader, default_collate

    table, _ = corpora[1]
    kw = packed(L=8, num_splits=2, blocks_per_epoch=20)
    ours = lance_ray.StreamingDataLoader(StreamingDataset(table, reader="local", **kw),
                                         batch_size=4, collate_fn=default_collate)
    theirs = DataLoader(Reference(table, **kw), batch_size=4, collate_fn=default_collate)
    for a, b in itertools.zip_longest(ours, theirs):
        assert a.keys() == b.keys() and a["input_ids"].shape == (4, 8)
        assert all(a[k].equal(b[k]) for k in a)


def loader_blocks(batch) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    return blocks_of([{"input_ids": i, "doc_ids": d}
                      for i, d in zip(batch["input_ids"], batch["doc_ids"])])


@pytest.mark.parametrize("num_workers,num_splits,stop", [(1, 2, 1), (2, 2, 3), (3, 3, 2),
                                                         (2, 4, 0)])
def test_the_loader_with_workers_packs_the_blocks_and_states_of_num_workers_0(
        corpora, num_workers, num_splits, stop):
    """Workers read and arrange documents, the trainer packs: after ``stop`` batches the
    state is the one without workers, and resuming from it (with workers) gives every
    remaining block of the reference's sequence once."""
    table, _ = corpora[1]
    kw = packed(L=8, num_splits=num_splits, blocks_per_epoch=6 * num_splits,
                read_batch_size=5)  # many reads, so every worker reads several
    size = 2 * num_splits
    path = Path(f"packed loader, {num_workers} workers",
                lambda v: iter(lance_ray.StreamingDataLoader(v, batch_size=size,
                                                             num_workers=num_workers)),
                loader_blocks, boundaries=2)
    run = check_resumes_exactly(lambda: StreamingDataset(table, reader="local", **kw), path,
                                also=[stop])
    ref = blocks_of(Reference(table, **{k: v for k, v in kw.items() if k != "read_batch_size"}))
    assert sum(run.whole, []) == ref
    loader = lance_ray.StreamingDataLoader(StreamingDataset(table, reader="local", **kw),
                                           batch_size=size, num_workers=0)
    it = iter(loader)
    take(it, stop)
    assert json.loads(json.dumps(loader.state_dict())) == run.states[stop]
    it.close()


def test_the_ray_reader_packs_the_same_blocks(corpora, ray_session):
    table, docs = corpora[1]
    kw = packed(L=8, num_splits=2, blocks_per_epoch="auto", shuffle_seed=5)
    ours = StreamingDataset(table, reader="ray", read_batch_size=24, **kw)
    budget = ours.state_dict()["blocks_per_epoch"]
    assert blocks_of(ours) == blocks_of(Reference(table, **{**kw, "blocks_per_epoch": budget}))


def test_a_dataloader_workers_share_packs_the_references_blocks_for_that_worker(corpora):
    from dataclasses import dataclass

    @dataclass
    class Worker:
        id: int
        num_workers: int

    table, _ = corpora[1]
    kw = packed(L=8, num_splits=4, blocks_per_epoch=24)
    for worker in (Worker(0, 2), Worker(1, 2)):
        ours = StreamingDataset(table, reader="local", worker_info_override=worker, **kw)
        assert blocks_of(ours) == blocks_of(Reference(table, worker_info_override=worker, **kw))
        with pytest.raises(RuntimeError, match="one DataLoader worker's share"):
            ours.state_dict()


def test_reference_packed_rank_states_merge_as_the_reference_merges_them(corpora):
    table, _ = corpora[1]
    kw = packed(L=8, num_splits=4, blocks_per_epoch=24, shuffle_seed=6)
    refs = [Reference(table, rank=r, world_size=2, **kw) for r in range(2)]
    for ref in refs:
        take(iter(ref), 2 * 3)  # three cycles of two splits
    states = [ref.state_dict() for ref in refs]
    merged = lance_ray.merge_state_dicts(states)
    assert merged == Reference.merge_state_dicts(states)
    whole = blocks_of(StreamingDataset(table, reader="local", **kw))
    resumed = StreamingDataset(table, reader="local", **kw)
    resumed.load_state_dict(merged)
    assert blocks_of(resumed) == whole[3 * 4:]
    with pytest.raises(ValueError, match="not captured at the same global step"):
        lance_ray.merge_state_dicts([states[0], Reference(table, rank=1, world_size=2,
                                                          **kw).state_dict()])


def test_coordinator_views_take_the_runs_packing_arguments_from_the_coordinator():
    """Refused before any coordinator is looked up: no Ray is needed to learn it."""
    with pytest.raises(ValueError, match="packing belongs to the run.*Coordinator.create"):
        StreamingDataset.from_coordinator("run", rank=0, world_size=1, pack_sequences=8,
                                          eos_id=EOS, pad_id=PAD, blocks_per_epoch=8)
    with pytest.raises(TypeError, match="unexpected keyword arguments: shuffle_sed"):
        StreamingDataset.from_coordinator("run", rank=0, world_size=1, shuffle_sed=1)


def test_uint64_token_ids_beyond_int64_are_refused_not_wrapped(tmp_path):
    import lancedb
    import pyarrow as pa

    docs = [[5, 6, 7], [8, 2**63 + 7, 9]]
    table = lancedb.connect(str(tmp_path)).create_table("t", pa.table({
        "id": [0, 1], "tokens": pa.array(docs, pa.list_(pa.uint64()))}))
    kw = packed(L=4, num_splits=1, shuffle=False, blocks_per_epoch=2)
    for read in (list, lambda ds: list(ds.iter_batches(1))):
        with pytest.raises(ValueError, match="token id 9223372036854775815 does not fit"):
            read(StreamingDataset(table, reader="local", **kw))
    with pytest.raises(ValueError):
        list(Reference(table, **kw))
