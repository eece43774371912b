#!/usr/bin/env bash
# Kubernetes benchmark: ebb against the real control plane (the kube tests' harness, in a network
# namespace of its own; needs root, as the test command): first request to scale write against a
# bare /scale patch, ebb's share of a cold start against the app's own first byte, and the API
# requests per minute ebb makes for an idle and a busy route, and a function template made through
# one ebb reaching another's watch against a bare create and watch. See benches/kube.rs.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
command -v go >/dev/null 2>&1 || { echo "error: go not found; the control plane is built with it" >&2; exit 1; }
scripts/controlplane check
export EBB_CONTROLPLANE="${EBB_CONTROLPLANE:-$(scripts/controlplane build)}"
export EBB_LOG="${EBB_LOG:-warn}"
exec cargo test --locked --profile ci --test kube_bench
