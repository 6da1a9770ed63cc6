"""Batches on the device: the pinned pool never overwrites a buffer a copy still reads, a
prefetched batch never counts for checkpoints, ``device="cpu"`` changes nothing, and bad
device arguments fail naming the fix.

The pool and the lookahead run here with CPU stand-ins (a copier whose copies finish late, on
threads of their own); the tests marked ``cuda`` run the same checks with the real pinned
allocator and CUDA copier, and are skipped, with their reason shown, where CUDA is absent.
"""

from __future__ import annotations

import collections
import contextlib
import itertools
import random
import threading
import time
from collections import deque
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from conftest import write_token_table

import lance_ray
from lance_ray.view import dataset as dataset_module
from lance_ray.view import loader as loader_module
from lance_ray.view import placement as placement_module
from lance_ray.view.device import CudaCopier, FeedStats, Stager, one_ahead, pageable, pinned
from lance_ray.view.placement import NO_ACCELERATOR, Placement, loader_placement, placement

try:  # the accelerator machine has no hypothesis: seeded examples run there instead
    from hypothesis import given, settings
    from hypothesis import strategies as st
except ImportError:  # pragma: no cover - CPU machines have it (dev extra)
    given = None

CUDA = torch.cuda.is_available()
needs_cuda = [pytest.mark.cuda,
              pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch.cuda.is_available() "
                                                  "is False); the CPU stand-in variant ran")]


# ----------------------------------------------------------------------------- stand-ins
class SlowCopier:
    """A CPU stand-in for ``CudaCopier``: each copy runs late, on a thread of its own, so a
    host buffer reused too early shows up as corrupted data; a fence is an Event."""

    def __init__(self, delays: list[float] | None = None):
        self.delays = itertools.cycle(delays or [0.0])

    def start(self, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        out, done, delay = torch.empty_like(host), threading.Event(), next(self.delays)

        def copy() -> None:
            time.sleep(delay)
            out.copy_(host)
            done.set()

        threading.Thread(target=copy, daemon=True).start()
        return out, done

    def done(self, fence: Any) -> bool:
        return bool(fence.is_set())

    def wait(self, fence: Any) -> None:
        fence.wait()

    def handover(self, out: torch.Tensor, fence: Any) -> None:
        fence.wait()  # a CPU consumer has no stream to order after the copy


class InstantCopier(SlowCopier):
    """A stand-in whose copies are done when ``start`` returns."""

    def start(self, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        done = threading.Event()
        done.set()
        return host.clone(), done


class LyingCopier(SlowCopier):
    """A broken copier: says every copy is done (to show the property test catches it)."""

    def done(self, fence: Any) -> bool:
        return True

    def wait(self, fence: Any) -> None:
        pass


class SlowCudaCopier(CudaCopier):
    """The real copier with the side stream kept busy before each copy, so copies finish
    late, as the CPU stand-in's do."""

    def __init__(self, delays: list[float]):
        super().__init__(torch.device("cuda", torch.cuda.current_device()))
        self.delays = itertools.cycle(delays or [0.0])

    def start(self, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(int(next(self.delays) * 1e9))  # ~1 GHz cycles
        return super().start(host)


def backend(name: str, delays: list[float]) -> tuple[Any, Any]:
    """(allocate, copier) of the CPU stand-in or of CUDA."""
    if name == "cpu":
        return pageable, SlowCopier(delays)
    return pinned, SlowCudaCopier(delays)


BACKENDS = [pytest.param("cpu", id="cpu-standin"), pytest.param("cuda", marks=needs_cuda)]


# ----------------------------------------------------------------------------- the pool
def make_batch(i: int, n: int) -> dict[str, Any]:
    """Batch ``i`` of ``n`` rows, nested as lance_ray's batches are; every value tells ``i``."""
    return {"v": torch.arange(n * 3, dtype=torch.float32).reshape(n, 3) + 1000 * i,
            "ragged": {"values": torch.arange(i, i + 2 * n, dtype=torch.int64),
                       "offsets": torch.arange(0, 2 * n + 1, 2, dtype=torch.int64),
                       "valid": torch.ones(n, dtype=torch.bool)},
            "names": [f"r{i}"] * n,
            "pair": (torch.tensor(float(i)), i),
            "bytes": torch.full((n,), i % 251, dtype=torch.uint8)}


def same(got: Any, want: Any) -> bool:
    if isinstance(want, torch.Tensor):
        return (isinstance(got, torch.Tensor) and got.dtype == want.dtype
                and got.shape == want.shape and torch.equal(got.cpu(), want))
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() == want.keys() and all(
            same(got[k], want[k]) for k in want)
    if isinstance(want, (list, tuple)):
        return type(got) is type(want) and len(got) == len(want) and all(
            same(g, w) for g, w in zip(got, want))
    return bool(got == want)


def check_pool(name: str, slots: int, sizes: list[int], hold: int, copy_delays: list[float],
               pauses: list[float]) -> FeedStats:
    """Feed batches of ``sizes`` rows; the consumer keeps the last ``hold`` batches and
    pauses between batches; every kept batch must stay intact while later ones are made."""
    allocate, copier = backend(name, copy_delays)
    stager = Stager(allocate, copier, slots)
    source = (make_batch(i, n) for i, n in enumerate(sizes))
    kept: deque[tuple[int, Any]] = deque()
    count = 0
    for i, out in enumerate(one_ahead(source, lambda: contextlib.nullcontext([]), stager)):
        assert same(out, make_batch(i, sizes[i])), f"batch {i} arrived wrong"
        kept.append((i, out))
        while len(kept) > hold:
            kept.popleft()
        for j, old in kept:
            assert same(old, make_batch(j, sizes[j])), f"held batch {j} changed by batch {i}"
        time.sleep(pauses[i % len(pauses)])
        count += 1
    assert count == len(sizes)
    assert stager.stats.handed == len(sizes)
    assert stager.pool is not None and stager.pool.stats.allocations <= len(sizes)
    return stager.stats


if given is not None:
    @settings(max_examples=40, deadline=None)
    @given(slots=st.integers(1, 4), sizes=st.lists(st.integers(0, 40), min_size=1, max_size=12),
           hold=st.integers(0, 5),
           copy_delays=st.lists(st.sampled_from([0.0, 0.0005, 0.003]), min_size=1, max_size=4),
           pauses=st.lists(st.sampled_from([0.0, 0.001, 0.004]), min_size=1, max_size=4))
    def test_held_batches_stay_intact_while_later_ones_are_made(slots, sizes, hold,
                                                                copy_delays, pauses):
        check_pool("cpu", slots, sizes, hold, copy_delays, pauses)


@pytest.mark.parametrize("name", BACKENDS)
def test_held_batches_stay_intact_seeded_examples(name):
    rng = random.Random(34)
    for _ in range(12):
        check_pool(name, rng.randint(1, 4), [rng.randint(0, 40) for _ in range(rng.randint(1, 10))],
                   rng.randint(0, 5), [rng.choice([0.0, 0.0005, 0.003]) for _ in range(3)],
                   [rng.choice([0.0, 0.001, 0.004]) for _ in range(3)])


def test_a_pool_that_reuses_buffers_early_is_caught():
    # The check above can fail: a copier that lies about its copies corrupts batches.
    stager = Stager(pageable, LyingCopier([0.3]), 1)
    source = (make_batch(i, 8) for i in range(4))
    outs = list(one_ahead(source, lambda: contextlib.nullcontext([]), stager))
    assert not all(same(o, make_batch(i, 8)) for i, o in enumerate(outs))


def test_buffers_are_reused_and_grow_only_when_outgrown():
    stager = Stager(pageable, SlowCopier(), 2)
    sizes = [16] * 10 + [64] * 5 + [8] * 5
    list(one_ahead((make_batch(i, n) for i, n in enumerate(sizes)),
                   lambda: contextlib.nullcontext([]), stager))
    assert stager.pool is not None
    assert stager.pool.stats.allocations <= 4  # two buffers, each grown once


def test_feed_stats_tell_waits_on_copies_from_waits_on_reads():
    def consume(source: Any, stager: Stager, pause: float) -> None:
        for _ in one_ahead(source, lambda: contextlib.nullcontext([]), stager):
            time.sleep(pause)

    # Batch 0's copy is instant; batch 1 is read while the consumer pauses, its copy late.
    late_copies = Stager(pageable, SlowCopier([0.0, 0.5]), 4)
    consume((make_batch(i, 4) for i in range(4)), late_copies, 0.2)
    assert late_copies.stats.handed == 4 and late_copies.stats.waited >= 1

    def slow_reads() -> Any:
        for i in range(4):
            time.sleep(0.02)
            yield make_batch(i, 4)

    done_copies = Stager(pageable, InstantCopier(), 4)
    consume(slow_reads(), done_copies, 0.0)
    assert done_copies.stats.starved >= 1 and done_copies.stats.waited == 0


def test_an_error_reading_the_next_batch_comes_after_the_current_one():
    def source():
        yield make_batch(0, 4)
        raise OSError("disk gone")

    fed = one_ahead(source(), lambda: contextlib.nullcontext([]), Stager(pageable, SlowCopier()))
    assert same(next(fed), make_batch(0, 4))
    with pytest.raises(OSError, match="disk gone"):
        next(fed)


# ----------------------------------------------------------------------------- the views
class FakeCuda:
    """``device="standin"`` routes iter_batches / the loader through the device feed with
    the CPU stand-ins (copies finishing late), the rest of the arguments as usual."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, slots: int = 2):
        real, real_loader = placement, loader_placement
        where = Placement(None, True)
        monkeypatch.setattr(dataset_module, "placement",
                            lambda d, p: where if d == "standin" else real(d, p))
        monkeypatch.setattr(loader_module, "loader_placement",
                            lambda p, d: where if d == "standin" else real_loader(p, d))
        monkeypatch.setattr(placement_module, "stager_for", lambda w, stats: Stager(
            pageable, SlowCopier([0.003, 0.0, 0.001]), slots, stats))


KW = dict(num_splits=4, shuffle=True, shuffle_seed=3, columns=["id", "v"])


def run(batches: Any, state: Any, pause: float = 0.0) -> list[tuple[Any, dict]]:
    out = []
    for b in batches:
        out.append((b, state()))
        time.sleep(pause)
    return out


def assert_same_run(got: list, want: list) -> None:
    assert len(got) == len(want)
    for (gb, gs), (wb, ws) in zip(got, want):
        assert same(gb, wb)
        assert gs == ws


def fail_some(batch: pa.RecordBatch) -> list[Any]:
    ids = batch.column("id").to_pylist()
    if any(i % 7 == 3 for i in ids):
        raise ValueError("bad row")
    return [torch.tensor(i) for i in ids]


VIEWS = {
    "columns": dict(),
    "transform": dict(transform=lambda b: [torch.tensor(i) for i in b.column("id").to_pylist()]),
    "skip": dict(transform=fail_some, on_transform_error="skip"),
}


@pytest.mark.parametrize("reader", ["local", "ray"])
@pytest.mark.parametrize("kind", sorted(VIEWS))
def test_device_cpu_and_the_feed_give_todays_batches_and_states(
        request, table_factory, monkeypatch, reader, kind):
    if reader == "ray":
        request.getfixturevalue("ray_session")
    table = table_factory(300, 3)
    FakeCuda(monkeypatch)

    def view() -> lance_ray.StreamingDataset:
        return lance_ray.StreamingDataset(table, reader=reader, **KW, **VIEWS[kind])

    today = view()
    want = run(today.iter_batches(32), today.state_dict)
    for device, pause in [("cpu", 0.0), ("standin", 0.002)]:
        ds = view()
        assert_same_run(run(ds.iter_batches(32, device=device), ds.state_dict, pause), want)
    ds = view()  # and the stand-in's stats count every batch handed over
    list(ds.iter_batches(32, device="standin"))
    assert ds.device_stats.handed == len(want)


def test_a_prefetched_batch_never_counts_and_resumes_exactly(table_factory, monkeypatch):
    table = table_factory(300, 3)
    FakeCuda(monkeypatch)
    want = [b for b in lance_ray.StreamingDataset(table, **KW).iter_batches(40)]
    for stop in range(len(want)):
        ds = lance_ray.StreamingDataset(table, **KW)
        it = ds.iter_batches(40, device="standin")
        got = [next(it) for _ in range(stop)]
        state = ds.state_dict()  # the next batch is already staged: it must not count
        it.close()
        again = lance_ray.StreamingDataset(table, **KW)
        again.load_state_dict(state)
        got += list(again.iter_batches(40, device="standin"))
        assert len(got) == len(want) and all(same(g, w) for g, w in zip(got, want))


def test_a_feed_blocked_mid_read_never_takes_another_iterators_progress(table_factory,
                                                                          monkeypatch):
    table = table_factory(300, 3)
    FakeCuda(monkeypatch)
    whole = lance_ray.StreamingDataset(table, **KW)
    list(whole.iter_batches(32))
    ds = lance_ray.StreamingDataset(table, **KW)
    start = ds.state_dict()
    entered, gate = threading.Event(), threading.Event()
    real = ds._mode.batches

    def gated(*args: Any) -> Any:
        for k, batch in enumerate(real(*args)):
            if k == 1:  # the feed's producer thread pulls this one, collecting its changes
                entered.set()
                gate.wait(30)
            yield batch

    monkeypatch.setattr(ds._mode, "batches", gated)
    superseded = ds.iter_batches(32, device="standin")
    next(superseded)
    assert entered.wait(30)
    monkeypatch.setattr(ds._mode, "batches", real)
    ds.load_state_dict(start)  # a new pass while the old iterator is still mid-read
    list(ds.iter_batches(32))
    assert ds.state_dict() == whole.state_dict() and ds.samples_remaining == 0
    gate.set()
    superseded.close()


def test_packed_batches_take_the_same_path(tmp_path, monkeypatch):
    table, _ = write_token_table(str(tmp_path), 40, 30, 2)
    FakeCuda(monkeypatch)
    kw = dict(pack_sequences=16, eos_id=1, pad_id=0, columns=["tokens"], num_splits=2,
              blocks_per_epoch="auto",
              pack_position_ids=True, pack_cu_seqlens=True)
    today = lance_ray.StreamingDataset(table, **kw)
    want = run(today.iter_batches(4), today.state_dict)
    for device in ("cpu", "standin"):
        ds = lance_ray.StreamingDataset(table, **kw)
        assert_same_run(run(ds.iter_batches(4, device=device), ds.state_dict), want)


@pytest.mark.parametrize("workers", [0, 1])
def test_loader_pinning_gives_todays_batches_and_states(table_factory, monkeypatch, workers):
    table = table_factory(300, 3)
    FakeCuda(monkeypatch)
    today = lance_ray.StreamingDataset(table, **KW)
    want = run(lance_ray.StreamingDataLoader(today, batch_size=32), today.state_dict)
    ds = lance_ray.StreamingDataset(table, **KW)
    loader = lance_ray.StreamingDataLoader(ds, batch_size=32, pin_memory=True,
                                           pin_memory_device="standin", num_workers=workers)
    assert_same_run(run(loader, ds.state_dict, 0.002), want)


@pytest.mark.skipif(CUDA, reason="checks the behaviour without CUDA; the cuda tests cover it")
def test_pin_memory_without_cuda_warns_like_torch_and_changes_nothing(table_factory):
    table = table_factory(300, 3)
    today = lance_ray.StreamingDataset(table, **KW)
    want = run(today.iter_batches(32), today.state_dict)
    ds = lance_ray.StreamingDataset(table, **KW)
    with pytest.warns(UserWarning, match="no accelerator is found") as caught:
        batches = ds.iter_batches(32, pin_memory=True)
    assert_same_run(run(batches, ds.state_dict), want)
    ds = lance_ray.StreamingDataset(table, **KW)
    with pytest.warns(UserWarning, match="no accelerator is found") as more:
        loader = lance_ray.StreamingDataLoader(ds, batch_size=32, pin_memory=True)
    assert_same_run(run(loader, ds.state_dict), want)
    assert [w.filename for w in [*caught, *more]] == [__file__] * 2  # the user's line


def test_batches_in_host_memory_never_probe_cuda(table_factory, monkeypatch):
    def probe() -> bool:
        raise AssertionError("CUDA probed (torch: the probe can break a later fork)")

    monkeypatch.setattr(placement_module, "_cuda_available", probe)
    ds = lance_ray.StreamingDataset(table_factory(300, 3), **KW)
    next(ds.iter_batches(32))
    next(ds.iter_batches(32, device="cpu", pin_memory=False))
    next(iter(lance_ray.StreamingDataLoader(ds, batch_size=32)))


# ----------------------------------------------------------------------------- errors
@pytest.mark.parametrize("call, error, match", [
    (lambda: placement("gpu"), ValueError, "must be None, 'cpu', 'cuda'"),
    (lambda: placement("mps", cuda=True), ValueError, "move the batches yourself"),
    (lambda: placement("cuda", cuda=False), RuntimeError, "pass device=None or 'cpu'"),
    (lambda: placement("cuda:0", True, cuda=False), RuntimeError, "CUDA is not available"),
    (lambda: placement("cpu", True), ValueError, "pass device='cuda'"),
    (lambda: placement(None, "yes"), TypeError, "pin_memory must be True, False or None"),
    # an int is torch's cuda:N: without CUDA it says so, not that 0 is no device
    (lambda: placement(0, cuda=False), RuntimeError, "CUDA is not available"),
])
def test_bad_device_arguments_name_the_fix(call, error, match):
    with pytest.raises(error, match=match):
        call()


def test_the_cpu_device_and_no_pinning_change_nothing():
    assert placement(None, None) is None
    assert placement("cpu", False) is None
    assert placement(torch.device("cpu")) is None
    assert placement("cpu:0") is None
    assert loader_placement(False, "") is None
    # torch ignores the device to pin for without pin_memory (a common
    # `pin_memory=torch.cuda.is_available(), pin_memory_device="cuda"`)
    assert loader_placement(False, "cuda") is None
    with pytest.warns(UserWarning, match="no accelerator"):
        assert placement(None, True, cuda=False) is None
    assert NO_ACCELERATOR.startswith("'pin_memory' argument is set as true")


def test_iter_batches_checks_its_device_when_called(table_factory, monkeypatch):
    monkeypatch.setattr(placement_module, "_cuda_available", lambda: False)
    ds = lance_ray.StreamingDataset(table_factory(300, 3), **KW)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        ds.iter_batches(32, device="cuda")
    with pytest.raises(ValueError, match="must be None, 'cpu', 'cuda'"):
        ds.iter_batches(32, device="tpu0")
    assert len(list(ds.iter_batches(100))) == 3  # nothing was consumed


# ----------------------------------------------------------------------------- on CUDA
@pytest.mark.parametrize("reader", ["local", "ray"])
@pytest.mark.parametrize("kind", sorted(VIEWS))
@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch.cuda.is_available() is "
                                     "False); the CPU stand-in variant ran")
def test_cuda_batches_equal_todays_batches_and_states(request, table_factory, reader, kind):
    if reader == "ray":
        request.getfixturevalue("ray_session")
    table = table_factory(300, 3)
    today = lance_ray.StreamingDataset(table, reader=reader, **KW, **VIEWS[kind])
    want = run(today.iter_batches(32), today.state_dict)
    for pin in (None, False):
        ds = lance_ray.StreamingDataset(table, reader=reader, **KW, **VIEWS[kind])
        got = run(ds.iter_batches(32, device="cuda", pin_memory=pin), ds.state_dict, 0.001)
        assert all(t.is_cuda for b, _ in got for t in _tensors(b))
        assert_same_run(got, want)
        assert ds.device_stats.handed == len(want)
    ds = lance_ray.StreamingDataset(table, reader=reader, **KW, **VIEWS[kind])
    got = run(ds.iter_batches(32, pin_memory=True), ds.state_dict)
    assert all(t.is_pinned() for b, _ in got for t in _tensors(b))
    assert_same_run(got, want)


@pytest.mark.cuda
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device (torch.cuda.is_available() is "
                                     "False); the CPU stand-in variant ran")
def test_cuda_packed_batches_and_pinned_loader(tmp_path, table_factory):
    table, _ = write_token_table(str(tmp_path), 40, 30, 2)
    kw = dict(pack_sequences=16, eos_id=1, pad_id=0, columns=["tokens"], num_splits=2,
              blocks_per_epoch="auto")
    today = lance_ray.StreamingDataset(table, **kw)
    want = run(today.iter_batches(4), today.state_dict)
    ds = lance_ray.StreamingDataset(table, **kw)
    assert_same_run(run(ds.iter_batches(4, device="cuda:0"), ds.state_dict), want)
    rows = table_factory(300, 3)
    today = lance_ray.StreamingDataset(rows, **KW)
    want = run(lance_ray.StreamingDataLoader(today, batch_size=32), today.state_dict)
    ds = lance_ray.StreamingDataset(rows, **KW)
    got = run(lance_ray.StreamingDataLoader(ds, batch_size=32, pin_memory=True,
                                            pin_memory_device="cuda"), ds.state_dict)
    assert all(t.is_pinned() for b, _ in got for t in _tensors(b))
    assert_same_run(got, want)


def _tensors(batch: Any) -> list[torch.Tensor]:
    if isinstance(batch, torch.Tensor):
        return [batch]
    if isinstance(batch, dict):
        return [t for v in batch.values() for t in _tensors(v)]
    if isinstance(batch, (list, tuple)):
        return [t for v in batch for t in _tensors(v)]
    return []


def test_numpy_leaves_pass_through():
    stager = Stager(pageable, SlowCopier())
    batch = {"a": np.arange(3), "t": torch.arange(3)}
    out = next(one_ahead(iter([batch]), lambda: contextlib.nullcontext([]), stager))
    assert out["a"] is batch["a"] and torch.equal(out["t"], batch["t"])


class Encoding(collections.UserDict):
    """What a HuggingFace tokenizer's collate returns (``BatchEncoding`` is a UserDict)."""


@pytest.mark.parametrize("name", BACKENDS)
def test_mappings_of_any_type_are_staged_and_keep_their_type(name):
    allocate, copier = backend(name, [0.0])
    stager = Stager(allocate, copier)
    batch = Encoding(input_ids=torch.arange(6).reshape(2, 3),
                     extra=collections.OrderedDict(mask=torch.ones(2, dtype=torch.bool)))
    out = next(one_ahead(iter([batch]), lambda: contextlib.nullcontext([]), stager))
    assert type(out) is Encoding and type(out["extra"]) is collections.OrderedDict
    assert out["input_ids"] is not batch["input_ids"] and stager.pool.stats.allocations == 1
    assert same(dict(out["extra"]), dict(batch["extra"]))
    assert torch.equal(out["input_ids"].cpu(), batch["input_ids"])


# ----------------------------------------------------------------------------- torch's loader
def test_loader_pin_arguments_mean_what_torch_makes_of_them(recwarn):
    # Any true value pins (torch reads pin_memory as a truth value); pin_memory_device is
    # deprecated and ignored by torch 2.13's DataLoader, with a warning, whatever it holds.
    assert loader_placement(1, "", cuda=True) == Placement(None, True)
    assert loader_placement(0, "cuda", cuda=True) is None
    assert loader_placement(None, 3) is None
    for device in ("cuda", "cpu", "mps", 3):
        with pytest.warns(UserWarning, match="pin_memory_device is deprecated"):
            assert loader_placement(True, device, cuda=True) == Placement(None, True)
    assert not recwarn.list


@pytest.mark.skipif(CUDA, reason="checks the behaviour without CUDA")
@pytest.mark.parametrize("mixture", [False, True])
def test_a_loader_reports_its_pin_arguments_as_given_and_torch_pins_nothing(
        table_factory, mixture, recwarn):
    table = table_factory(96, 2)
    ds = lance_ray.MixtureDataset([lance_ray.Source(table, weight=1)], num_splits=4,
                                  columns=["id"]) if mixture else \
        lance_ray.StreamingDataset(table, **KW)
    with pytest.warns(UserWarning, match="no accelerator"):
        loader = lance_ray.StreamingDataLoader(ds, batch_size=32, pin_memory=1,
                                               pin_memory_device="cuda")
    assert (loader.pin_memory, loader.pin_memory_device) == (1, "cuda")
    recwarn.clear()
    assert sum(len(b["id"]) for b in loader) == 96  # torch's iterator warns no second time
    assert not [w for w in recwarn.list if "accelerator" in str(w.message)]


class CustomBatch:
    """torch's docs' custom batch type: it pins itself."""

    def __init__(self, items: list[Any]):
        self.inp = torch.stack([torch.as_tensor(x) for x in items])
        self.pinned = 0

    def pin_memory(self) -> CustomBatch:
        self.pinned += 1
        return self


def test_batches_are_walked_as_torchs_pin_memory_walks_them():
    pin = Stager(pageable)  # the pinned-host path, with ordinary memory standing in
    custom = CustomBatch([1, 2])
    out = next(one_ahead(iter([{"c": custom, "t": torch.arange(2)}]),
                         lambda: contextlib.nullcontext([]), pin))
    assert out["c"] is custom and custom.pinned == 1  # its own pin_memory(), as torch calls
    feed = Stager(pageable, SlowCopier([0.002]))
    batch = collections.UserList([torch.arange(3), deque([torch.ones(2)])])
    out = next(one_ahead(iter([batch]), lambda: contextlib.nullcontext([]), feed))
    assert type(out) is collections.UserList and type(out[1]) is deque
    assert out[0] is not batch[0] and torch.equal(out[0], batch[0])  # staged: any Sequence
    assert feed.pool is not None and feed.pool.stats.allocations == 1
    assert torch.equal(out[1][0], torch.ones(2))
    for odd in (CustomBatch([1]), torch.eye(2).to_sparse()):
        with pytest.raises(TypeError, match="pass device=None"):
            next(one_ahead(iter([[odd]]), lambda: contextlib.nullcontext([]),
                           Stager(pageable, SlowCopier())))


@pytest.mark.parametrize("workers", [0, 1])
def test_a_mixture_loader_pins_its_batches_and_keeps_its_states(table_factory, monkeypatch,
                                                               workers):
    tables = [table_factory(64, 2), table_factory(40, 3)]

    def mix() -> Any:
        return lance_ray.MixtureDataset([lance_ray.Source(t, weight=w)
                                         for t, w in zip(tables, (3, 1))],
                                        num_splits=4, shuffle_seed=3, columns=["id"])

    today = mix()
    want = run(lance_ray.StreamingDataLoader(today, batch_size=8), today.state_dict)
    pinned: set[int] = set()

    def fake_pinned(nbytes: int) -> torch.Tensor:  # no pinned memory without CUDA
        out = pageable(nbytes)
        pinned.add(out.untyped_storage().data_ptr())
        return out

    monkeypatch.setattr(placement_module, "_cuda_available", lambda: True)
    monkeypatch.setattr(placement_module, "pinned_buffer", fake_pinned)
    ds = mix()
    got = run(lance_ray.StreamingDataLoader(ds, batch_size=8, pin_memory=True,
                                            num_workers=workers), ds.state_dict)
    assert all(t.untyped_storage().data_ptr() in pinned for b, _ in got for t in _tensors(b))
    assert_same_run(got, want)
