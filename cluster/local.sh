#!/usr/bin/env bash
# A multi-node Ray cluster on one machine: a head plus N worker nodes, each a separate
# `ray start` with its own --temp-dir (two raylets sharing one session dir break a job's
# working_dir). Worker nodes carry a custom "slot" resource; train workers ask for slots,
# not CPUs, so they never starve Ray Data's read tasks of CPU.
#
#   cluster/local.sh start [N]    head + N worker nodes (default 1)
#   cluster/local.sh resize N     add or remove worker nodes until there are N
#   cluster/local.sh status       ray status
#   cluster/local.sh address      the dashboard address for `ray job submit --address`
#   cluster/local.sh stop         stop every node this script started (by recorded pids)
#
# A node's Ray temp dir holds its Unix sockets, whose paths may not exceed 107 bytes: it is
# a short dir of its own (`mktemp -d /tmp/lrc.XXXXXX`, named in <cluster dir>/<node>.dir),
# not one under the cluster dir, which may lie deep in a checkout. `stop` moves the node's
# logs to <cluster dir>/logs/<node> and removes the temp dir.
#
# `start` refuses ports that are in use (a second cluster on the same ports would join or
# fight the first). Each recorded pid is kept with its start time, and `stop` signals a pid
# only while it is still the process recorded (never one that reused its number), and only
# Ray's own processes of the node: never another program that names its temp dir. A
# `start` that fails stops what it started.
#
# Settings (environment): LANCE_RAY_CLUSTER_DIR (default runs/cluster), RAY_PORT (6390),
# DASHBOARD_PORT (8275), AGENT_PORT (52400; node i uses AGENT_PORT+i), CLIENT_PORT (10001),
# NODE_CPUS (1), NODE_SLOTS (2). Every node gets its own agent port: on one machine they
# would otherwise all bind Ray's default and only one could accept job submissions.
set -euo pipefail

DIR=${LANCE_RAY_CLUSTER_DIR:-runs/cluster}
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
RAY_PORT=${RAY_PORT:-6390}
DASHBOARD_PORT=${DASHBOARD_PORT:-8275}
AGENT_PORT=${AGENT_PORT:-52400}
CLIENT_PORT=${CLIENT_PORT:-10001}
NODE_CPUS=${NODE_CPUS:-1}
NODE_SLOTS=${NODE_SLOTS:-2}
RAY=${RAY:-ray}
TMP_PREFIX=/tmp/lrc.  # the nodes' temp dirs: short, whatever the checkout's path
# One auth mode everywhere: a worker node that disagrees with the head never joins.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
export RAY_USAGE_STATS_ENABLED=0

die() { echo "cluster/local.sh: $*" >&2; exit 2; }

# A node's processes: Ray's programs that name the node's temp dir on their command line,
# and their descendants (agents and task workers rename themselves "ray::..."). Ray's
# programs only: a user's `tail -f <temp dir>/session_latest/logs/raylet.out` names it too.
node_pids() {
  local p
  for p in $(pgrep -f -- "$1(/|[[:space:]]|\$)" || true); do
    if is_ray "$p"; then tree "$p"; fi
  done
}
# Ray's programs: a binary of the ray package (gcs_server, raylet), or Python running one of
# its scripts (the dashboard, the monitors, a worker before it renames itself).
RAY_PROGRAM='^([^ ]*/ray/core/src/ray/[^ ]*|[^ ]*python[^ ]*( -[^ ]+)* [^ ]*/ray/[^ ]*\.py)( |$)'
is_ray() { [[ $(ps -o args= -p "$1" 2>/dev/null) =~ $RAY_PROGRAM ]]; }
tree() {  # pid $1 and its descendants, one a line
  local c
  echo "$1"
  for c in $(pgrep -P "$1" || true); do tree "$c"; done
}

# The head's Ray client server names neither the temp dir nor a parent that lives on
# (`ray start` exits), but it names the head's node id, which the head's GCS wrote into the
# temp dir (session_latest/gcs_server_port_<node id>) before the client server started:
# it is this head's, never another cluster's.
client_server_pids() {
  local f
  for f in "$1"/session_latest/gcs_server_port_*; do
    if [ -e "$f" ]; then
      pgrep -f -- "ray\.util\.client\.server .*--node-id=${f##*_port_}( |\$)" || true
    fi
  done
}

# Whether TCP port $1 is free for a server: bind it as one would (SO_REUSEADDR: the
# TIME_WAIT of a closed connection does not block a server, a listening socket does).
port_free() {
  python3 -c 'import socket, sys
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("", int(sys.argv[1])))' "$1" 2>/dev/null
}
require_free() {  # refuse port $1 (the setting $2) while something else holds it
  # Ray keeps 10002-19999 for its workers' ports (`ray start --min/max-worker-port`), and
  # refuses to start a component on one of them.
  if [ "$1" -ge 10002 ] && [ "$1" -le 19999 ]; then
    die "port $1 ($2) is in Ray's range of worker ports (10002-19999): set ${2%%+*} to a" \
      "port outside it"
  fi
  port_free "$1" || die "port $1 ($2) is in use, by another Ray cluster? Stop that, or set" \
    "${2%%+*}=<a free port> for every cluster/local.sh command"
}

started() {  # the start time of pid $1 (one word; empty once it is gone)
  ps -o lstart= -p "$1" 2>/dev/null | tr -s ' ' '_' || true
}

record() {  # record node $1: its temp dir $2, and each process it has now with its start time
  local name=$1 dir=$2 p s
  echo "$dir" > "$DIR/$name.dir"
  { node_pids "$dir"; for p in $(client_server_pids "$dir"); do tree "$p"; done; } |
    sort -un | while read -r p; do
      s=$(started "$p")
      if [ -n "$s" ]; then echo "$p $s"; fi
    done > "$DIR/$name.pids"
  echo "$name: $(wc -l < "$DIR/$name.pids" | tr -d ' ') processes ($dir)"
}

recorded_alive() {  # the pids of file $1 still running as the process recorded
  local p s
  while read -r p s; do
    if [ -z "$s" ]; then
      echo "pid $p in $1 has no start time (an older local.sh): not signalled" >&2
    elif [ "$(started "$p")" = "$s" ]; then
      echo "$p"
    fi
  done < "$1"
}

stop_node() {  # SIGTERM node $1's processes, SIGKILL what is left after a grace
  local f="$DIR/$1.pids" dir pids alive
  [ -f "$f" ] || return 0
  dir=$(cat "$DIR/$1.dir" 2>/dev/null || true)
  # The recorded pids that are still the processes recorded, their descendants, and the
  # Ray processes the node started since.
  read -ra pids <<< "$( { recorded_alive "$f" | while read -r p; do tree "$p"; done
                         if [ -n "$dir" ]; then node_pids "$dir"; fi; } | sort -un | tr '\n' ' ')"
  if [ "${#pids[@]}" -gt 0 ]; then
    kill "${pids[@]}" 2>/dev/null || true
    alive=
    for _ in $(seq 20); do  # (a zombie is gone: it only waits for its parent to reap it)
      alive=$(ps -o pid=,stat= -p "$(IFS=,; echo "${pids[*]}")" 2>/dev/null |
              awk '$2 !~ /^Z/ { printf "%s ", $1 }' || true)
      if [ -z "${alive// /}" ]; then alive=; break; fi
      sleep 0.5
    done
    if [ -n "$alive" ]; then
      read -ra pids <<< "$alive"
      kill -9 "${pids[@]}" 2>/dev/null || true
    fi
  fi
  # Keep the node's logs (the last run's) in the cluster dir; the rest of a temp dir this
  # script made goes (one an older local.sh made under the cluster dir stays).
  if [[ $dir == "$TMP_PREFIX"* ]] && [ -d "$dir" ]; then
    if [ -d "$dir/session_latest/logs" ]; then
      mkdir -p "$DIR/logs"
      rm -rf "${DIR:?}/logs/$1"
      mv "$dir/session_latest/logs" "$DIR/logs/$1"
    fi
    rm -rf "$dir"
  fi
  rm -f "$f" "$DIR/$1.dir"
  echo "stopped $1"
}

workers() {  # the recorded worker nodes, in order
  local f
  for f in "$DIR"/worker-*.pids; do
    if [ -f "$f" ]; then basename "$f" .pids; fi
  done | sort -t- -k2 -n
}

stop_all() {
  local w
  for w in $(workers); do stop_node "$w"; done
  stop_node head
}

add_worker() {
  local i=1 tmp
  while [ -f "$DIR/worker-$i.pids" ]; do i=$((i + 1)); done
  require_free $((AGENT_PORT + i)) "AGENT_PORT+$i"
  tmp=$(mktemp -d "${TMP_PREFIX}XXXXXX")
  if ! "$RAY" start --address="127.0.0.1:$RAY_PORT" --num-cpus="$NODE_CPUS" \
      --resources="{\"slot\": $NODE_SLOTS}" --temp-dir="$tmp" --disable-usage-stats \
      --dashboard-agent-listen-port=$((AGENT_PORT + i)) >/dev/null; then
    echo "worker-$i failed to start: stopping what it started" >&2
    record "worker-$i" "$tmp" >/dev/null
    stop_node "worker-$i" >/dev/null
    return 1
  fi
  record "worker-$i" "$tmp"
}

count() {  # refuse $2 unless it is a whole number (an error naming the command $1)
  [[ $2 =~ ^[0-9]+$ ]] || die "$1 N: N is a number of worker nodes (0, 1, 2, ...), not '$2'"
}

require_head() {
  [ -f "$DIR/head.pids" ] || die "no cluster of this script in $DIR (no head.pids): start one" \
    "with cluster/local.sh start [N] (or set LANCE_RAY_CLUSTER_DIR to the one started)"
  [ -n "$(recorded_alive "$DIR/head.pids")" ] || die "the head recorded in $DIR is not" \
    "running: cluster/local.sh stop (clears its records), then cluster/local.sh start [N]"
}

cmd=${1:-}
case "$cmd" in
  start)
    n=${2:-1}
    count start "$n"
    if [ -f "$DIR/head.pids" ]; then die "already running (cluster/local.sh stop first)"; fi
    # Every port this start binds, before anything starts: on a port another cluster holds,
    # `ray start` would join or fail against that cluster.
    require_free "$RAY_PORT" RAY_PORT
    require_free "$DASHBOARD_PORT" DASHBOARD_PORT
    require_free "$CLIENT_PORT" CLIENT_PORT
    require_free "$AGENT_PORT" AGENT_PORT
    for i in $(seq "$n"); do require_free $((AGENT_PORT + i)) "AGENT_PORT+$i"; done
    trap 'echo "start failed: stopping the nodes it started" >&2; stop_all >&2' EXIT
    tmp=$(mktemp -d "${TMP_PREFIX}XXXXXX")
    ok=1
    "$RAY" start --head --port="$RAY_PORT" --num-cpus="$NODE_CPUS" --resources='{"slot": 0}' \
      --temp-dir="$tmp" --dashboard-host=127.0.0.1 --dashboard-port="$DASHBOARD_PORT" \
      --include-dashboard=true --disable-usage-stats --dashboard-agent-listen-port="$AGENT_PORT" \
      --ray-client-server-port="$CLIENT_PORT" >/dev/null || ok=
    record head "$tmp"
    [ -n "$ok" ] || exit 1
    for _ in $(seq "$n"); do add_worker; done
    trap - EXIT
    echo "cluster up: ray job submit --address $("$0" address) --working-dir . -- python -m jobs...."
    ;;
  resize)
    want=${2:-}
    count resize "$want"
    require_head
    have=$(workers | wc -l)
    while [ "$have" -lt "$want" ]; do add_worker; have=$((have + 1)); done
    while [ "$have" -gt "$want" ]; do stop_node "$(workers | tail -1)"; have=$((have - 1)); done
    ;;
  status) require_head; "$RAY" status --address="127.0.0.1:$RAY_PORT" ;;
  address) echo "http://127.0.0.1:$DASHBOARD_PORT" ;;
  stop) stop_all ;;
  *) awk 'NR > 1 { if (!/^#/) exit; print }' "$0"; exit 2 ;;
esac
