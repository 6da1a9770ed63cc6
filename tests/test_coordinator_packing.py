"""A packed run attached to a coordinator: its sealed state is the merge of the views' own
states (buffers read back from the table), loads in ``lancedb.streaming``, and resumes on
every world size with every block exactly once; ``"auto"`` is counted once, by the actor."""

from __future__ import annotations

from collections import Counter

import pytest
from conftest import coordinators, wait_sealed
from lancedb.streaming import StreamingDataset as Reference
from test_packing import EOS, PAD, blocks_of, rank_blocks, reference_keys

import lance_ray
from lance_ray import StreamingDataset
from lance_ray.driver.handle import Coordinator
from lance_ray.topology import valid_world_sizes

NUM_SPLITS, L, PER_SPLIT = 4, 6, 8
RUN = dict(pack_sequences=L, eos_id=EOS, pad_id=PAD, columns=["tokens"])


@pytest.fixture
def packed_coord(ray_session, token_table, tmp_path):
    with coordinators(token_table[0], str(tmp_path / "store"), num_splits=NUM_SPLITS,
                      shuffle_seed=3, blocks_per_epoch=PER_SPLIT * NUM_SPLITS, **RUN) as make:
        yield lambda name, world_size, **kw: make(name, world_size=world_size, **kw)


def own_views(table, world_size: int, **kw):
    """Views of the same run without a coordinator (checkpointed with merge_state_dicts)."""
    return [StreamingDataset(table, reader="local", rank=r, world_size=world_size,
                             num_splits=NUM_SPLITS, shuffle_seed=3, **RUN, **kw)
            for r in range(world_size)]


def truth(table) -> dict:
    view = own_views(table, 1, blocks_per_epoch=PER_SPLIT * NUM_SPLITS)[0]
    return {(s, i): blk for _, s, i, blk in rank_blocks(view, NUM_SPLITS)}


@pytest.mark.parametrize("steps", [0, 1, 3, PER_SPLIT])
def test_the_sealed_packed_state_is_the_merge_of_the_views_own_and_loads_in_the_reference(
        packed_coord, token_table, steps):
    table = token_table[0]
    coord = packed_coord(f"packed_merge_{steps}", 2)
    views = [coord.view(r, 2, reader="local") for r in range(2)]
    mine = own_views(table, 2, blocks_per_epoch=PER_SPLIT * NUM_SPLITS)
    for v in views + mine:
        rank_blocks(v, 2, steps)
    if steps:
        wait_sealed(coord, steps)
    sealed = coord.state_dict()
    merged = lance_ray.merge_state_dicts([v.state_dict() for v in mine])
    assert reference_keys(sealed) == reference_keys(merged)
    assert merged["pack_buffers"] or not steps  # the buffers were read back, not left out
    whole = blocks_of(Reference(table, num_splits=NUM_SPLITS, shuffle_seed=3,
                                blocks_per_epoch=PER_SPLIT * NUM_SPLITS, **RUN))
    theirs = Reference(table, num_splits=NUM_SPLITS, shuffle_seed=3,
                       blocks_per_epoch=PER_SPLIT * NUM_SPLITS, **RUN)
    theirs.load_state_dict(reference_keys(sealed))
    assert blocks_of(theirs) == whole[4 * steps:]


@pytest.mark.parametrize("before_ws,steps", [(1, 2), (2, 3), (4, 5)])
def test_a_packed_run_resumes_from_the_coordinator_on_every_world_size_exactly_once(
        packed_coord, token_table, before_ws, steps):
    table = token_table[0]
    expected = truth(table)
    coord = packed_coord(f"packed_resize_{before_ws}", before_ws)
    before = [x for r in range(before_ws)
              for x in rank_blocks(coord.view(r, before_ws, reader="local"),
                                   NUM_SPLITS // before_ws, steps)]
    status = wait_sealed(coord, steps)
    assert status["packed"] == {"block_len": L, "sealed_blocks": steps * NUM_SPLITS,
                                "epoch_blocks": PER_SPLIT * NUM_SPLITS}
    checkpoint = coord.state_dict()
    for after_ws in valid_world_sizes(NUM_SPLITS):
        coord.load_state_dict(checkpoint)
        coord.resize(after_ws)
        after = [x for r in range(after_ws)
                 for x in rank_blocks(coord.view(r, after_ws, reader="local"),
                                      NUM_SPLITS // after_ws)]
        seen = Counter((s, i) for _, s, i, _ in before + after)
        assert set(seen) == set(expected) and max(seen.values()) == 1, after_ws
        assert all(blk == expected[(s, i)] for _, s, i, blk in before + after)
        wait_sealed(coord, PER_SPLIT)  # reports are sent fire and forget: the last in time
        assert coord.state_dict()["blocks_emitted_per_split"] == [PER_SPLIT] * NUM_SPLITS


def test_a_restored_mid_epoch_state_is_where_later_buffers_reach_back_to(packed_coord,
                                                                        token_table, tmp_path):
    """A checkpoint of the views' own, loaded into the coordinator, starts every split's
    stream with its buffer; later sealed states read only documents consumed since."""
    table = token_table[0]
    mine = own_views(table, 1, blocks_per_epoch=PER_SPLIT * NUM_SPLITS)[0]
    rank_blocks(mine, NUM_SPLITS, 2)
    coord = packed_coord("packed_restore", 1)
    coord.load_state_dict(mine.state_dict())
    assert reference_keys(coord.state_dict()) == reference_keys(mine.state_dict())
    view = coord.view(0, 1, reader="local")
    got = rank_blocks(view, NUM_SPLITS, 1) + rank_blocks(mine, NUM_SPLITS, 1)
    assert got[:NUM_SPLITS] == got[NUM_SPLITS:]  # the same next step from either
    wait_sealed(coord, 3)
    assert reference_keys(coord.state_dict()) == reference_keys(mine.state_dict())
    run_dir = tmp_path / "store" / "packed_restore"
    assert "starts" not in (run_dir / "coordinator.json").read_text()  # no buffer in it
    assert len(list(run_dir.glob("packed-base-*.json"))) == 1  # written once, by the restore
    coord.kill()  # a new actor reads the base buffers back from its persisted ledger
    again = packed_coord("packed_restore", 1)
    assert reference_keys(again.state_dict()) == reference_keys(mine.state_dict())


def test_one_ranks_unmerged_reference_state_is_refused_and_progress_kept(packed_coord,
                                                                        token_table):
    """A lancedb rank state names no rank, so only its unequal block counts show that it is
    one rank's: the coordinator refuses it as a view does, and keeps its progress."""
    table = token_table[0]
    rank0 = Reference(table, rank=0, world_size=2, num_splits=NUM_SPLITS, shuffle_seed=3,
                      blocks_per_epoch=PER_SPLIT * NUM_SPLITS, **RUN)
    it = iter(rank0)
    for _ in range(4):
        next(it)
    state = rank0.state_dict()
    assert len(set(state["blocks_emitted_per_split"])) > 1
    coord = packed_coord("packed_unmerged", 1)
    before = coord.state_dict()
    with pytest.raises(ValueError, match="not aligned.*merge_state_dicts"):
        coord.load_state_dict(state)
    assert coord.state_dict() == before


def test_auto_is_counted_by_the_coordinator_and_equals_a_views_own_count(packed_coord,
                                                                        token_table):
    table = token_table[0]
    coord = packed_coord("packed_auto", 1, blocks_per_epoch="auto")
    attached = coord.view(0, 1, reader="local")
    own = own_views(table, 1, blocks_per_epoch="auto")[0]
    assert attached.state_dict()["blocks_per_epoch"] == own.state_dict()["blocks_per_epoch"]
    assert ([blk for *_, blk in rank_blocks(attached, NUM_SPLITS)]
            == [blk for *_, blk in rank_blocks(own, NUM_SPLITS)])


def test_packing_is_validated_when_the_run_is_created_and_views_keep_their_outputs(
        packed_coord, token_table, ray_session, tmp_path):
    with pytest.raises(ValueError, match="divisible by num_splits"):
        packed_coord("packed_bad", 1, blocks_per_epoch=NUM_SPLITS + 1)
    with pytest.raises(ValueError, match="columns only with pack_sequences"):
        Coordinator.create(token_table[0], "rows_with_columns", world_size=1,
                           storage_path=str(tmp_path / "s"), columns=["tokens"])
    coord = packed_coord("packed_outputs", 1)
    with pytest.raises(ValueError, match="this run packs column 'tokens'"):
        coord.view(0, 1, columns=["id"])
    batch = next(coord.view(0, 1, reader="local", pack_position_ids=True,
                            pack_cu_seqlens=True).iter_batches(NUM_SPLITS))
    assert {"input_ids", "doc_ids", "position_ids", "cu_seqlens"} <= set(batch)


def test_the_next_epoch_starts_every_split_afresh_in_the_coordinator(packed_coord, token_table):
    table = token_table[0]
    coord = packed_coord("packed_epochs", 1)
    attached = coord.view(0, 1, reader="local")
    own = own_views(table, 1, blocks_per_epoch=PER_SPLIT * NUM_SPLITS)[0]
    for view in (attached, own):
        rank_blocks(view, NUM_SPLITS)  # the whole of epoch 0
        view.set_epoch(1)
    assert rank_blocks(attached, NUM_SPLITS, 2) == rank_blocks(own, NUM_SPLITS, 2)
    wait_sealed(coord, 2)
    state = coord.state_dict()
    assert state["epoch"] == 1 and reference_keys(state) == reference_keys(own.state_dict())


def test_views_on_the_ray_reader_report_the_same_sealed_state(packed_coord, token_table):
    table = token_table[0]
    coord = packed_coord("packed_ray", 2)
    own = own_views(table, 2, blocks_per_epoch=PER_SPLIT * NUM_SPLITS)
    attached = [coord.view(r, 2, reader="ray") for r in range(2)]
    for mine, theirs in zip(attached, own):
        assert rank_blocks(mine, 2, 3) == rank_blocks(theirs, 2, 3)
    wait_sealed(coord, 3)
    merged = lance_ray.merge_state_dicts([v.state_dict() for v in own])
    assert reference_keys(coord.state_dict()) == reference_keys(merged)


def test_the_same_checkpoint_loaded_again_keeps_every_earlier_sealed_step(packed_coord,
                                                                          token_table):
    """Every rank of a restarted group restores the same checkpoint, a no-op: the sealed
    steps still kept for state_dict(step=...) stay what they were (they were rebuilt from a
    replaced base and refused)."""
    from lance_ray.state.reporting import ReportPolicy

    table = token_table[0]
    coord = packed_coord("packed_again", 2, report_policy=ReportPolicy(every_batches=1))
    views = [coord.view(r, 2, reader="local") for r in range(2)]
    mine = own_views(table, 2, blocks_per_epoch=PER_SPLIT * NUM_SPLITS)
    running = [v.iter_batches(NUM_SPLITS // 2) for v in views + mine]
    expected = {}
    for step in range(1, 4):
        for it in running:
            next(it)
        expected[step] = reference_keys(lance_ray.merge_state_dicts(
            [v.state_dict() for v in mine]))
        for v in views:
            v.state_dict()  # every rank's report of this step recorded: the step seals
    wait_sealed(coord, 3)
    coord.load_state_dict(coord.state_dict())
    for step, state in expected.items():
        assert reference_keys(coord.state_dict(step=step)) == state, step


def test_an_attached_packed_view_refuses_batches_that_leave_its_splits_out_of_step(
        packed_coord):
    coord = packed_coord("packed_misaligned", 2)
    view = coord.view(0, 2, reader="local")
    with pytest.raises(ValueError, match="multiple of its 2 splits.*got 3"):
        next(view.iter_batches(3))
    assert coord.status()["sealed_step"] == 0
    assert len(next(view.iter_batches(2))["input_ids"]) == 2  # the view still reads
