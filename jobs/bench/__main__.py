"""``python -m jobs.bench``: run the benchmark (see :mod:`jobs.bench`)."""

from .run import main

main()
