"""Create a synthetic LanceDB table for the demos (a Ray job step).

    python -m jobs.make_table --db runs/demo/db --rows 20000 --dim 16
    python -m jobs.make_table --db runs/lm/db --name tokens --tokens --rows 50000

The table generator itself is :mod:`lance_ray.testing.tables` (columns, token documents).
"""

from __future__ import annotations

import argparse
import logging

from jobs.args import positive_int
from lance_ray.testing.tables import create_table, synthetic_batch, token_rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", default="runs/demo/db", help="LanceDB database directory")
    parser.add_argument("--name", default="demo")
    parser.add_argument("--rows", type=positive_int, default=20_000)
    parser.add_argument("--dim", type=positive_int, default=16)
    parser.add_argument("--fragments", type=positive_int, default=4)
    parser.add_argument("--tokens", action="store_true",
                        help="a token table (one document per row) instead")
    parser.add_argument("--mean-len", type=float, default=500.0,
                        help="--tokens: mean document length")
    parser.add_argument("--vocab", type=positive_int, default=32_000,
                        help="--tokens: vocabulary size")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    table = create_table(args.db, args.name, rows=args.rows, dim=args.dim,
                         fragments=args.fragments,
                         batch=token_rows(args.mean_len, args.vocab) if args.tokens
                         else synthetic_batch)
    print(f"table {args.name!r} at {args.db}: {table.count_rows()} rows, version {table.version}")


if __name__ == "__main__":
    main()
