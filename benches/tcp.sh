#!/usr/bin/env bash
# TCP splice benchmark: redis-benchmark against redis-server directly and against the same kind
# of redis-server behind an ebb TCP route (woken first, so no cold start is measured), in one run,
# in alternating rounds; prints requests/s of each, the median of the rounds, and the ratio
# through ebb / direct. ebb, redis and redis-benchmark share the machine's cores.
# Installs redis-server and redis-tools (Debian packages) when missing.
# Usage: benches/tcp.sh [REQUESTS] [CLIENTS] [PIPELINE]   (EBB_BIN: an ebb binary to use instead
#        of a release build; BENCH_ROUNDS: rounds, default 3)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh

requests="${1:-200000}"
clients="${2:-50}"
pipeline="${3:-1}"
rounds="${BENCH_ROUNDS:-3}"
need=()
for pkg in redis-server redis-tools; do dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg"); done
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then sudo=; else sudo=sudo; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
if [ -n "${EBB_BIN:-}" ]; then
  ebb="$EBB_BIN"
else
  cargo build --locked --release --bin ebb
  ebb="$CARGO_TARGET_DIR/release/ebb"
fi

work="$(mktemp -d)"
pids=()
cleanup() {
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

base="${BENCH_PORT_BASE:-18100}"
direct_port=$((base + 1)); route_port=$((base + 2)); proxy_port=$((base + 3)); admin_port=$((base + 4))
redis_args="--bind 127.0.0.1 --save '' --appendonly no"
redis-server --port "$direct_port" --bind 127.0.0.1 --save '' --appendonly no >"$work/redis.log" 2>&1 &
pids+=($!)
cat >"$work/ebb.toml" <<TOML
[[app]]
name = "redis"
domains = []
listen = "127.0.0.1:$route_port"
command = ["sh", "-c", "exec redis-server --port \$PORT $redis_args"]
idle_after_ms = 600000
TOML
EBB_LOG=warn "$ebb" serve --config "$work/ebb.toml" --data-dir "$work/data" \
  --listen "127.0.0.1:$proxy_port" --admin-listen "127.0.0.1:$admin_port" >"$work/ebb.log" 2>&1 &
pids+=($!)
for _ in $(seq 1 100); do
  redis-cli -p "$direct_port" PING >/dev/null 2>&1 && break
  sleep 0.1
done
# Waits for ebb's port, whose first PING wakes the route's redis (held until it is ready).
for _ in $(seq 1 300); do
  [ "$(redis-cli -p "$route_port" PING 2>/dev/null)" = PONG ] && break
  sleep 0.1
done
[ "$(redis-cli -p "$route_port" PING)" = PONG ] || { echo "ebb's TCP route does not answer" >&2; cat "$work/ebb.log" >&2; exit 1; }

rps() { # port -> requests/s of PING, SET and GET together (redis-benchmark's CSV)
  redis-benchmark -h 127.0.0.1 -p "$1" -n "$requests" -c "$clients" -P "$pipeline" -t ping_mbulk,set,get --csv 2>/dev/null |
    awk -F'","' 'NR > 1 { gsub(/"/, "", $2); sum += $2; n++ } END { printf "%.0f", sum / n }'
}
median() { sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }

: >"$work/direct"; : >"$work/ebb"
for _ in $(seq 1 "$rounds"); do
  rps "$direct_port" >>"$work/direct"; echo >>"$work/direct"
  rps "$route_port" >>"$work/ebb"; echo >>"$work/ebb"
done
direct=$(median <"$work/direct")
through=$(median <"$work/ebb")
echo "redis-benchmark: $requests requests each of PING, SET, GET; $clients clients; pipeline $pipeline; median of $rounds rounds"
printf '  %-22s %10s req/s\n' "redis directly" "$direct" "redis through ebb (TCP)" "$through"
awk -v a="$through" -v b="$direct" 'BEGIN { printf "  ratio ebb/direct        %10.2f\n", a / b }'
