#!/usr/bin/env bash
# Start N hybridgnn replicas and a load balancer on this machine, e.g.
#   deploy/launch-local.sh --replicas 3 --balancer haproxy -- --dataset data/d --model models/m
# Arguments are those of `hybridgnn cluster` (see --help); after `--`, those of `hybridgnn serve`.
# Needs haproxy or nginx on PATH (Debian: apt-get install haproxy nginx-light).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
hybridgnn=${HYBRIDGNN_BIN:-$root/.venv/bin/hybridgnn}
if [ ! -x "$hybridgnn" ]; then
  bash "$root/scripts/setup.sh"
fi
exec "$hybridgnn" cluster "$@"
