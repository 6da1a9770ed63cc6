"""A local S3-compatible server (moto's, from PyPI: the ``dev`` extra) for tests, demos and
fault trials.

    server = LocalS3.start()             # moto_server -H 127.0.0.1 -p <free port>
    os.environ.update(server.env())      # what Lance, pyarrow and Ray Train read
    server.create_bucket("lance-ray")
    ...
    server.stop()                        # by handle, never a broad kill

Only loopback: the server binds 127.0.0.1. The credentials are dummies that moto accepts.
:class:`Forwarder` puts a TCP port in front of the server that can be closed and reopened
(an endpoint that is down, while moto keeps its objects in memory).
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

HOST = "127.0.0.1"
DUMMY_KEY_ID = "lance-ray-test-key-id"
DUMMY_SECRET = "lance-ray-test-secret-do-not-leak"


def free_port() -> int:
    """A port nothing listens on right now (bind port 0 and release it)."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


def s3_env(port: int) -> dict[str, str]:
    """The environment that points Lance, pyarrow and boto-style clients at the server."""
    return {"AWS_ACCESS_KEY_ID": DUMMY_KEY_ID, "AWS_SECRET_ACCESS_KEY": DUMMY_SECRET,
            "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": f"http://{HOST}:{port}", "AWS_ALLOW_HTTP": "true",
            # pyarrow would otherwise look for EC2 instance metadata when keys are missing.
            "AWS_EC2_METADATA_DISABLED": "true"}


def _wait_listening(port: int, timeout: float = 30.0, proc: subprocess.Popen | None = None
                    ) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"moto_server exited with code {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://{HOST}:{port}/moto-api/data.json", timeout=2)
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError(f"moto_server did not answer on {HOST}:{port} within {timeout:.0f}s")


def _die_with_parent() -> None:
    """Linux: the server gets SIGTERM when the thread that started it dies, even by SIGKILL
    (no orphans; start it from a thread that lives as long as it should)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class LocalS3:
    """One moto server process, owned (and stopped) by whoever started it."""

    port: int
    proc: subprocess.Popen

    @classmethod
    def start(cls, port: int | None = None, log: Path | None = None) -> LocalS3:
        exe = Path(sys.executable).with_name("moto_server")
        if not exe.exists():
            raise RuntimeError(f"{exe} not found: install the dev extras (pip install -e '.[dev]')")
        port = port or free_port()
        out = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
        proc = subprocess.Popen([str(exe), "-H", HOST, "-p", str(port)], stdout=out,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent)
        try:
            _wait_listening(port, proc=proc)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        return cls(port, proc)

    @property
    def endpoint(self) -> str:
        return f"http://{HOST}:{self.port}"

    def env(self) -> dict[str, str]:
        return s3_env(self.port)

    def create_bucket(self, bucket: str) -> None:
        import pyarrow.fs as pafs

        fs = pafs.S3FileSystem(access_key=DUMMY_KEY_ID, secret_key=DUMMY_SECRET,
                               region="us-east-1", endpoint_override=self.endpoint,
                               allow_bucket_creation=True)
        fs.create_dir(bucket)

    def freeze(self) -> None:
        """Stop the server process (SIGSTOP): connections hang, objects are kept."""
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGCONT)
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Forwarder:
    """A loopback TCP port forwarding to ``target_port`` that can go down and come back on
    the same port: while down, connections are refused and open ones are cut."""

    def __init__(self, target_port: int, port: int | None = None):
        self.target_port, self.port = target_port, port or free_port()
        self._server: socket.socket | None = None
        self._conns: set[socket.socket] = set()
        self._lock = threading.Lock()
        self.up()

    def up(self) -> None:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((HOST, self.port))
        server.listen(64)
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def down(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            with contextlib.suppress(OSError):
                server.shutdown(socket.SHUT_RDWR)
            server.close()
        with self._lock:
            conns, self._conns = self._conns, set()
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
            c.close()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                client, _ = server.accept()
            except OSError:
                return  # closed by down()
            try:
                upstream = socket.create_connection((HOST, self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns.update((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
            with self._lock:
                self._conns.discard(src)


def main() -> None:
    """Run a server in the foreground and print its environment:
    ``python -m lance_ray.testing.local_s3``."""
    server = LocalS3.start()
    server.create_bucket("lance-ray")
    for k, v in server.env().items():
        print(f"export {k}={v}")
    print(f"# bucket s3://lance-ray at {server.endpoint}; Ctrl-C stops it", flush=True)
    try:
        server.proc.wait()
    except KeyboardInterrupt:
        server.stop()


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
