"""Cutting a stream into read chunks (pure, no table)."""

import pytest

from lance_ray.read import FIRST_READ_ROWS, chunk_spans


@pytest.mark.parametrize("total", [0, 1, FIRST_READ_ROWS - 1, 5 * FIRST_READ_ROWS + 7, 200_000])
@pytest.mark.parametrize("chunk_rows", [1, 300, FIRST_READ_ROWS, 65536])
@pytest.mark.parametrize("start", [0, 17])
def test_chunks_grow_to_the_read_size_and_cover_every_sample_once(total, chunk_rows, start):
    spans = list(chunk_spans(start, start + total, chunk_rows))
    covered = [i for lo, hi in spans for i in range(lo, hi)]
    assert covered == list(range(start, start + total))
    sizes = [hi - lo for lo, hi in spans[:-1]]  # the last one takes what is left
    assert all(s <= chunk_rows for s in sizes)
    if sizes:
        assert sizes[0] == min(chunk_rows, FIRST_READ_ROWS)
        assert all(b in (2 * a, chunk_rows) for a, b in zip(sizes, sizes[1:]))
