#!/usr/bin/env bash
# TCP route benchmark: redis-benchmark against redis-server directly, against the same kind of
# redis-server behind an ebb TCP route (woken first, so no cold start is measured) twice, through
# ebb's io_uring relay (the default) and through its copy loop on the proxy threads
# (`--tcp-relay-threads 0`, what ebb does where io_uring cannot be had), and against the direct one
# behind HAProxy in `mode tcp` (two threads, one per core), in one run, in alternating rounds;
# prints requests/s and p99 latency of each (the median of the rounds), the CPU time each proxy
# spent per request and how much of it was the kernel's (system time: the sockets' work), and the
# ratios to HAProxy and to direct. ebb, HAProxy, redis and
# redis-benchmark share the machine's cores.
# Installs redis-server, redis-tools and haproxy (Debian packages) when missing.
# Usage: benches/tcp.sh [REQUESTS] [CLIENTS] [PIPELINE]   (EBB_BIN: an ebb binary to use instead
#        of a release build; BENCH_ROUNDS: rounds, default 3; BENCH_PERF=FILE: a `perf record`
#        profile of ebb over its rounds, written to FILE, BENCH_PERF_ARGS its options; EBB_SERVE_ARGS: more `ebb serve` flags)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
source benches/lib.sh

requests="${1:-200000}"
clients="${2:-50}"
pipeline="${3:-1}"
rounds="${BENCH_ROUNDS:-3}"
bench_packages redis-server redis-tools haproxy
bench_ebb
bench_workdir
bench_awake

base="${BENCH_PORT_BASE:-18100}"
direct_port=$((base + 1)); route_port=$((base + 2)); proxy_port=$((base + 3)); admin_port=$((base + 4))
haproxy_port=$((base + 5)); copy_route_port=$((base + 6)); copy_proxy_port=$((base + 7))
copy_admin_port=$((base + 8))
redis_args="--bind 127.0.0.1 --save '' --appendonly no"
redis-server --port "$direct_port" --bind 127.0.0.1 --save '' --appendonly no >"$work/redis.log" 2>&1 &
pids+=($!)
cat >"$work/ebb.toml" <<TOML
[[app]]
name = "redis"
domains = []
listen = "127.0.0.1:$route_port"
command = ["sh", "-c", "exec redis-server --port \$PORT $redis_args"]
idle_after_ms = 600000
TOML
EBB_LOG=warn "$ebb" serve --config "$work/ebb.toml" --data-dir "$work/data" \
  --listen "127.0.0.1:$proxy_port" --admin-listen "127.0.0.1:$admin_port" ${EBB_SERVE_ARGS:-} >"$work/ebb.log" 2>&1 &
pids+=($!)
ebb_pid=$!
# The same, copying on the proxy threads.
mkdir -p "$work/copy"
sed "s/127.0.0.1:$route_port/127.0.0.1:$copy_route_port/" "$work/ebb.toml" >"$work/copy/ebb.toml"
EBB_LOG=warn "$ebb" serve --config "$work/copy/ebb.toml" --data-dir "$work/copy/data" \
  --listen "127.0.0.1:$copy_proxy_port" --admin-listen "127.0.0.1:$copy_admin_port" \
  --tcp-relay-threads 0 ${EBB_SERVE_ARGS:-} >"$work/copy/ebb.log" 2>&1 &
pids+=($!)
copy_pid=$!
cat >"$work/haproxy.cfg" <<HAPROXY
global
  nbthread 2
  maxconn 4096
defaults
  mode tcp
  timeout connect 5s
  timeout client 60s
  timeout server 60s
listen redis
  bind 127.0.0.1:$haproxy_port
  server redis 127.0.0.1:$direct_port maxconn 4096
HAPROXY
haproxy -db -f "$work/haproxy.cfg" >"$work/haproxy.log" 2>&1 &
pids+=($!)
haproxy_pid=$!
for _ in $(seq 1 100); do
  redis-cli -p "$direct_port" PING >/dev/null 2>&1 && break
  sleep 0.1
done
# Waits for ebb's ports, whose first PING wakes the route's redis (held until it is ready).
for port in "$route_port" "$copy_route_port"; do
  for _ in $(seq 1 300); do
    [ "$(redis-cli -p "$port" PING 2>/dev/null)" = PONG ] && break
    sleep 0.1
  done
  [ "$(redis-cli -p "$port" PING)" = PONG ] || { echo "ebb's TCP route on $port does not answer" >&2; cat "$work/ebb.log" "$work/copy/ebb.log" >&2; exit 1; }
done

rps() { # port -> "requests/s p99(ms)" of PING, SET and GET, each the mean of the three tests
  # (redis-benchmark's CSV: test, rps, avg, min, p50, p95, p99, max)
  redis-benchmark -h 127.0.0.1 -p "$1" -n "$requests" -c "$clients" -P "$pipeline" -t ping_mbulk,set,get --csv 2>/dev/null |
    awk -F'","' 'NR > 1 { gsub(/"/, "", $2); sum += $2; p99 += $7; n++ } END { printf "%.0f %.3f", sum / n, p99 / n }'
}
run() { # PORT [PID] -> "requests/s CPU-per-request(us) p99(ms) kernel-CPU-per-request(us)"
  # (CPU only for a PID)
  local t0=0 t1=0 k0=0 k1=0 r
  [ -n "${2:-}" ] && t0=$(ticks "$2") && k0=$(kernel_ticks "$2")
  r=$(rps "$1")
  [ -n "${2:-}" ] && t1=$(ticks "$2") && k1=$(kernel_ticks "$2")
  # redis-benchmark runs 3 tests of $requests requests each.
  awk -v r="${r% *}" -v p="${r#* }" -v t=$((t1 - t0)) -v k=$((k1 - k0)) -v n="$((requests * 3))" \
    'BEGIN { printf "%s %.2f %s %.2f\n", r, t * 10000 / n, p, k * 10000 / n }'
}
median() { sort -n | awk '{ a[NR] = $1 } END { print a[int((NR + 1) / 2)] }'; }

: >"$work/direct"; : >"$work/ebb"; : >"$work/copy.txt"; : >"$work/haproxy"
for _ in $(seq 1 "$rounds"); do
  run "$direct_port" >>"$work/direct"
  bench_perf_start "$ebb_pid"
  run "$route_port" "$ebb_pid" >>"$work/ebb"
  bench_perf_stop
  run "$copy_route_port" "$copy_pid" >>"$work/copy.txt"
  run "$haproxy_port" "$haproxy_pid" >>"$work/haproxy"
done
col() { awk -v c="$2" '{ print $c }' "$work/$1" | median; }
direct=$(col direct 1); direct_p99=$(col direct 3)
through=$(col ebb 1); ebb_cpu=$(col ebb 2); ebb_p99=$(col ebb 3); ebb_k=$(col ebb 4)
copied=$(col copy.txt 1); copy_cpu=$(col copy.txt 2); copy_p99=$(col copy.txt 3); copy_k=$(col copy.txt 4)
hap=$(col haproxy 1); hap_cpu=$(col haproxy 2); hap_p99=$(col haproxy 3); hap_k=$(col haproxy 4)
echo "redis-benchmark: $requests requests each of PING, SET, GET; $clients clients; pipeline $pipeline; median of $rounds alternating rounds"
echo
echo "| target | requests/s | p99 (mean of the 3 tests) | proxy CPU per request | of it in the kernel |"
echo "|---|---|---|---|---|"
echo "| redis directly | $direct | ${direct_p99} ms | - | - |"
echo "| ebb (TCP route, io_uring relay) | $through | ${ebb_p99} ms | ${ebb_cpu}us | ${ebb_k}us |"
echo "| ebb (TCP route, copy loop) | $copied | ${copy_p99} ms | ${copy_cpu}us | ${copy_k}us |"
echo "| HAProxy mode tcp | $hap | ${hap_p99} ms | ${hap_cpu}us | ${hap_k}us |"
ratio() { # label, throughput, p99, CPU of ebb's row
  awk -v l="$1" -v a="$2" -v b="$hap" -v p="$3" -v q="$hap_p99" -v c="$4" -v d="$hap_cpu" 'BEGIN {
    printf "| %s / HAProxy | %.2f x throughput | %.2f x p99 | %.2f x CPU per request |\n", l, a / b,
      (q > 0 ? p / q : 0), (d > 0 ? c / d : 0) }'
}
ratio "ebb" "$through" "$ebb_p99" "$ebb_cpu"
ratio "ebb copy loop" "$copied" "$copy_p99" "$copy_cpu"
awk -v a="$through" -v b="$direct" 'BEGIN { printf "| ebb / direct | %.2f x throughput | | |\n", a / b }'
echo
echo "each round, requests/s / proxy CPU per request (us) / p99 (ms):"
for f in direct ebb copy.txt haproxy; do
  printf '%-10s %s\n' "${f%.txt}" "$(awk '{ printf "%s/%s/%s  ", $1, $2, $3 }' "$work/$f")"
done
