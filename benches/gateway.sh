#!/usr/bin/env bash
# Gateway API benchmark: an HTTPRoute with a header match and a path rewrite, served by ebb as
# the Gateway on the real control plane (the kube tests' harness, in a network namespace of its
# own; needs root, as the test command), against nginx with the equivalent configuration and the
# app directly, in the same run: throughput and p99 latency (wrk) and their ratios. See
# benches/gateway.rs. Installs wrk and nginx (Debian packages) when missing.
# Usage: benches/gateway.sh [SECONDS] [CONNS]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
need=()
for pkg in wrk nginx; do dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg"); done
if [ ${#need[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ]; then sudo=; else sudo=sudo; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
command -v go >/dev/null 2>&1 || { echo "error: go not found; the control plane is built with it" >&2; exit 1; }
scripts/controlplane check
export EBB_CONTROLPLANE="${EBB_CONTROLPLANE:-$(scripts/controlplane build)}"
export EBB_GATEWAY_SUITE="${EBB_GATEWAY_SUITE:-$(scripts/gateway build)}"
export EBB_LOG="${EBB_LOG:-warn}"
export BENCH_SECONDS="${1:-10}" BENCH_CONNS="${2:-64}"
exec cargo test --locked --profile ci --test gateway_bench
