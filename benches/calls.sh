#!/usr/bin/env bash
# Durable calls benchmark: the embedded queue's enqueue-to-start latency at 10,000 calls/s, then
# `ebb bench calls` with the embedded queue and, against a tansu broker started here on loopback,
# the Kafka queue. Usage: benches/calls.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
cargo build --locked --release --bin ebb
ebb="$CARGO_TARGET_DIR/release/ebb"
# The embedded queue's latency at half the 20,000 calls/s target, five rounds, before the broker
# starts (so it runs alone).
"$ebb" bench calls --seconds "${1:-5}" --rate 10000 --rounds 5
tansu="${EBB_TANSU:-${XDG_CACHE_HOME:-$HOME/.cache}/ebb/tools/bin/tansu}"
[ -x "$tansu" ] || { echo "error: no tansu at $tansu (./scripts/test installs it)" >&2; exit 1; }
port="${BENCH_KAFKA_PORT:-19092}"
"$tansu" broker --listener-url "tcp://127.0.0.1:$port" --advertised-listener-url "tcp://127.0.0.1:$port" \
  --storage-engine memory://tansu/ >/dev/null 2>&1 &
broker=$!
trap 'kill $broker 2>/dev/null || true; wait 2>/dev/null || true' EXIT
for _ in $(seq 1 200); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.05; done
"$ebb" bench calls --seconds "${1:-5}" --kafka "127.0.0.1:$port"
