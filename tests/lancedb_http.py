"""A small stand-in for a LanceDB Cloud / Enterprise server, for tests.

It answers the part of the remote table HTTP API that ``lancedb.connect("db://...")``
clients need to read a table: ``describe``, ``count_rows`` and ``query`` (projection,
``_rowid``, SQL filter, offset and limit, time travel to a version). Every answer comes
from a real Lance dataset on disk, so the client sees real data. Every request (route and
JSON body) is recorded, so tests can assert on what the client sent.

Only stdlib ``http.server`` on 127.0.0.1, on a free port, in a daemon thread.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import lance
import pyarrow as pa

ARROW_FILE = "application/vnd.apache.arrow.file"
ROUTE = re.compile(r"^/v1/table/(?P<table>[^/]+)/(?P<op>[a-z_/]+?)/?$")

# Arrow type -> the type name of lance's JSON schema (what the client parses in describe).
_SCALARS = {
    pa.null(): "null", pa.bool_(): "bool",
    pa.int8(): "int8", pa.int16(): "int16", pa.int32(): "int32", pa.int64(): "int64",
    pa.uint8(): "uint8", pa.uint16(): "uint16", pa.uint32(): "uint32", pa.uint64(): "uint64",
    pa.float16(): "halffloat", pa.float32(): "float", pa.float64(): "double",
    pa.string(): "string", pa.large_string(): "large_string",
    pa.binary(): "binary", pa.large_binary(): "large_binary",
}


def json_type(t: pa.DataType) -> dict[str, Any]:
    """``t`` in the JSON schema format of a describe answer."""
    if t in _SCALARS:
        return {"type": _SCALARS[t]}
    if pa.types.is_fixed_size_list(t):
        return {"type": "fixed_size_list", "fields": [json_field(t.value_field)],
                "length": t.list_size}
    if pa.types.is_large_list(t):
        return {"type": "large_list", "fields": [json_field(t.value_field)]}
    if pa.types.is_list(t):
        return {"type": "list", "fields": [json_field(t.value_field)]}
    if pa.types.is_struct(t):
        return {"type": "struct", "fields": [json_field(t.field(i)) for i in range(t.num_fields)]}
    if pa.types.is_fixed_size_binary(t):
        return {"type": "fixed_size_binary", "length": t.byte_width}
    raise NotImplementedError(f"the test server cannot describe Arrow type {t}")


def json_field(f: pa.Field) -> dict[str, Any]:
    return {"name": f.name, "type": json_type(f.type), "nullable": f.nullable}


@dataclass
class Request:
    """One request the server received: the table, the operation and the JSON body."""

    table: str
    op: str
    body: dict[str, Any]


@dataclass
class LanceHttpServer:
    """Serves ``tables`` (name -> Lance dataset URI) until ``close()``."""

    tables: dict[str, str]
    api_key: str = "test-key"
    requests: list[Request] = field(default_factory=list)
    # Applied to the answer of every row-id query: a real server answers in its own order.
    reshape_takes: Callable[[pa.Table], pa.Table] | None = None

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(target=self._httpd.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    def close(self) -> None:
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join()

    def of(self, op: str) -> list[Request]:
        """The recorded requests for operation ``op`` (e.g. ``"query"``)."""
        with self._lock:
            return [r for r in self.requests if r.op == op]

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()

    # ------------------------------------------------------------------ operations

    def _dataset(self, table: str, version: int | None) -> Any:
        if table not in self.tables:
            raise LookupError(f"table {table!r} not found")
        try:
            return lance.dataset(self.tables[table], version=version)
        except Exception as e:  # lance names the missing version
            raise LookupError(f"version {version} of table {table!r} not found: {e}") from e

    def answer(self, table: str, op: str, body: dict[str, Any]) -> tuple[str, bytes]:
        """(content type, payload) for one request; raises LookupError for a 404."""
        with self._lock:
            self.requests.append(Request(table, op, body))
        ds = self._dataset(table, body.get("version"))
        if op == "describe":
            return _json({"version": ds.version,
                          "schema": {"fields": [json_field(f) for f in ds.schema]}})
        if op == "count_rows":
            return _json(ds.count_rows(filter=body.get("predicate")))
        if op == "get_lsm_write_spec":
            return _json({"lsm_write_spec": None})
        if op == "query":
            answer = _query(ds, body)
            if self.reshape_takes is not None and "_rowid" in (body.get("filter") or ""):
                answer = self.reshape_takes(answer)
            return ARROW_FILE, _arrow_file(answer)
        raise NotImplementedError(f"the test server does not serve operation {op!r}")


def _query(ds: Any, body: dict[str, Any]) -> pa.Table:
    """A plain (non-vector) query: filter, projection, row ids, offset and limit."""
    if body.get("vector") or body.get("full_text_query"):
        raise NotImplementedError("the test server serves no vector or full-text search")
    # A list of names, or {output name: SQL expression} (Lance evaluates both).
    columns = body.get("columns")
    want_rowid = bool(body.get("with_row_id"))
    if columns is not None and "_rowid" in columns:
        want_rowid = True
        columns = ({k: v for k, v in columns.items() if k != "_rowid"}
                   if isinstance(columns, dict) else [c for c in columns if c != "_rowid"])
    limit = body.get("k") or None  # 0 or absent: no limit
    return ds.to_table(columns=columns, filter=body.get("filter"), with_row_id=want_rowid,
                       limit=limit, offset=body.get("offset") or None)


def _json(value: Any) -> tuple[str, bytes]:
    return "application/json", json.dumps(value).encode()


def _arrow_file(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def _handler(server: LanceHttpServer) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, like a real server

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            if self.headers.get("x-api-key") != server.api_key:
                return self._send(401, "text/plain", b"bad api key")
            match = ROUTE.match(self.path.split("?")[0])
            if match is None:
                return self._send(404, "text/plain", f"no route {self.path}".encode())
            try:
                body = json.loads(raw) if raw else {}
                kind, payload = server.answer(match["table"], match["op"], body)
            except LookupError as e:
                return self._send(404, "text/plain", str(e).encode())
            except Exception as e:  # a bad filter or body: the client's error, not ours
                return self._send(400, "text/plain", str(e).encode())
            self._send(200, kind, payload)

        do_GET = do_POST

        def _send(self, status: int, kind: str, payload: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:
            return None  # quiet: tests assert on ``server.requests`` instead

    return Handler


@dataclass(frozen=True)
class Connector:
    """A picklable ``connection_factory``: opens table ``name`` on the server at ``url``.

    The key comes from the environment variable ``key_env`` where the factory runs, or, for
    processes that cannot see the test's environment (Ray workers started earlier), from
    ``api_key``.
    """

    url: str
    key_env: str | None = None
    api_key: str | None = None

    def __call__(self, name: str) -> Any:
        import os

        import lancedb

        key = os.environ[self.key_env] if self.key_env else self.api_key
        return lancedb.connect("db://test", api_key=key, host_override=self.url,
                               client_config={"timeout_config": {"connect_timeout": 5}}
                               ).open_table(name)
