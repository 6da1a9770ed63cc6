"""``python -m lance_ray``: the command-line interface (see :mod:`lance_ray.cli`)."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m lance_ray"))
