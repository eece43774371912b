#!/usr/bin/env bash
# Scaling on load, simulated: ebb's policy against Knative's KPA (the anchor) on the same six
# generated traces (step, ramp, spike, diurnal, Poisson bursts, sine): p50/p99 wait for a
# replica, replica-seconds, scale changes per minute, direction reversals, peak replicas.
# Usage: benches/autoscale.sh [extra `ebb bench autoscale` flags, e.g. --seeds 10 --seconds 900]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
cargo build --locked --release --bin ebb
exec "$CARGO_TARGET_DIR/release/ebb" bench autoscale "$@"
