"""``Coordinator.create`` over a mixture, on the session's real Ray cluster and real Lance
tables: the coordinator's state is the checkpoint route's merged state, a restarted view
resumes on its own, and a resize mid-epoch delivers each remaining sample of each source
exactly once, in proportion. A sample is ``(source, id)``."""

from __future__ import annotations

import contextlib
from fractions import Fraction

import pytest
import ray
from conftest import wait_sealed

import lance_ray
from lance_ray import Coordinator, MixtureDataset, Source
from lance_ray.cli.status import print_status
from lance_ray.state.ledger import StaleReport
from lance_ray.state.reporting import ReportPolicy
from lance_ray.stream.mixing import Schedule

NUM_SPLITS = 4
WEIGHTS = (3, 2, 1)
SIZES = (96, 64, 32)  # in proportion: a first_exhausted epoch reads every source whole
GLOBAL_BATCH = 12


@pytest.fixture
def tables(table_factory):
    return [table_factory(n) for n in SIZES]


@pytest.fixture
def make(ray_session, tables, tmp_path):
    """``make(name, world_size, stop=...)``: a mixture coordinator of ``tables``, reporting
    every global step; all are stopped at the end."""
    made: list[Coordinator] = []

    def create(name: str, world_size: int, of=None, **kw):
        made.append(Coordinator.create(
            [Source(t, weight=w) for t, w in zip(of or tables, WEIGHTS)], name,
            storage_path=str(tmp_path / "store"), world_size=world_size,
            num_splits=NUM_SPLITS, shuffle_seed=3,
            report_policy=ReportPolicy(every_batches=1), **kw))
        return made[-1]

    yield create
    for c in made:
        with contextlib.suppress(Exception):
            c.kill()


def plain(tables, world_size: int, stop: str = "first_exhausted") -> list[MixtureDataset]:
    """The checkpoint route's ranks of the same mixture."""
    return [MixtureDataset([Source(t, weight=w) for t, w in zip(tables, WEIGHTS)],
                           num_splits=NUM_SPLITS, shuffle_seed=3, rank=r,
                           world_size=world_size, stop=stop, columns=["id"], reader="local")
            for r in range(world_size)]


def attached(coord: Coordinator, world_size: int) -> list[MixtureDataset]:
    return [coord.view(r, world_size, columns=["id"], reader="local", read_batch_size=64)
            for r in range(world_size)]


def step(iterators, steps: int | None = None) -> list[list[list[tuple[int, int]]]]:
    """Global steps of ranks in lockstep: per step, each rank's samples."""
    out = []
    while steps is None or len(out) < steps:
        batches = [next(it, None) for it in iterators]
        if all(b is None for b in batches):
            break
        out.append([[] if b is None else list(zip(b["source"].tolist(), b["id"].tolist()))
                    for b in batches])
    return out


def batches(views, world_size: int):
    return [v.iter_batches(GLOBAL_BATCH // world_size) for v in views]


def flat(steps) -> list[tuple[int, int]]:
    return [s for per_rank in steps for rank in per_rank for s in rank]


def assert_within_one(sources: list[int]) -> None:
    counts, w = [0] * len(WEIGHTS), Schedule(WEIGHTS).weights
    for k, s in enumerate(sources, 1):
        counts[s] += 1
        assert all(abs(c - Fraction(k * wi, sum(w))) < 1 for c, wi in zip(counts, w)), \
            (k, counts)


def test_the_coordinators_state_is_the_merged_checkpoint_route_state(make, tables, capsys):
    coord = make("mix_state", 2)
    views = attached(coord, 2)
    got = step(batches(views, 2), 5)
    ours = plain(tables, 2)
    assert got == step(batches(ours, 2), 5)  # the same sequence as the checkpoint route
    status = wait_sealed(coord, 5)
    assert status["mixture"] and status["sealed_rows"] == len(flat(got)) == 5 * GLOBAL_BATCH
    print_status({"namespace": coord.namespace, **status})  # `lance_ray status NAME`
    assert "sources " in capsys.readouterr().out  # a mixture has no one table version
    merged = lance_ray.merge_state_dicts([ds.state_dict() for ds in ours])
    assert coord.state_dict() == merged
    assert lance_ray.merge_state_dicts([v.state_dict() for v in views]) == merged
    # A plain MixtureDataset loads it, here on one rank: the rest of the epoch, once each.
    one = plain(tables, 1)[0]
    one.load_state_dict(coord.state_dict())
    rest = flat(step(batches([one], 1)))
    assert not set(flat(got)) & set(rest) and len(set(rest)) == len(rest)
    assert len(flat(got)) + len(rest) == sum(SIZES)


@pytest.mark.parametrize(("stop", "before", "after"), [
    ("first_exhausted", 4, 2), ("all_exhausted", 2, 1)])
def test_a_resize_mid_epoch_delivers_each_remaining_sample_once_in_proportion(
        make, tables, stop, before, after):
    coord = make(f"mix_resize_{stop}", before, stop=stop)
    views = attached(coord, before)
    running = batches(views, before)
    first = step(running, 5)
    wait_sealed(coord, 5)
    coord.resize(after)  # the new generation is published on every node before it returns
    with pytest.raises(StaleReport):
        next(running[0])  # the old world size stops before its next batch
    rest = step(batches(attached(coord, after), after))
    # Exactly what the checkpoint route's elastic resume delivers from the merged step 5.
    ours = plain(tables, before, stop)
    assert step(batches(ours, before), 5) == first
    resumed = plain(tables, after, stop)
    merged = lance_ray.merge_state_dicts([ds.state_dict() for ds in ours])
    for ds in resumed:
        ds.load_state_dict(merged)
    assert step(batches(resumed, after), None) == rest
    seen = flat(first) + flat(rest)
    for i, n in enumerate(SIZES):  # each sample of each source's pass once, before repeats
        ids = [x for s, x in seen if s == i]
        if stop == "all_exhausted":  # the pass is read whole; a next pass may have begun
            assert sorted(ids[:n]) == list(range(n)) and len(set(ids[n:])) == len(ids[n:])
        else:  # the epoch ends when the first source runs out under its share
            assert len(set(ids)) == len(ids) and n - len(ids) <= 2
    for r in range(after):  # every new rank holds the mix from the resume point on
        assert_within_one([s for per_rank in rest for s, _ in per_rank[r]])
    assert coord.status()["world_size"] == after


def test_a_restarted_view_resumes_from_the_coordinator_on_its_own(make, tables):
    coord = make("mix_restart", 2)
    first = step(batches(attached(coord, 2), 2), 4)
    wait_sealed(coord, 4)
    ray.kill(coord.handle, no_restart=False)  # the actor restarts from its sealed file
    views = attached(coord, 2)  # restarted trainers: no state passed in
    assert [v.global_step for v in views] == [4, 4]
    rest = step(batches(views, 2))
    assert first + rest == step(batches(plain(tables, 2), 2))  # as if never interrupted
    wait_sealed(coord, len(first) + len(rest))
    # The next epoch: once every rank is on it, a restarted view starts it from zero.
    next_epoch = step(batches(views, 2), 1)
    assert [v.epoch for v in views] == [1, 1] and coord.status()["epoch"] == 1
    wait_sealed(coord, 1)
    again = attached(coord, 2)
    assert [(v.epoch, v.global_step) for v in again] == [(1, 1), (1, 1)]
    assert step(batches(again, 2), 1) != next_epoch


def test_a_restart_keeps_a_ranks_report_of_a_step_not_sealed_yet(make, tables):
    """Rank 0's checkpoint of a step is recorded and durable, then the actor restarts
    before rank 1 reports it: the step still seals (rank 0 never sends it again)."""
    import ray

    coord = make("mix_restart_pending", 2)
    views = attached(coord, 2)
    its = batches(views, 2)
    step(its, 3)
    next(its[0])
    views[0].state_dict()
    ray.kill(coord.handle, no_restart=False)
    next(its[1])
    views[1].state_dict()
    assert coord.state_dict() == lance_ray.merge_state_dicts([v.state_dict() for v in views])
    assert coord.state_dict()["lance_ray_mixture"]["global_step"] == 4


def test_a_stale_view_of_another_size_is_refused_after_a_restart(make, tables):
    """Views of the run's world size have reported, then Ray restarts the actor: a view of
    another size is still stale (it would resize the run under them) until a restore."""
    coord = make("mix_guarded", 2)
    views = attached(coord, 2)
    step(batches(views, 2), 2)
    for v in views:
        v.state_dict()  # recorded, and written
    ray.kill(coord.handle, no_restart=False)
    with pytest.raises(ValueError, match="views of world size 2 are live"):
        coord.view(0, 4, columns=["id"], reader="local")
    coord.load_state_dict(coord.state_dict())  # a restarted group restores its checkpoint
    assert coord.view(0, 4, columns=["id"], reader="local").world_size == 4


def test_an_attached_view_refuses_sample_by_sample_iteration(make, tables):
    """Samples read one by one make no global step: the coordinator would never hear of
    them, so such a read is refused and the batch routes are named."""
    coord = make("mix_one_by_one", 2)
    view = attached(coord, 2)[0]
    before = coord.state_dict()
    with pytest.raises(RuntimeError, match=r"iter_batches\(batch_size\).*StreamingDataLoader"):
        iter(view)
    assert coord.state_dict() == before


def test_a_checkpoint_loads_into_the_coordinator_and_other_states_are_refused(make, tables):
    coord = make("mix_load", 2)
    ours = plain(tables, 2)
    step(batches(ours, 2), 3)
    merged = lance_ray.merge_state_dicts([ds.state_dict() for ds in ours])
    coord.load_state_dict(merged)  # e.g. a checkpoint-route run moving to a coordinator
    views = attached(coord, 2)
    assert step(batches(views, 2), 2) == step(batches(ours, 2), 2)
    with pytest.raises(ValueError, match="merge the ranks' states"):
        coord.load_state_dict(ours[0].state_dict())
    other = MixtureDataset([Source(t, weight=1) for t in tables], num_splits=NUM_SPLITS,
                           shuffle_seed=3, columns=["id"], reader="local")
    with pytest.raises(ValueError, match="weights mismatch"):
        coord.load_state_dict(other.state_dict())


def test_steps_sealed_before_a_restore_are_not_handed_out_after_it(make, tables):
    coord = make("mix_restore_history", 2)
    views = batches(attached(coord, 2), 2)
    step(views, 3)
    wait_sealed(coord, 3)
    early = coord.state_dict()  # step 3 (reports may coalesce: not every step is sealed)
    step(views, 3)
    wait_sealed(coord, 6)
    coord.state_dict(step=6)
    coord.load_state_dict(early)
    with pytest.raises(ValueError, match="step 6 of epoch 0 is not sealed"):
        coord.state_dict(step=6)
    assert coord.state_dict(step=3) == early


def test_a_failed_create_of_a_live_mixtures_name_leaves_that_run_running(make, tables,
                                                                         table_factory):
    live = make("busy-mix", 2)
    tiny = table_factory(2)  # another third source, and too small: this create fails
    with pytest.raises(ValueError, match="larger than the number of rows"):
        make("busy-mix", 2, of=[*tables[:2], tiny])
    for source in live.sources:
        assert ray.get(source.handle.describe.remote())  # still alive
    ds = live.view(0, 2, columns=["id"], reader="local")
    assert len(next(ds.iter_batches(4))["id"]) == 4


def test_a_failed_mixture_create_leaves_no_version_tag_on_its_sources(make, tables,
                                                                     table_factory):
    tiny = table_factory(2)  # its third source is too small: the create fails after two
    with pytest.raises(ValueError, match="larger than the number of rows"):
        make("tagless-mix", 2, of=[*tables[:2], tiny])
    for t in (*tables[:2], tiny):
        assert not [tag for tag in t.to_lance().tags.list() if "tagless-mix" in tag]


def test_a_mixture_coordinator_refuses_what_belongs_to_its_sources(ray_session, tables,
                                                                   tmp_path):
    sources = [Source(t) for t in tables]
    for kw in ({"filter": "id > 3"}, {"columns": ["id"]},
               {"pack_sequences": 16, "eos_id": 1, "pad_id": 0, "columns": ["tokens"],
                "blocks_per_epoch": 4}):
        with pytest.raises(ValueError, match="a mixture coordinator does not take"):
            Coordinator.create(sources, "mix_refused", storage_path=str(tmp_path),
                               world_size=1, **kw)
    with pytest.raises(ValueError, match="integer shuffle_seed"):
        Coordinator.create(sources, "mix_refused", storage_path=str(tmp_path), world_size=1,
                           shuffle_seed=None)
    with pytest.raises(ValueError, match="sources 0 and 3 are the same table"):
        Coordinator.create([*sources, Source(tables[0])], "mix_refused",
                           storage_path=str(tmp_path), world_size=1)
    for name in ("mix_refused", "mix_refused.source0"):  # nothing of it was left alive
        with pytest.raises(ValueError, match="no coordinator named"):
            Coordinator.get(name)
    with pytest.raises(ValueError, match="stop is a mixture's argument"):
        Coordinator.create(tables[0], "mix_refused", storage_path=str(tmp_path),
                           world_size=1, stop="all_exhausted")


@ray.remote(num_cpus=0)
class MixRank:
    """One rank of a mixture coordinator's run in its own process (and node)."""

    def __init__(self, name: str, rank: int, world_size: int):
        self.ds = MixtureDataset.from_coordinator(name, rank=rank, world_size=world_size,
                                                  columns=["id"], reader="local")
        self.batches = self.ds.iter_batches(GLOBAL_BATCH // world_size)

    def next(self) -> list[tuple[int, int]] | None:
        b = next(self.batches, None)
        return None if b is None else list(zip(b["source"].tolist(), b["id"].tolist()))

    def state(self) -> dict:
        return self.ds.state_dict()


def test_ranks_on_two_nodes_seal_their_merged_state_and_a_restarted_group_resumes(
        make, tables, ray_cluster):
    coord = make("mix_nodes", 2)
    ranks = [MixRank.options(resources={res: 0.01}).remote("mix_nodes", r, 2)
             for r, res in enumerate(("at_head", "at_w1"))]
    first = [ray.get([r.next.remote() for r in ranks]) for _ in range(4)]
    wait_sealed(coord, 4)
    assert coord.state_dict() == lance_ray.merge_state_dicts(
        ray.get([r.state.remote() for r in ranks]))
    for r in ranks:  # the whole group dies; new ranks (nodes swapped) pick up on their own
        ray.kill(r)
    ranks = [MixRank.options(resources={res: 0.01}).remote("mix_nodes", r, 2)
             for r, res in enumerate(("at_w1", "at_head"))]
    rest = []
    while True:
        parts = ray.get([r.next.remote() for r in ranks])
        if all(p is None for p in parts):
            break
        rest.append([p or [] for p in parts])
    assert first + rest == step(batches(plain(tables, 2), 2))
    for r in ranks:
        ray.kill(r)


@pytest.mark.parametrize("stop", ["first_exhausted", "all_exhausted"])
def test_a_loader_over_an_attached_view_gives_its_batches_with_any_workers(
        make, table_factory, stop):
    uneven = [table_factory(n) for n in (96, 40, 24)]  # all_exhausted: passes change
    coord = make(f"mix_loader_{stop}", 1, of=uneven, stop=stop)
    expected = step(batches(plain(uneven, 1, stop), 1))
    for workers in (0, 2):
        coord.load_state_dict(coord.initial_state())
        view = coord.view(0, 1, columns=["id"], reader="local")
        loader = lance_ray.StreamingDataLoader(view, GLOBAL_BATCH, num_workers=workers)
        assert step([iter(loader)]) == expected
        assert loader.state_dict() == coord.state_dict()  # every step sealed on one rank


@pytest.fixture(scope="module")
def token_tables(tmp_path_factory):
    """Two token tables; source s, document k: ``[2 + 100 s + k] * (1 + k % 5)``."""
    import lancedb
    import pyarrow as pa

    db = lancedb.connect(str(tmp_path_factory.mktemp("mix_tokens")))
    return [db.create_table(f"d{s}", pa.table({"tokens": pa.array(
        [[2 + 100 * s + k] * (1 + k % 5) for k in range(n)], pa.list_(pa.int32()))}))
        for s, n in enumerate((60, 40))]


def test_a_packed_mixture_over_the_coordinator_packs_and_resizes_as_the_checkpoint_route(
        make, token_tables):
    pack = {"pack_sequences": 16, "eos_id": 1, "pad_id": 0}
    coord = make("mix_packed", 2, of=token_tables, columns=["tokens"], **pack)
    views = [coord.view(r, 2, reader="local") for r in range(2)]
    ours = [MixtureDataset([Source(t, weight=w) for t, w in zip(token_tables, WEIGHTS)],
                           num_splits=NUM_SPLITS, shuffle_seed=3, rank=r, world_size=2,
                           columns=["tokens"], reader="local", **pack) for r in range(2)]

    def blocks(ds, n=None):
        return [b["input_ids"].tolist() for _, b in zip(range(n or 10**9),
                                                          ds.iter_batches(2))]

    assert [blocks(v, 3) for v in views] == [blocks(ds, 3) for ds in ours]
    wait_sealed(coord, 3)
    assert coord.state_dict() == lance_ray.merge_state_dicts([ds.state_dict() for ds in ours])
    again = [coord.view(r, 2, reader="local") for r in range(2)]  # restarted: each rank
    assert [blocks(v, 2) for v in again] == [blocks(ds, 2) for ds in ours]  # at its step
    wait_sealed(coord, 5)
    merged = lance_ray.merge_state_dicts([ds.state_dict() for ds in ours])
    assert coord.state_dict() == merged  # with every rank's carry
    coord.resize(1)
    one = coord.view(0, 1, reader="local")
    alone = MixtureDataset([Source(t, weight=w) for t, w in zip(token_tables, WEIGHTS)],
                           num_splits=NUM_SPLITS, shuffle_seed=3, columns=["tokens"],
                           reader="local", **pack)
    alone.load_state_dict(merged)
    # The carries first, then the rest, as resumed: read through two DataLoader workers.
    loader = lance_ray.StreamingDataLoader(one, 2, num_workers=2)
    assert [b["input_ids"].tolist() for b in loader] == blocks(alone)
    # Its stored run is a packed one of 16 tokens: a new job with other packing (the same
    # sources) must not adopt its progress.
    coord.kill()
    with pytest.raises(Exception, match="another mixture"):
        make("mix_packed", 1, of=token_tables, columns=["tokens"], **{**pack, "pad_id": 3})
