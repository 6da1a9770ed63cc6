"""What is measured: the configurations and the constants they share.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

BATCH = 256


SPLITS = 8


CLUMP = 1024


DIM = 64


SEED = 0


TAKE_ROWS = 4096  # rows per Lance call in the limit measurements


WARM_BATCHES = 16


FRACTIONS = (0.5, 0.9)


SHUFFLES = {"full": None, "clump": CLUMP}


ENV = {"RAY_AUTH_MODE": "disabled", "RAY_DATA_DISABLE_PROGRESS_BARS": "1"}


@dataclass
class Config:
    """One measured configuration; everything a subprocess needs to run it."""

    name: str
    label: str
    kind: str  # lance_ray | reference | ray_data | limit
    shuffle: str  # full | clump | none
    table: str = "small"  # small | big | wide | tokens (the packed-tokens case)
    reader: str = "ray"
    loader_workers: int | None = None  # None: iter_batches; else StreamingDataLoader workers
    limit: str | None = None  # take_random(_big) | take_clump | scan | transform
    resume: bool = False
    transform: str | None = None  # image | tokens (jobs.bench.transforms)
    nodes: int = 0  # simulated CPU-only nodes of a cluster of the configuration's own
    group: str = "base"  # its group in the case registry (jobs.bench.cases)

    @property
    def needs_ray(self) -> bool:
        """Whether it runs on the driver's shared local Ray."""
        # A StreamingDataLoader with workers reads in its workers (no Ray); with
        # num_workers=0 it reads through the dataset's reader, like iter_batches.
        return not self.nodes and (self.kind == "ray_data" or (
            self.kind == "lance_ray" and self.reader == "ray" and not self.loader_workers))


def base_configurations(include_big: bool, include_wide: bool = False) -> list[Config]:
    """The throughput cases on the generated row tables: loaders, the reference, limits."""
    out = [
        Config("limit-take", f"Lance sorted take, random ids, {TAKE_ROWS}/call", "limit",
               "full", limit="take_random"),
        Config("limit-take-big", f"Lance sorted take, random ids, {4 * TAKE_ROWS}/call",
               "limit", "full", limit="take_random_big"),
        Config("limit-take-clump", f"Lance sorted take, clumped ids, {TAKE_ROWS}/call",
               "limit", "clump", limit="take_clump"),
        Config("limit-scan", f"Lance sequential scan, to_batches({TAKE_ROWS})", "limit", "none",
               limit="scan"),
    ]
    for shuffle in SHUFFLES:
        out += [
            Config(f"reference-{shuffle}", "lancedb.streaming + DataLoader(nw=0)", "reference",
                   shuffle, resume=True),
            Config(f"batch-ray-{shuffle}", "lance_ray iter_batches (ray)", "lance_ray", shuffle,
                   reader="ray", resume=True),
            Config(f"batch-local-{shuffle}", "lance_ray iter_batches (local)", "lance_ray",
                   shuffle, reader="local", resume=True),
            Config(f"loader0-{shuffle}", "lance_ray StreamingDataLoader(nw=0)", "lance_ray",
                   shuffle, loader_workers=0, resume=True),
            Config(f"loader2-{shuffle}", "lance_ray StreamingDataLoader(nw=2)", "lance_ray",
                   shuffle, loader_workers=2, resume=True),
        ]
    out.append(Config("ray-read-lance", "ray.data.read_lance iter_torch_batches", "ray_data",
                      "none"))
    if include_big:
        out += [
            Config("big-batch-ray-full", "lance_ray iter_batches (ray)", "lance_ray", "full",
                   table="big", reader="ray"),
            Config("big-reference-full", "lancedb.streaming + DataLoader(nw=0)", "reference",
                   "full", table="big"),
        ]
    if include_wide:
        out += [
            Config("wide-reference-full", "lancedb.streaming + DataLoader(nw=0)", "reference",
                   "full", table="wide"),
            Config("wide-batch-local-full", "lance_ray iter_batches (local)", "lance_ray",
                   "full", table="wide", reader="local"),
            Config("wide-batch-ray-full", "lance_ray iter_batches (ray)", "lance_ray", "full",
                   table="wide", reader="ray"),
        ]
    return out

