#!/usr/bin/env bash
# Durable calls benchmark: the embedded queue's enqueue-to-start latency at 10,000 calls/s, then
# `ebb bench calls` with the embedded queue and, against Apache Kafka started here on loopback,
# the Kafka queue with one and with two ebb replicas, and the cost of a start forwarded to the
# call's owner against one through the owner. Usage: benches/calls.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
cargo build --locked --release --bin ebb
ebb="$CARGO_TARGET_DIR/release/ebb"
# The embedded queue's latency at half the 20,000 calls/s target, five rounds, before the broker
# starts (so it runs alone).
"$ebb" bench calls --seconds "${1:-5}" --rate 10000 --rounds 5
# Apache Kafka (a KRaft node from scripts/kafka, on loopback), after the embedded rows' latency
# run above.
port="${BENCH_KAFKA_PORT:-19092}"
kdir="$(mktemp -d)"
scripts/kafka run "$kdir" "$port" >"$kdir/broker.log" 2>&1 &
broker=$!
trap 'kill $broker 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$kdir"' EXIT
for _ in $(seq 1 600); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
"$ebb" bench calls --seconds "${1:-5}" --kafka "127.0.0.1:$port"
