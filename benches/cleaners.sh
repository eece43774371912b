#!/usr/bin/env bash
# Cleaners on this machine (`ebb bench cleaners`): the schedule of 100,000 cleaners against a bare
# BinaryHeap, CEL evaluations/s of the cleaner proposal's condition against the same condition in
# Rust, and the loop's lateness against a bare tokio timer. The re-evaluation latency after a
# target change on the real API server is in benches/kube.sh. Usage: benches/cleaners.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
cargo build --locked --release --bin ebb
"$CARGO_TARGET_DIR/release/ebb" bench cleaners --seconds "${1:-3}"
