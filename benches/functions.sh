#!/usr/bin/env bash
# Function instances end to end (`ebb bench functions`): instances/s for a one-step no-op function
# and a three-step chain, and POST-to-result p50/p99 for a warm function, through a real
# `ebb serve` with example-app functions. Usage: benches/functions.sh [SECONDS]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
cargo build --locked --release --bin ebb
"$CARGO_TARGET_DIR/release/ebb" bench functions --seconds "${1:-5}"
