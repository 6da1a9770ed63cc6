"""cluster/local.sh against a stand-in for the `ray` CLI (no Ray node starts, a few seconds):
a node's temp dir is short however deep the cluster dir lies (Ray's Unix socket paths under
it may not exceed 107 bytes), `start` refuses a port in use with one line, a failed `start`
and `stop` signal their own cluster's processes only (never another cluster's client server,
never a `tail -f` of a node's log), `status` with no cluster says so at once; and the demo
names a step that fails in one line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "cluster" / "local.sh"

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(),
                                reason="reads process states from /proc (Linux)")

# A stand-in for `ray start` / `ray status`. A node is a Python process running a script of
# a "ray" package that names the node's temp dir (as Ray's own programs do), with a child (a
# task worker); a head also runs a "client server" that names the node id and the ports, as
# Ray's does, and records that id in the temp dir where Ray's GCS does. FAKE_FAIL=1: the
# start fails after starting all that.
FAKE_RAY = r"""#!/usr/bin/env bash
set -eu
[ "$1" = status ] && { echo "fake status"; exit 0; }
head= tmp= port= client= ready=
for a; do
  case $a in
    --head) head=1 ;;
    --temp-dir=*) tmp=${a#*=} ;;
    --port=*) port=${a#*=} ;;
    --ray-client-server-port=*) client=${a#*=} ;;
  esac
done
mkdir -p "$tmp/session_1/logs"
ln -s "$tmp/session_1" "$tmp/session_latest"
echo started > "$tmp/session_1/logs/raylet.out"
nohup "$FAKE_PY" "$FAKE_PKG/ray/node.py" --temp-dir="$tmp" >/dev/null 2>&1 &
if [ -n "$head" ]; then
  touch "$tmp/session_1/gcs_server_port_node$$"
  ready=$FAKE_PKG/client-ready-$$
  nohup "$FAKE_PY" "$FAKE_PKG/client.py" "$ready" -m ray.util.client.server \
    --address=127.0.0.1:$port --port=$client --node-id=node$$ >/dev/null 2>&1 &
fi
until [ -e "$tmp/node-ready" ] && { [ -z "$head" ] || [ -e "$ready" ]; }; do
  sleep 0.05
done
[ -z "${FAKE_FAIL:-}" ]
"""

FAKE_CLIENT_SERVER = """import pathlib, sys, time
pathlib.Path(sys.argv[1]).touch()
time.sleep(600)
"""

FAKE_NODE = """import pathlib, subprocess, sys, time
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
pathlib.Path(sys.argv[1].split("=", 1)[1], "node-ready").touch()
time.sleep(600)
"""


def free_ports(n: int) -> int:
    """A port p with p .. p+n-1 all free (for AGENT_PORT and its per-node successors)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("", 0))
            base = s.getsockname()[1]
        if base + n > 65535:
            continue
        try:
            for p in range(base, base + n):
                with socket.socket() as s:
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    s.bind(("", p))
            return base
        except OSError:
            continue
    raise RuntimeError("no free ports")


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"


def pids(cluster: Path, node: str) -> list[int]:
    return [int(line.split()[0]) for line in (cluster / f"{node}.pids").read_text().splitlines()]


class Clusters:
    def __init__(self, tmp_path: Path) -> None:
        pkg = tmp_path / "pkg" / "ray"
        pkg.mkdir(parents=True)
        (pkg / "node.py").write_text(FAKE_NODE)
        (pkg.parent / "client.py").write_text(FAKE_CLIENT_SERVER)
        ray = tmp_path / "ray"
        ray.write_text(FAKE_RAY)
        ray.chmod(0o755)
        self.base_env = {**os.environ, "RAY": str(ray), "FAKE_PY": sys.executable,
                         "FAKE_PKG": str(tmp_path / "pkg")}
        self.envs: list[dict[str, str]] = []  # every cluster's, to stop at the end
        self.others: list[subprocess.Popen] = []

    def env(self, cluster: Path, **kw: str) -> dict[str, str]:
        env = {**self.base_env, "LANCE_RAY_CLUSTER_DIR": str(cluster),
               "RAY_PORT": str(free_ports(1)), "DASHBOARD_PORT": str(free_ports(1)),
               "CLIENT_PORT": str(free_ports(1)), "AGENT_PORT": str(free_ports(4)), **kw}
        self.envs.append(env)
        return env

    def run(self, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(SCRIPT), *args], env=env, cwd=REPO, capture_output=True,
                              text=True, timeout=60)

    def close(self) -> None:
        for env in self.envs:
            self.run(env, "stop")
        for p in self.others:
            p.kill()
            p.wait()


@pytest.fixture
def clusters(tmp_path: Path) -> Iterator[Clusters]:
    c = Clusters(tmp_path)
    try:
        yield c
    finally:
        c.close()


def test_a_deep_cluster_dir_and_a_users_tail_of_a_node_log(clusters: Clusters,
                                                           tmp_path: Path) -> None:
    cluster = tmp_path / ("a-rather-long-directory-name-" * 4) / "runs" / "cluster"
    env = clusters.env(cluster)
    r = clusters.run(env, "start", "1")
    assert r.returncode == 0, r.stderr
    temp = {n: Path((cluster / f"{n}.dir").read_text().strip()) for n in ("head", "worker-1")}
    for t in temp.values():  # 15 bytes, then Ray's session_<date>_<pid>/sockets/<name>
        assert str(t).startswith("/tmp/lrc.") and len(str(t)) == 15 and t.is_dir(), t
    head, worker = pids(cluster, "head"), pids(cluster, "worker-1")
    assert len(head) == 3 and len(worker) == 2, (head, worker)  # node + child (+ client)

    assert clusters.run(env, "resize", "2").returncode == 0
    log = Path((cluster / "worker-2.dir").read_text().strip()) / "session_latest/logs/raylet.out"
    tail = subprocess.Popen(["tail", "-f", str(log)], stdout=subprocess.DEVNULL)
    clusters.others.append(tail)
    worker2 = pids(cluster, "worker-2")
    r = clusters.run(env, "resize", "1")
    assert r.returncode == 0 and r.stdout == "stopped worker-2\n", r
    assert not any(alive(p) for p in worker2) and alive(tail.pid)
    assert all(alive(p) for p in head + worker)
    assert clusters.run(env, "status").stdout == "fake status\n"

    r = clusters.run(env, "stop")
    assert r.returncode == 0 and r.stdout == "stopped worker-1\nstopped head\n", r
    assert not any(alive(p) for p in head + worker) and alive(tail.pid)
    assert not any(t.exists() for t in temp.values())
    assert (cluster / "logs" / "head" / "raylet.out").read_text() == "started\n"
    assert sorted(p.name for p in cluster.iterdir()) == ["logs"]


def test_a_port_in_use_and_a_failed_start_leave_the_other_cluster_alone(
        clusters: Clusters, tmp_path: Path) -> None:
    first = tmp_path / "c1"
    env1 = clusters.env(first)
    assert clusters.run(env1, "start", "1").returncode == 0
    running = pids(first, "head") + pids(first, "worker-1")

    # The same ports for a second cluster: refused before anything starts.
    second = tmp_path / "c2"
    same = {k: env1[k] for k in ("RAY_PORT", "DASHBOARD_PORT", "CLIENT_PORT", "AGENT_PORT")}
    with socket.socket() as s:  # the fake nodes listen nowhere: hold the port here
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("", int(same["CLIENT_PORT"])))
        s.listen()
        r = clusters.run(clusters.env(second, **same), "start", "1")
    assert r.returncode == 2 and r.stdout == "", r
    assert r.stderr == (f"cluster/local.sh: port {same['CLIENT_PORT']} (CLIENT_PORT) is in use, "
                        "by another Ray cluster? Stop that, or set CLIENT_PORT=<a free port> "
                        "for every cluster/local.sh command\n"), r.stderr
    assert not list(second.glob("*.pids"))

    # A start that fails once its head runs (its client server named like the first one's
    # but for the node id) stops its own processes only.
    r = clusters.run(clusters.env(second, FAKE_FAIL="1", **same), "start", "1")
    assert r.returncode == 1 and "stopped head" in r.stderr, r
    assert not list(second.glob("*.pids")) and not list(second.glob("*.dir"))
    assert all(alive(p) for p in running)


def test_status_without_a_cluster_says_so_at_once(clusters: Clusters, tmp_path: Path) -> None:
    started = time.monotonic()
    r = clusters.run(clusters.env(tmp_path / "none"), "status")
    assert time.monotonic() - started < 10
    assert r.returncode == 2 and r.stdout == "", r
    assert len(r.stderr.splitlines()) == 1 and "no cluster of this script" in r.stderr, r.stderr


def test_the_demo_names_a_failed_step_in_one_line() -> None:
    from jobs.demo import run

    with pytest.raises(SystemExit) as e:
        run([sys.executable, "-c", "raise SystemExit(3)"], dict(os.environ),
            title="start a local cluster")
    assert e.value.code == "demo: step 'start a local cluster' failed (exit status 3)"



def test_a_port_in_rays_worker_port_range_is_refused(clusters: Clusters, tmp_path: Path) -> None:
    # Ray keeps 10002-19999 for its workers and refuses a component there, with a traceback.
    r = clusters.run(clusters.env(tmp_path / "c", CLIENT_PORT="10201"), "start", "1")
    assert r.returncode == 2 and r.stderr == (
        "cluster/local.sh: port 10201 (CLIENT_PORT) is in Ray's range of worker ports "
        "(10002-19999): set CLIENT_PORT to a port outside it\n"), r.stderr
    assert not list((tmp_path / "c").glob("*.pids"))
