"""``status``: the progress of a running coordinator."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from .text import (
    EXIT_OK,
    CliError,
    emit_json,
    one_line,
    percent,
    print_fields,
    print_table,
)


def _check_reachable(address: str, timeout: float = 3.0) -> None:
    """Fail fast (instead of Ray's minutes of retries) when ``host:port`` does not answer."""
    import socket

    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not host or not port.isdigit():
        return  # "auto", "local" or a form Ray resolves itself
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as e:
        raise CliError(f"cannot reach a Ray cluster at {address!r}: {e.strerror or e}; check "
                       "--address (the head node's GCS address, e.g. 10.0.0.1:6379)") from e


def fetch_status(name: str, namespace: str, address: str | None = None) -> dict[str, Any]:
    """The status of coordinator ``name``.

    Connects to Ray (``address`` or ``"auto"``) unless this process is connected already
    (then that connection is used), and disconnects again afterwards.
    """
    import ray
    from ray.exceptions import RayError

    from ..driver.handle import Coordinator

    if address:
        _check_reachable(address)
    connected_here = False
    if not ray.is_initialized():
        target = address or "auto"
        try:
            ray.init(address=target, logging_level=logging.WARNING, log_to_driver=False,
                     configure_logging=False)
        except (ConnectionError, RuntimeError, ValueError) as e:
            raise CliError(f"cannot connect to a Ray cluster at {target!r}: {one_line(e)}; "
                           "start one (ray start --head) or pass --address") from e
        connected_here = True
    try:
        try:
            coordinator = Coordinator.get(name, namespace)
        except ValueError as e:
            raise CliError(one_line(e)) from e
        try:
            status = coordinator.status()
        except RayError as e:
            raise CliError(f"coordinator {name!r} did not answer: {one_line(e)}") from e
    finally:
        if connected_here:
            ray.shutdown()
    return {"namespace": namespace, **status}


def _blocks(packed: dict[str, Any]) -> str:
    """A packed run's sealed blocks (``status()["packed"]``), out of the epoch's."""
    done, total = packed["sealed_blocks"], packed["epoch_blocks"]
    out = f"{done} / {'?' if total is None else total} of {packed['block_len']} tokens"
    return out + (f" ({percent(done, total)})" if total else "")


def print_status(s: dict[str, Any]) -> None:
    """Print ``fetch_status``'s result for a human."""
    rows_of = "?" if s.get("epoch_rows") is None else s["epoch_rows"]
    sealed = f"{s['sealed_rows']} / {rows_of}"
    if s.get("epoch_rows"):
        sealed += f" ({percent(s['sealed_rows'], s['epoch_rows'])})"
    pending = s.get("pending_steps") or []
    print_fields([
        ("coordinator", f"{s['name']} (namespace {s['namespace']})"),
        (("sources", ", ".join(s["sources"])) if s.get("mixture")
         else ("table_version", s.get("table_version"))),
        ("epoch", s["epoch"]),
        ("world size", f"{s['world_size']} ({s['num_splits']} splits)"),
        ("sealed step", s["sealed_step"]),
        ("sealed rows", sealed),
        *([("sealed blocks", _blocks(s["packed"]))] if s.get("packed") else []),
        ("rows/s", f"{s['rows_per_s']:.1f}"),
        ("pending steps", ", ".join(map(str, pending)) if pending else "none"),
    ])
    ranks = s.get("ranks") or {}
    print()
    if ranks:
        print_table(["rank", "step", "rows"],
                     [[r, v["step"], v["rows"]] for r, v in sorted(ranks.items(),
                                                                  key=lambda kv: int(kv[0]))])
    else:
        print("no rank has reported progress in this epoch yet")


def cmd_status(args: argparse.Namespace) -> int:
    """``status NAME [--namespace NS] [--address ADDR]``."""
    s = fetch_status(args.name, args.namespace, args.address)
    if args.json:
        emit_json(s)
    else:
        print_status(s)
    return EXIT_OK

