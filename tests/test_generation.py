"""A coordinator's generation file: what a view polls before each batch to learn of a resize.

Invariant: the published generation never goes back, a read that is not a whole record is
never taken for a resize, and a view is told only of a generation newer than its own. Real
files in this node's shared memory; no Ray.
"""

from __future__ import annotations

import os
import pickle
import uuid

import pytest

from lance_ray.plan import generation as gen


@pytest.fixture
def name():
    n = gen.file_name(f"test-{uuid.uuid4().hex}")
    yield n
    path = gen.node_path(n)
    if os.path.exists(path):
        os.remove(path)


def test_a_view_hears_only_of_a_newer_generation(name):
    gen.publish(name, 1)
    watch = gen.GenerationWatch(name, 1)
    assert watch.newer() is None
    gen.publish(name, 2)
    assert watch.newer() == 2
    assert gen.GenerationWatch(name, 2).newer() is None


def test_the_published_generation_never_goes_back(name):
    gen.publish(name, 3)
    gen.publish(name, 1)  # a view attaching late with its older generation
    assert gen.GenerationWatch(name, 0).newer() == 3


def test_a_torn_or_foreign_record_is_not_a_resize(name):
    watch = gen.GenerationWatch(name, 0)
    assert watch.newer() is None  # nothing published on this node yet
    with open(gen.node_path(name), "wb") as f:
        f.write(gen.RECORD.pack(7, 0))  # a record whose check word does not match
    assert watch.newer() is None
    gen.publish(name, 5)  # a damaged record is overwritten
    assert watch.newer() == 5


def test_the_watch_travels(name):
    gen.publish(name, 1)
    watch = gen.GenerationWatch(name, 1)
    assert watch.newer() is None
    gen.publish(name, 2)
    assert watch.newer() == 2
    copy = pickle.loads(pickle.dumps(watch))  # the open file stays behind
    assert (copy.name, copy.generation, copy.newer()) == (name, 1, 2)
