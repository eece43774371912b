#!/usr/bin/env bash
# Load balancing on this machine (`ebb bench discovery`): nanoseconds per pick of each balancer
# over 3, 100, 1,000 and 10,000 instances, against one uniform random index from the same
# generator. Usage: benches/discovery.sh [MILLIS_PER_CELL]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
cargo build --locked --release --bin ebb
"$CARGO_TARGET_DIR/release/ebb" bench discovery --millis "${1:-300}"
