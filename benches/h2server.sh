#!/usr/bin/env bash
# ebb's HTTP/2 server side (crates/http/src/h2server.rs) against the h2 crate's server, which the
# proxy serves HTTP/2 with now, on the same recorded client bytes (an h2load-like client's GET
# requests), in one thread with no sockets: each implementation's own work per request, over
# alternating rounds, and their ratio (crates/http/benches/h2server.rs).
# Usage: benches/h2server.sh [REQUESTS] [ROUNDS]   (defaults: 200000 requests, 5 rounds)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
cargo test --locked --release -p ebb-http --test h2server_bench -- "${1:-200000}" "${2:-5}"
