"""Throughput benchmark: lance_ray vs lancedb.streaming vs Ray Data vs Lance's own read limits.

    python -m jobs.bench [--rows 200000] [--big-rows 2000000] [--repeats 3] [--out runs/bench]
    ray job submit --working-dir . -- python -m jobs.bench --out /abs/path/runs/bench

One run measures, side by side on the same generated table (int64 id, int64 label, float32
x, 64 x float32 vector; ``lance_ray.testing.tables.create_table``), for a full shuffle and for
``shuffle_clump_size=1024``, batch size 256, ``num_splits=8``:

1. lance_ray's batch path ``StreamingDataset(...).iter_batches(256)``, ``reader="ray"`` (the
   default) and ``reader="local"``;
2. lance_ray rows through ``StreamingDataLoader(ds, batch_size=256, num_workers=0 / 2)``;
3. the reference, ``lancedb.streaming.StreamingDataset`` through torch
   ``DataLoader(batch_size=256)`` with the same arguments (its defaults otherwise);
4. Ray's own ``ray.data.read_lance(uri).iter_torch_batches(batch_size=256)`` (unshuffled,
   not deterministic);
5. Lance's limits: sorted ``_take_rows`` of random row ids, 4096 per call (the limit for a
   full shuffle), the same for clumped ids, and a sequential ``to_batches(4096)`` scan.

How:

* Every configuration runs in a fresh subprocess, so peak RSS is per configuration. Those
  that use Ray attach to one local Ray (``num_cpus=2``) that this driver starts before any
  timing; the driver itself never opens Lance (the tables are written by a subprocess).
* Each subprocess first warms up (its "cold" first batch includes Ray worker start-up;
  Ray paths warm up on one whole epoch read to its end: stopping a Ray Data pipeline early
  kills the workers running its tasks, and a small filtered table left some of the task
  slots' workers to start in the first timed epoch), then runs ``--repeats`` timed
  epochs. rows/s is their median; a pass counts from constructing the dataset to its last
  batch (so it includes building the epoch's plan); "steady" rows/s counts only after the
  first batch (the start-up is the separate time-to-first-batch figure); an epoch longer
  than ``--max-seconds`` is measured over the part read (marked *).
* The first timed epoch of lance_ray (and of the reference) takes ``state_dict()`` at 50%
  and 90% of its batches (not timed). Time to first batch after resuming = construct a new
  dataset + ``load_state_dict`` + first batch; fresh = construct + first batch.
* Peak RSS = the trainer process's own peak (VmHWM) plus that of its largest DataLoader
  worker; "tree" is the sampled sum of RSS over the trainer, its children and, for Ray
  configurations, the whole local Ray.
* If DataLoader workers crash with the default start method (fork), the configuration is
  measured again with ``multiprocessing_context="forkserver"`` and marked [forkserver].
* At ``--big-rows`` only the lance_ray batch path (reader="ray") and the reference run, full
  shuffle, one pass capped at ``--big-seconds`` (to stay under 10 minutes), to compare the
  trainer's peak RSS with the ``--rows`` table.

Writes ``<out>/bench.json``, ``<out>/bench.png`` and per-configuration logs under
``<out>/logs``, and the shared-format results (``throughput``, ``packing``, ``transforms``,
``cold-start``, ``memory``) to ``--json-out`` (``docs/bench``), which
``python -m jobs.bench.performance`` renders into docs/performance.md; prints progress and
the tables. The cases are registered by group in :mod:`jobs.bench.cases`. The tables live
in ``<out>/db`` and are reused by later runs when rows, dim and fragments match. Under
``ray job submit`` pass an absolute ``--out`` (the job's working directory is a temporary
copy).
"""
