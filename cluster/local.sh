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

# Every process a node starts has the node's temp dir on its command line, or descends
# from one that has (agents and task workers rename themselves "ray::...").
node_pids() { tree $(pgrep -f -- "$1(/|[[:space:]]|\$)" || true); }
tree() { local p; for p in "$@"; do echo "$p"; tree $(pgrep -P "$p" || true); done; }

record() {  # record node $1: its temp dir, and the pids it has now
  echo "$2" > "$DIR/$1.dir"
  node_pids "$2" > "$DIR/$1.pids"
  echo "$1: $(wc -l < "$DIR/$1.pids") processes ($2)"
}

stop_node() {  # SIGTERM the recorded pids of node $1, SIGKILL what is left after a grace
  local f="$DIR/$1.pids"
  [ -f "$f" ] || return 0
  # The recorded pids plus processes the node started since (its task workers).
  local pids; pids=$(sort -u "$f" <(tree $(cat "$f")) <(node_pids "$(cat "$DIR/$1.dir")") \
    | tr '\n' ' ')
  if [ -n "$pids" ]; then
    kill $pids 2>/dev/null || true
    for _ in $(seq 20); do
      alive=$(ps -o pid= -p $(echo $pids | tr ' ' ',') 2>/dev/null || true)
      [ -z "$alive" ] && break
      sleep 0.5
    done
    [ -n "${alive:-}" ] && kill -9 $alive 2>/dev/null || true
  fi
  rm -f "$f" "$DIR/$1.dir"
  echo "stopped $1"
}

workers() { ls "$DIR" 2>/dev/null | sed -n 's/^\(worker-[0-9]*\)\.pids$/\1/p' | sort -t- -k2 -n; }

add_worker() {
  local i=1
  while [ -f "$DIR/worker-$i.pids" ]; do i=$((i + 1)); done
  local tmp="$DIR/tmp-w$i"
  "$RAY" start --address="127.0.0.1:$RAY_PORT" --num-cpus="$NODE_CPUS" \
    --resources="{\"slot\": $NODE_SLOTS}" --temp-dir="$tmp" --disable-usage-stats \
    --dashboard-agent-listen-port=$((AGENT_PORT + i)) >/dev/null
  record "worker-$i" "$tmp"
}

cmd=${1:-}
case "$cmd" in
  start)
    n=${2:-1}
    if [ -f "$DIR/head.pids" ]; then echo "already running (cluster/local.sh stop first)"; exit 1; fi
    "$RAY" start --head --port="$RAY_PORT" --num-cpus="$NODE_CPUS" --resources='{"slot": 0}' \
      --temp-dir="$DIR/tmp-head" --dashboard-host=127.0.0.1 --dashboard-port="$DASHBOARD_PORT" \
      --include-dashboard=true --disable-usage-stats --dashboard-agent-listen-port="$AGENT_PORT" \
      --ray-client-server-port="$CLIENT_PORT" >/dev/null
    record head "$DIR/tmp-head"
    for _ in $(seq "$n"); do add_worker; done
    echo "cluster up: ray job submit --address $("$0" address) --working-dir . -- python -m jobs...."
    ;;
  resize)
    want=${2:?usage: resize N}
    have=$(workers | wc -l)
    while [ "$have" -lt "$want" ]; do add_worker; have=$((have + 1)); done
    while [ "$have" -gt "$want" ]; do stop_node "$(workers | tail -1)"; have=$((have - 1)); done
    ;;
  status) "$RAY" status --address="127.0.0.1:$RAY_PORT" ;;
  address) echo "http://127.0.0.1:$DASHBOARD_PORT" ;;
  stop)
    for w in $(workers); do stop_node "$w"; done
    stop_node head
    ;;
  *) sed -n '2,16p' "$0"; exit 2 ;;
esac
