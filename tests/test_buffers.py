"""Large conversion outputs come from recycled buffers (``read/buffers``): a buffer is handed
out again only once no array, view or tensor made from it is left, so a batch the trainer
still holds stays intact however many reads follow; a steady stream of reads reuses the
same buffers instead of faulting in fresh pages.

What it is worth on reads is measured, not asserted: ``python -m jobs.bench.cores``
(the trainer's kernel CPU per row)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lance_ray.read import buffers
from lance_ray.read.buffers import BufferPool

KB = 1 << 10


def _pool(keep: int = 64 * KB) -> BufferPool:
    return BufferPool(keep_bytes=keep, pooled_bytes=4 * KB, grain=4 * KB)


def _span(a: np.ndarray) -> tuple[int, int]:
    lo = a.__array_interface__["data"][0]
    return lo, lo + a.nbytes


@settings(max_examples=60, deadline=None)
@given(steps=st.lists(st.tuples(st.integers(1, 40), st.sampled_from(["drop", "view",
                                                                      "tensor", "keep"])),
                      min_size=1, max_size=40),
       keep=st.sampled_from([0, 16 * KB, 64 * KB, 1 << 20]))
def test_a_buffer_is_never_handed_out_while_anything_made_from_it_is_alive(steps, keep):
    pool = _pool(keep)
    held: list[tuple[object, int]] = []  # what the "trainer" still holds, and its pattern
    for k, (kb, hold) in enumerate(steps):
        arr = pool.empty((kb * KB // 8,), np.int64)
        assert arr.flags.writeable and arr.shape == (kb * KB // 8,)
        for other, _ in held:
            other_arr = other.numpy() if isinstance(other, torch.Tensor) else other
            lo, hi = _span(arr)
            olo, ohi = _span(other_arr)
            assert hi <= olo or ohi <= lo, "a held batch's memory was handed out again"
        arr[:] = k
        if hold == "view":
            held.append((arr[1:], k))
        elif hold == "tensor":
            held.append((torch.from_numpy(arr)[:3], k))
        elif hold == "keep":
            held.append((arr, k))
        del arr  # refcounting frees it now: no collection needed
        for thing, value in held:
            assert (np.asarray(thing) == value).all(), "a held batch changed"
        # Free buffers never exceed the cap, nor the most that was in use at once.
        assert pool.free_bytes() <= min(keep, pool.peak)


def test_steady_reads_reuse_their_buffers_and_the_free_ones_stay_bounded():
    """Kept: what was in use at once, within the cap."""
    pool = _pool(keep=64 * KB)
    for _ in range(50):
        a = pool.empty((3, 4 * KB), np.uint8)  # 12 KB: one buffer of 12 KB
        b = pool.empty((2 * KB,), np.float32)  # 8 KB
        del a, b
    assert pool.made == 2
    assert pool.free_bytes() == pool.peak == 20 * KB  # both kept: they were in use at once
    for kb in range(5, 40):  # sizes no free buffer fits: new ones, the oldest let go
        pool.empty((kb * KB,), np.uint8)
    assert pool.free_bytes() <= 64 * KB


def test_a_request_no_free_buffer_fits_lets_the_oldest_free_one_go():
    """When the reads change size (a new task shape), the buffers of the old size go back to
    malloc one per miss, instead of staying while new ones are made beside them."""
    pool = _pool(keep=1 << 20)
    old = [pool.empty((8 * KB,), np.uint8) for _ in range(3)]
    del old
    assert pool.free_bytes() == 24 * KB
    new = [pool.empty((40 * KB,), np.uint8) for _ in range(3)]  # too large for any of them
    assert pool.free_bytes() == 0 and pool.made == 6
    del new
    for _ in range(10):  # the new size, asked for again, is served from what was kept
        pool.empty((40 * KB,), np.uint8)
    assert pool.made == 6


def test_small_object_and_opted_out_arrays_are_plain_numpy(monkeypatch):
    pool = _pool()
    assert pool.empty((10,), np.float64).base is None
    assert pool.empty((8 * KB,), object).base is None
    monkeypatch.setenv("LANCE_RAY_KEEP_FREED_BUFFERS", "0")
    assert pool.empty((8 * KB,), np.uint8).base is None
    assert pool.made == 0


@pytest.mark.parametrize("dtype", [np.uint8, np.int32, np.float16, np.float64, np.bool_])
def test_pooled_arrays_have_the_asked_shape_and_dtype(dtype):
    pool = _pool()
    arr = pool.empty((16, 3, 128), dtype)
    assert (arr.shape, arr.dtype) == ((16, 3, 128), np.dtype(dtype))
    assert arr.base is not None  # pooled
    t = torch.from_numpy(arr)
    assert t.shape == (16, 3, 128)


def test_concatenate_and_take_match_numpy():
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 100, (n, 5)) for n in (300, 1, 700)]
    assert np.array_equal(buffers.concatenate(parts), np.concatenate(parts))
    rows = rng.permutation(1001)
    joined = np.concatenate(parts)
    assert np.array_equal(buffers.take(joined, rows), joined[rows])


def test_a_forked_child_starts_with_an_empty_pool():
    code = (
        "import os, numpy as np\n"
        "from lance_ray.read import buffers\n"
        "a = buffers.empty((buffers.POOLED_BYTES,), np.uint8); del a\n"
        "assert buffers.POOL.free_bytes() > 0\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    os._exit(0 if buffers.POOL.free_bytes() == 0 else 3)\n"
        "print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "LANCE_RAY_KEEP_FREED_BUFFERS"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120, check=True)
    assert done.stdout.strip() == "0", done.stderr


@pytest.mark.parametrize("reader", ["local", "ray"])
def test_batches_the_trainer_keeps_stay_intact_while_later_reads_reuse_buffers(
        reader, tmp_path, monkeypatch, ray_session):
    """Both readers, a full shuffle: every third batch is kept to the end, the rest dropped at
    once; the kept ones still hold their rows (each row's values tell its id) and the
    dropped ones' buffers served later reads."""
    from conftest import write_table

    import lance_ray

    pool = BufferPool(keep_bytes=1 << 20, pooled_bytes=4 * KB, grain=4 * KB)
    monkeypatch.setattr(buffers, "POOL", pool)
    table = write_table(str(tmp_path), 3000, fragments=3, dim=64)
    ds = lance_ray.StreamingDataset(table, reader=reader, shuffle_seed=3, num_splits=1,
                                    read_bytes=64 * KB)
    kept, seen = [], []
    for k, batch in enumerate(ds.iter_batches(50)):
        seen.extend(batch["id"].tolist())
        if k % 3 == 0:
            kept.append((batch, batch["id"].clone()))
    assert sorted(seen) == list(range(3000))
    for batch, ids in kept:
        assert torch.equal(batch["id"], ids)
        assert torch.equal(batch["v"], ids[:, None].float().expand(-1, 64))
    assert 0 < pool.made < len(seen) // 50
