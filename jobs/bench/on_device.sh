#!/usr/bin/env bash
# The many-core and GPU benchmarks in one bounded run on a machine with many cores and a GPU.
#
#   bash jobs/bench/on_device.sh [cores|device|all] [--small]
#
# Run it from a checkout, with lance_ray's dependencies importable. On a bare machine that
# has no Ray or Lance installed and no network, pack a site-packages directory with them into
# an xz tar, split it into pieces named site.part.*, copy the pieces to /tmp/stage there, and
# the script unpacks them into /tmp/site on its first run.
#
# Each phase stays under ten minutes, and the benchmarks write each figure to $OUT (default
# /tmp/lance_ray_out) as its case ends, so a phase cut short still leaves what it measured.
# Copy $OUT/cores-<gpu>.json and device-<gpu>.json (<gpu>: h200, h100, ...) to docs/bench/,
# then run `python -m jobs.bench.performance` to refresh docs/performance.md.
set -uo pipefail
phase=${1:-all}
small=${2:-}
out=${OUT:-/tmp/lance_ray_out}
mkdir -p "$out"
here=$(pwd)

if ! python3 -c "import ray, lancedb, lance" 2>/dev/null; then
  if [ ! -d /tmp/site/ray ]; then
    ls /tmp/stage/site.part.* >/dev/null || { echo "no bundle in /tmp/stage" >&2; exit 2; }
    cat /tmp/stage/site.part.* | python3 -c "import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall('/tmp/site')"
  fi
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$here PYTHONUNBUFFERED=1
cores=$(nproc)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)
machine="$cores-core ${gpu:-no-GPU} machine"
# The results' names, as docs/bench keeps them: cores-h200.json, device-h200.json, ...
tag=$(echo "$gpu" | grep -oiE '[a-z][0-9]{2,4}' | head -1 | tr '[:upper:]' '[:lower:]')
tag=${tag:-${cores}core}
{ echo "$machine"; nproc; free -g; nvidia-smi 2>/dev/null | head -15; } > "$out/machine.txt"

if [ -n "$small" ]; then
  sizes=(--small); device_rows=(--small)
else
  # Sized so that each phase ends well inside a call's 600 s on 16 cores: the reference's
  # images (about 3k/s there) are the longest case. The 64 KB rows keep their full 32,000
  # (2 GB): at 64 MiB a read task, fewer would not give each of 16 slots two tasks.
  sizes=(--images 30000); device_rows=()
fi

if [ "$phase" = cores ] || [ "$phase" = all ]; then
  timeout 330 python3 -m jobs.bench.cores --cores "$cores" --out "$out" --machine "$machine" \
    --name "cores-$tag" \
    "${sizes[@]}" 2>&1 | tee "$out/cores.log" | grep -v "INFO\|WARNING" | tail -40
fi
if [ "$phase" = device ] || [ "$phase" = all ]; then
  timeout 300 python3 -m jobs.bench.device --out "$out" --machine "$machine" --name "device-$tag" \
    "${device_rows[@]}" 2>&1 | tee "$out/device.log" | grep -v "INFO\|WARNING" | tail -40
fi
ls -l "$out"
