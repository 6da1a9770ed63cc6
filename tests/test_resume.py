"""Resume, elasticity and epoch invariants of ``lance_ray.StreamingDataset``.

Every property runs the real datasets (``reader="local"``) over real Lance tables, in both
plan modes (``plan_args`` draws ``plan="lancedb"`` or ``plan="index"``):

* a checkpoint merged from every rank, resumed on any world size, loses and repeats nothing;
* with a global batch that is a multiple of ``num_splits`` the sample set of every global
  step is independent of the world size, before and after a resume;
* a rank's own state resumes that rank exactly;
* ``StreamingDataLoader`` batches do not depend on ``num_workers`` and its checkpoints
  count only the batches handed to the trainer;
* iterating past the end of an epoch moves to the next epoch's plan.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import open_table
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import lance_ray
from lance_ray import StreamingDataLoader, merge_state_dicts, valid_world_sizes
from lance_ray.plan.splits import PLAN_MODES

TABLES = ((37, 1), (250, 2), (1000, 3))
FILTERS = (None, "id % 3 != 0", "x < 100")
# Highly composite split counts, so that most draws have several world sizes.
SPLITS = (1, 2, 3, 4, 6, 8, 12)

PROPERTY = settings(
    deadline=None,
    max_examples=25,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
SMALL_PROPERTY = settings(PROPERTY, max_examples=12)
# Resumes on every world size of the plan: the costliest example.
RESUME_EVERYWHERE = settings(PROPERTY, max_examples=20)



@st.composite
def plan_args(draw: st.DrawFn) -> tuple[tuple[int, int], dict[str, Any]]:
    """A table and the arguments that fix the split plan (not the topology)."""
    table = draw(st.sampled_from(TABLES))
    kw = {
        "num_splits": draw(st.sampled_from(SPLITS)),
        "shuffle": draw(st.booleans()),
        "shuffle_seed": draw(st.integers(0, 2**32 - 1)),
        "epoch": draw(st.integers(0, 3)),
        "shuffle_clump_size": draw(st.one_of(st.none(), st.integers(1, 64))),
        "filter": draw(st.sampled_from(FILTERS)),
        "read_batch_size": draw(st.integers(16, 300)),
        "plan": draw(st.sampled_from(PLAN_MODES)),
    }
    return table, kw


def make(table, kw: dict[str, Any], *, rank: int = 0, world_size: int = 1,
         **extra: Any) -> lance_ray.StreamingDataset:
    return lance_ray.StreamingDataset(table, reader="local", rank=rank, world_size=world_size,
                                      **{**kw, **extra})


def ranks(table, kw: dict[str, Any], world_size: int) -> list[lance_ray.StreamingDataset]:
    return [make(table, kw, rank=r, world_size=world_size) for r in range(world_size)]


def ids(ds: lance_ray.StreamingDataset) -> list[int]:
    """Every remaining row id of ``ds``, by direct iteration."""
    return [row["id"] for row in ds]


def batches(ds: lance_ray.StreamingDataset, batch_size: int,
            steps: int | None = None) -> list[list[int]]:
    """The id lists of the next ``steps`` batches (all remaining when None)."""
    it = ds.iter_batches(batch_size)
    out = [b["id"].tolist() for b in itertools.islice(it, steps)]
    it.close()
    return out


def global_steps(per_rank: list[list[list[int]]]) -> list[set[int]]:
    """Global step i = the union of every rank's i-th batch (ranks finish together)."""
    counts = {len(r) for r in per_rank}
    assert len(counts) == 1, f"ranks made different numbers of batches: {counts}"
    return [set().union(*(set(r[i]) for r in per_rank)) for i in range(counts.pop())]


def checkpoint(datasets: list[lance_ray.StreamingDataset]) -> dict[str, Any]:
    """Every rank's state, through JSON (as a checkpoint file would carry it), merged."""
    return merge_state_dicts([json.loads(json.dumps(ds.state_dict())) for ds in datasets])


def epoch_ids(table, kw: dict[str, Any]) -> list[int]:
    """The sorted row ids of the epoch's plan: an uninterrupted one-rank run."""
    return sorted(ids(make(table, kw)))


def assert_is_the_epoch(seen: list[int], epoch: list[int], what: str) -> None:
    dups = sorted(i for i, c in Counter(seen).items() if c > 1)
    lost = sorted(set(epoch) - set(seen))
    alien = sorted(set(seen) - set(epoch))
    assert not (dups or lost or alien), (
        f"{what}: {len(dups)} duplicated {dups[:10]}, {len(lost)} lost {lost[:10]}, "
        f"{len(alien)} not in the epoch {alien[:10]}"
    )
    assert sorted(seen) == epoch


# ----------------------------------------------------------------------- a. no loss, no dup


@RESUME_EVERYWHERE
@given(args=plan_args(), pick=st.integers(0, 5), batch_size=st.integers(1, 64),
       cut=st.floats(0, 1, exclude_max=True))
@example(  # split 0 complete, split 1 one row short; rank 0 of 2 owns only split 0
    args=((37, 1), {"num_splits": 2, "shuffle": False, "shuffle_seed": 0, "epoch": 0,
                    "shuffle_clump_size": None, "filter": None, "read_batch_size": 64}),
    pick=0, batch_size=1, cut=0.98,
)
def test_consumed_before_plus_yielded_after_is_the_epoch_on_every_world_size(
        table_factory, args, pick, batch_size, cut):
    shape, kw = args
    table = open_table(table_factory, shape, kw)
    sizes = valid_world_sizes(kw["num_splits"])
    world_size = sizes[pick % len(sizes)]
    run = ranks(table, kw, world_size)
    # A mid-epoch checkpoint: at least one sample of the epoch is still unread.
    steps = int(cut * -(-len(run[0]) // batch_size))

    before = [i for ds in run for b in batches(ds, batch_size, steps) for i in b]
    merged = checkpoint(run)
    assert sum(merged["samples_consumed_per_split"]) == len(before)
    epoch = epoch_ids(table, kw)

    for new_world_size in sizes:
        after: list[int] = []
        for ds in ranks(table, kw, new_world_size):
            ds.load_state_dict(merged)
            after += ids(ds)
        assert_is_the_epoch(before + after, epoch,
                            f"{world_size} ranks x {steps} steps of {batch_size}, "
                            f"resumed on {new_world_size} ranks")


def test_rank_whose_splits_are_done_after_an_elastic_resume_stays_in_the_epoch(table_factory):
    """Minimal case of the invariant above: resuming must not jump one rank to epoch + 1.

    One rank of 1, 2 splits of 18 rows: after 35 of 36 rows split 0 is complete and split 1
    has one row left. Resumed on 2 ranks, rank 0 owns only the complete split. It has nothing
    left of epoch 0; it must not start epoch 1 while rank 1 still reads epoch 0.
    """
    table = table_factory(37, 1)
    kw = {"num_splits": 2, "shuffle": False}
    one = make(table, kw)
    before = [row["id"] for row in itertools.islice(iter(one), 35)]
    merged = checkpoint([one])
    assert merged["samples_consumed_per_split"] == [18, 17]

    rank0, rank1 = ranks(table, kw, 2)
    for ds in (rank0, rank1):
        ds.load_state_dict(merged)
    after0, after1 = ids(rank0), ids(rank1)
    assert after1 == [35]
    assert (rank0.epoch, len(after0)) == (0, 0), (
        f"rank 0 moved to epoch {rank0.epoch} and yielded {len(after0)} rows of it"
    )
    assert sorted(before + after0 + after1) == epoch_ids(table, kw)


# ----------------------------------------------------------------------- b, c. global steps


@st.composite
def aligned_args(draw: st.DrawFn):
    """A plan and a global batch G that is a multiple of num_splits."""
    shape, kw = draw(plan_args())
    return shape, kw, kw["num_splits"] * draw(st.integers(1, 4))


@SMALL_PROPERTY
@given(args=aligned_args())
def test_global_step_sample_sets_do_not_depend_on_world_size(table_factory, args):
    shape, kw, global_batch = args
    table = open_table(table_factory, shape, kw)
    single = global_steps([batches(make(table, kw), global_batch)])
    for world_size in valid_world_sizes(kw["num_splits"])[1:]:
        per_rank = [batches(ds, global_batch // world_size)
                    for ds in ranks(table, kw, world_size)]
        assert global_steps(per_rank) == single, f"world_size {world_size}, G {global_batch}"


@PROPERTY
@given(args=aligned_args(), data=st.data())
def test_global_steps_after_an_aligned_resume_equal_the_uninterrupted_steps(
        table_factory, args, data):
    shape, kw, global_batch = args
    table = open_table(table_factory, shape, kw)
    sizes = valid_world_sizes(kw["num_splits"])
    world_size = data.draw(st.sampled_from(sizes), "world_size")
    new_world_size = data.draw(st.sampled_from(sizes), "new_world_size")
    uninterrupted = global_steps([batches(make(table, kw), global_batch)])
    steps = data.draw(st.integers(0, len(uninterrupted) - 1), "steps")

    run = ranks(table, kw, world_size)
    before = global_steps([batches(ds, global_batch // world_size, steps) for ds in run])
    merged = checkpoint(run)
    resumed = ranks(table, kw, new_world_size)
    for ds in resumed:
        ds.load_state_dict(merged)
    after = global_steps([batches(ds, global_batch // new_world_size) for ds in resumed])
    assert before == uninterrupted[:steps]
    assert after == uninterrupted[steps:]


# ----------------------------------------------------------------------- d. own state


def draw_rank(data: st.DataObject, kw: dict) -> tuple[int, int]:
    """A world size valid for the plan's splits, and a rank in it."""
    world_size = data.draw(st.sampled_from(valid_world_sizes(kw["num_splits"])), "world_size")
    return world_size, data.draw(st.integers(0, world_size - 1), "rank")


@PROPERTY
@given(args=plan_args(), data=st.data())
def test_rank_state_resumes_the_same_rank_exactly_without_merging(table_factory, args, data):
    shape, kw = args
    table = open_table(table_factory, shape, kw)
    world_size, rank = draw_rank(data, kw)
    batch_size = data.draw(st.integers(1, 64), "batch_size")
    new_batch_size = data.draw(st.integers(1, 64), "new_batch_size")

    full = ids(make(table, kw, rank=rank, world_size=world_size))
    first = make(table, kw, rank=rank, world_size=world_size)
    steps = data.draw(st.integers(0, -(-len(full) // batch_size) - 1), "steps")
    head = [i for b in batches(first, batch_size, steps) for i in b]
    state = json.loads(json.dumps(first.state_dict()))

    again = make(table, kw, rank=rank, world_size=world_size)
    again.load_state_dict(state)
    assert again.samples_remaining == len(full) - len(head)
    rest = [i for b in batches(again, new_batch_size) for i in b]
    assert head + rest == full


# ----------------------------------------------------------------------- e. DataLoader
#
# The num_workers=2 runs use the default (fork) start method, as StreamingDataLoader does, in
# a fresh interpreter: forking a process in which Ray was initialised (the ray_session
# fixture, used earlier in the session) intermittently kills or hangs the forked workers.


def loader_ids(loader: StreamingDataLoader, count: int | None = None) -> list[list[int]]:
    it = iter(loader)
    try:
        return [b["id"].tolist() for b in itertools.islice(it, count)]
    finally:
        it.close()


def run_loader_jobs(jobs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Run each job's StreamingDataLoader in this process; batches and the state after them.

    A job takes ``take`` batches (all when None), waits for the workers to prefetch more,
    then saves the dataset's state. Called in a child interpreter by ``forked_loaders``.
    """
    out = {}
    for name, job in jobs.items():
        ds = lance_ray.StreamingDataset(job["uri"], table_version=job["version"],
                                        reader="local", rank=job["rank"],
                                        world_size=job["world_size"], **job["kw"])
        loader = StreamingDataLoader(ds, job["batch_size"], num_workers=job["num_workers"],
                                     timeout=60)
        it = iter(loader)
        try:
            got = [b["id"].tolist() for b in itertools.islice(it, job["take"])]
            if job["take"] is not None:
                time.sleep(0.3)  # let the workers prefetch further batches: they must not count
            out[name] = {"batches": got, "state": ds.state_dict()}
        finally:
            it.close()
    return out


LOADER_CONFIGS = {
    "S4-W1-b8": {"shape": (250, 2), "kw": {"num_splits": 4, "shuffle_seed": 5,
                                           "read_batch_size": 16},
                 "rank": 0, "world_size": 1, "batch_size": 8, "take": None},
    "S6-rank1of3-b10-filter": {"shape": (1000, 3),
                               "kw": {"num_splits": 6, "shuffle_seed": 9, "epoch": 2,
                                      "shuffle_clump_size": 8, "filter": "id % 3 != 0",
                                      "read_batch_size": 50},
                               "rank": 1, "world_size": 3, "batch_size": 10, "take": None},
    # 5 batches of 7 over 4 splits: the checkpoint falls mid-cycle.
    "checkpoint": {"shape": (250, 2), "kw": {"num_splits": 4, "shuffle_seed": 21,
                                             "read_batch_size": 8},
                   "rank": 0, "world_size": 1, "batch_size": 7, "take": 5},
}

_CHILD = (
    "import json, sys; import test_resume; "
    "print(json.dumps(test_resume.run_loader_jobs(json.loads(sys.argv[1]))))"
)


@pytest.fixture(scope="module", autouse=True)
def forked_loader_child(table_factory) -> Iterator[subprocess.Popen]:
    """Start every LOADER_CONFIGS job with num_workers=2 (fork) in one fresh interpreter.

    It starts with the module, so it runs while the properties above do.
    """
    jobs = {}
    for name, cfg in LOADER_CONFIGS.items():
        table = table_factory(*cfg["shape"])
        jobs[name] = {**{k: v for k, v in cfg.items() if k != "shape"}, "num_workers": 2,
                      "uri": table.to_lance().uri, "version": table.version}
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, json.dumps(jobs)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (str(Path(__file__).parent), os.environ.get("PYTHONPATH")) if p)},
    )
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.communicate()


@pytest.fixture(scope="module")
def forked_loaders(forked_loader_child: subprocess.Popen) -> dict[str, dict[str, Any]]:
    """The results of ``forked_loader_child``: batches and state of each job."""
    out, err = forked_loader_child.communicate(timeout=300)
    assert forked_loader_child.returncode == 0, f"loader child failed:\n{err[-4000:]}"
    return json.loads(out.strip().splitlines()[-1])


def loader_config(table_factory, name: str) -> tuple[Any, dict[str, Any]]:
    cfg = LOADER_CONFIGS[name]
    return table_factory(*cfg["shape"]), cfg


@pytest.mark.parametrize("name", ["S4-W1-b8", "S6-rank1of3-b10-filter"])
def test_loader_batches_do_not_depend_on_num_workers(table_factory, forked_loaders, name):
    table, cfg = loader_config(table_factory, name)
    topology = {"rank": cfg["rank"], "world_size": cfg["world_size"]}
    direct = batches(make(table, cfg["kw"], **topology), cfg["batch_size"])
    in_process = loader_ids(StreamingDataLoader(make(table, cfg["kw"], **topology),
                                                cfg["batch_size"], num_workers=0))
    assert in_process == direct, "num_workers=0"
    assert forked_loaders[name]["batches"] == direct, "num_workers=2"


def test_loader_checkpoint_counts_only_returned_batches_and_resumes_on_other_num_workers(
        table_factory, forked_loaders):
    table, cfg = loader_config(table_factory, "checkpoint")
    batch_size, taken = cfg["batch_size"], cfg["take"]
    full = loader_ids(StreamingDataLoader(make(table, cfg["kw"]), batch_size))
    forked = forked_loaders["checkpoint"]
    state = forked["state"]
    assert forked["batches"] == full[:taken]
    # Prefetched batches never count: exactly the returned samples are consumed.
    assert sum(state["samples_consumed_per_split"]) == taken * batch_size

    resumed = make(table, cfg["kw"])
    resumed.load_state_dict(state)
    assert loader_ids(StreamingDataLoader(resumed, batch_size, num_workers=0)) == full[taken:]


# ----------------------------------------------------------------------- f. epochs


@SMALL_PROPERTY
@given(args=plan_args(), data=st.data())
def test_iterating_an_exhausted_epoch_yields_the_next_epochs_plan(table_factory, args, data):
    shape, kw = args
    table = open_table(table_factory, shape, kw)
    world_size, rank = draw_rank(data, kw)
    batch_size = data.draw(st.integers(1, 64), "batch_size")
    epoch = kw["epoch"]

    def fresh(e: int) -> list[int]:
        return ids(make(table, kw, rank=rank, world_size=world_size, epoch=e))

    ds = make(table, kw, rank=rank, world_size=world_size)
    assert ids(ds) == fresh(epoch)
    second = [i for b in batches(ds, batch_size) for i in b]  # iter_batches path
    assert ds.epoch == epoch + 1
    assert second == fresh(epoch + 1)
    assert ids(ds) == fresh(epoch + 2)  # direct path after an exhausted iter_batches


def test_loader_over_an_exhausted_epoch_yields_the_next_epoch(table_factory):
    table = table_factory(250, 2)
    kw = {"num_splits": 4, "shuffle_seed": 8}
    loader = StreamingDataLoader(make(table, kw), 16)
    # len() is what the next iteration yields: after an epoch, the whole next epoch
    assert len(loader) == 16
    first = loader_ids(loader)
    assert len(loader) == 16
    second = loader_ids(loader)
    assert [i for b in first for i in b] == ids(make(table, kw))
    assert [i for b in second for i in b] == ids(make(table, kw, epoch=1))
    assert loader.streaming_dataset.epoch == 1
    assert len(first) == len(second) == 16


def test_set_epoch_switches_to_that_epochs_plan_from_its_start(table_factory):
    table = table_factory(250, 2)
    kw = {"num_splits": 6, "shuffle_seed": 13, "shuffle_clump_size": 4}
    plans = {e: ids(make(table, kw, epoch=e)) for e in (0, 1, 3)}
    assert plans[0] != plans[1] != plans[3]

    ds = make(table, kw)
    head = [row["id"] for row in itertools.islice(iter(ds), 10)]
    ds.set_epoch(0)  # already on epoch 0: progress is kept
    assert head + ids(ds) == plans[0]

    ds.set_epoch(3)
    assert ds.epoch == 3
    assert ids(ds) == plans[3]
    ds.set_epoch(1)
    partial = [row["id"] for row in itertools.islice(iter(ds), 7)]
    ds.set_epoch(0)  # leaving epoch 1 part-read restarts epoch 0 from its start
    assert ids(ds) == plans[0]
    assert partial == plans[1][:7]
    assert ds.state_dict()["epoch"] == 0
