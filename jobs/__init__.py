"""The Ray job entrypoints, run as ``python -m jobs.<name>`` (locally, or with ``ray job
submit --working-dir .``): ``demo``, ``train``, ``train_lm`` (with its helpers ``lm_data``
and ``lm_model``), ``elastic_resume``, ``verify``, ``plot_run``, ``make_table``.
Benchmarks live in :mod:`jobs.bench`, fault trials in :mod:`jobs.faults`."""
