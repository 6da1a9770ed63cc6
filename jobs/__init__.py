"""Ray job entrypoints and scripts (run them as files, or ``python -m jobs.bench``)."""
