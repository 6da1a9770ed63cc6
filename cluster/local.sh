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
# Each recorded pid is kept with its start time, and `stop` signals a pid only while it is
# still the process recorded (never one that reused its number). The head's Ray client
# server (`--ray-client-server-port`) is recorded with the head. A `start` that fails stops
# what it started.
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
# One auth mode everywhere: a worker node that disagrees with the head never joins.
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
export RAY_USAGE_STATS_ENABLED=0

die() { echo "cluster/local.sh: $*" >&2; exit 2; }

# Every process a node starts has the node's temp dir on its command line, or descends
# from one that has (agents and task workers rename themselves "ray::...").
node_pids() {
  local p
  for p in $(pgrep -f -- "$1(/|[[:space:]]|\$)" || true); do tree "$p"; done
}
tree() {  # pid $1 and its descendants, one a line
  local c
  echo "$1"
  for c in $(pgrep -P "$1" || true); do tree "$c"; done
}

# The head's Ray client server: `ray start` leaves it running on its own (neither the temp
# dir on its command line nor a recorded parent), so match exactly this cluster's ports.
client_server_pids() {
  pgrep -f -- "ray\.util\.client\.server .*--address=[^ ]*:$RAY_PORT .*--port=$CLIENT_PORT( |\$)" \
    || true
}

started() {  # the start time of pid $1 (one word; empty once it is gone)
  ps -o lstart= -p "$1" 2>/dev/null | tr -s ' ' '_' || true
}

record() {  # record node $1: its temp dir $2, and each pid it has now (and $3...) with its start time
  local name=$1 dir=$2 p s
  shift 2
  echo "$dir" > "$DIR/$name.dir"
  { node_pids "$dir"; for p in "$@"; do tree "$p"; done; } | sort -un | while read -r p; do
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
  # processes the node started since (its task workers: they name its temp dir).
  read -ra pids <<< "$( { recorded_alive "$f" | while read -r p; do tree "$p"; done
                         if [ -n "$dir" ]; then node_pids "$dir"; fi; } | sort -un | tr '\n' ' ')"
  if [ "${#pids[@]}" -gt 0 ]; then
    kill "${pids[@]}" 2>/dev/null || true
    alive=
    for _ in $(seq 20); do
      alive=$(ps -o pid= -p "$(IFS=,; echo "${pids[*]}")" 2>/dev/null | tr -s ' \n' ' ' || true)
      if [ -z "${alive// /}" ]; then alive=; break; fi
      sleep 0.5
    done
    if [ -n "$alive" ]; then
      read -ra pids <<< "$alive"
      kill -9 "${pids[@]}" 2>/dev/null || true
    fi
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
  local i=1
  while [ -f "$DIR/worker-$i.pids" ]; do i=$((i + 1)); done
  local tmp="$DIR/tmp-w$i"
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
    trap 'echo "start failed: stopping the nodes it started" >&2; stop_all >&2' EXIT
    ok=1
    "$RAY" start --head --port="$RAY_PORT" --num-cpus="$NODE_CPUS" --resources='{"slot": 0}' \
      --temp-dir="$DIR/tmp-head" --dashboard-host=127.0.0.1 --dashboard-port="$DASHBOARD_PORT" \
      --include-dashboard=true --disable-usage-stats --dashboard-agent-listen-port="$AGENT_PORT" \
      --ray-client-server-port="$CLIENT_PORT" >/dev/null || ok=
    # shellcheck disable=SC2046  # one argument a pid
    record head "$DIR/tmp-head" $(client_server_pids)
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
  status) "$RAY" status --address="127.0.0.1:$RAY_PORT" ;;
  address) echo "http://127.0.0.1:$DASHBOARD_PORT" ;;
  stop) stop_all ;;
  *) awk 'NR > 1 { if (!/^#/) exit; print }' "$0"; exit 2 ;;
esac
