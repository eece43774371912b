#!/usr/bin/env bash
# Log benchmark: durable append throughput (1, 64, 1024 appenders), unsynced throughput, replay
# speed over a 5-million-event log, open time with and without a snapshot, `ebb explain` of one
# call and one route through the subject index against the whole-log scan (the anchor), and the
# index's one-time rebuild for a log written before it.
# Usage: benches/log.sh [extra `ebb bench log` flags, e.g. --replay-events 1000000 --seconds 5]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
cargo build --locked --release --bin ebb
exec "$CARGO_TARGET_DIR/release/ebb" bench log "$@"
