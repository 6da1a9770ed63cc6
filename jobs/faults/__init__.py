"""Fault trials: faults injected on purpose into real runs, each proven exactly once.

    python -m jobs.faults.chaos --trials 24            # views, coordinator, nodes
    python -m jobs.faults.chaos --trainer --trials 20  # real TorchTrainer runs
    python -m jobs.faults.s3_faults [--train]          # an object store that goes away

See docs/elastic.md and docs/object-storage.md.
"""
