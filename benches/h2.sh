#!/usr/bin/env bash
# HTTP/2 and gRPC benchmark, in one go on this machine: h2load (Debian's nghttp2-client) with
# prior-knowledge h2c against the example app directly, and against ebb, nginx and HAProxy in
# front of it, in alternating rounds:
#   1. h2c: GET / (echo), each proxy taking HTTP/2 from the client and keeping HTTP/1.1
#      keep-alive connections to the app (nginx `listen ... http2` and `proxy_pass`, HAProxy
#      `bind ... proto h2`), each adding the forwarding headers ebb adds;
#   2. gRPC: a unary call (helloworld.Greeter/SayHello, which the example app echoes), each proxy
#      passing it on over h2c (nginx `grpc_pass`, HAProxy `proto h2` on both sides).
# Prints requests/s, p50 and p99 (from h2load's per-request log), the proxy's CPU time per
# request, and ebb's ratios to each anchor. wrk-free: h2load, the proxy and the app share the
# machine's two cores. Installs nghttp2-client, nginx and haproxy (Debian packages) when missing.
# Usage: benches/h2.sh [SECONDS] [CONNS] [STREAMS]   (EBB_BIN: an ebb binary to use instead of
# building the release one; BENCH_ROUNDS: rounds, default 3; BENCH_PERF=FILE: a `perf record`
# profile of ebb over its gRPC rounds (BENCH_PERF_ON=h2c: its h2c rounds), BENCH_PERF_ARGS its
# options: benches/lib.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
source benches/lib.sh

seconds="${1:-10}"
conns="${2:-64}"
streams="${3:-10}"
rounds="${BENCH_ROUNDS:-3}"
bench_packages nghttp2-client nginx haproxy curl
bench_ebb
bench_workdir
bench_awake

base="${BENCH_PORT_BASE:-18500}"
app_port=$((base + 1)); ebb_port=$((base + 2)); admin_port=$((base + 3))
nginx_h2=$((base + 4)); nginx_grpc=$((base + 5)); haproxy_h2=$((base + 6)); haproxy_grpc=$((base + 7))

"$ebb" example-app --port "$app_port" >"$work/app.log" 2>&1 &
pids+=($!)

cat >"$work/ebb.toml" <<TOML
[[app]]
name = "bench"
domains = ["bench.localhost"]
command = ["ebb", "example-app"]
min_replicas = 1
idle_after_ms = 3600000
TOML
EBB_LOG=warn PATH="$(dirname "$ebb"):$PATH" "$ebb" serve --config "$work/ebb.toml" --data-dir "$work/data" \
  --listen "127.0.0.1:$ebb_port" --admin-listen "127.0.0.1:$admin_port" >"$work/ebb.log" 2>&1 &
pids+=($!)
ebb_pid=$!

forwarded='proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
      proxy_set_header X-Forwarded-Proto $scheme;
      proxy_set_header X-Forwarded-Host $host;
      proxy_set_header Forwarded "for=$remote_addr;host=\"$host\";proto=$scheme";'
bench_nginx_conf <<NGINX
  http2_max_concurrent_streams 1024;
  keepalive_requests 1000000;
  upstream app { server 127.0.0.1:$app_port; keepalive 256; keepalive_requests 1000000; }
  server {
    listen 127.0.0.1:$nginx_h2 http2;
    location / {
      proxy_pass http://app;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header Host \$host;
      ${forwarded}
    }
  }
  server {
    listen 127.0.0.1:$nginx_grpc http2;
    location / {
      grpc_pass grpc://app;
      ${forwarded//proxy_set_header/grpc_set_header}
    }
  }
}
NGINX
nginx -p "$work/nginx" -c "$work/nginx/nginx.conf" &
pids+=($!)
nginx_pid=$!

hap_forwarded='http-request set-header X-Forwarded-Proto http
  http-request set-header X-Forwarded-Host %[req.hdr(host)]
  http-request set-header Forwarded "for=%[src];host=\"%[req.hdr(host)]\";proto=http"'
cat >"$work/haproxy.cfg" <<HAPROXY
global
  nbthread 2
  maxconn 4096
defaults
  mode http
  option http-keep-alive
  option forwardfor
  http-reuse always
  timeout connect 5s
  timeout client 60s
  timeout server 60s
frontend h2
  bind 127.0.0.1:$haproxy_h2 proto h2
  $hap_forwarded
  default_backend app
frontend grpc
  bind 127.0.0.1:$haproxy_grpc proto h2
  $hap_forwarded
  default_backend app_h2
backend app
  server app 127.0.0.1:$app_port maxconn 1000
backend app_h2
  server app 127.0.0.1:$app_port proto h2 maxconn 1000
HAPROXY
haproxy -db -f "$work/haproxy.cfg" >"$work/haproxy.log" 2>&1 &
pids+=($!)
haproxy_pid=$!

# A gRPC request body: one uncompressed message, HelloRequest { name: "world" }.
printf '\x00\x00\x00\x00\x07\x0a\x05world' >"$work/hello.bin"
grpc_args=(-d "$work/hello.bin" -H 'content-type: application/grpc' -H 'te: trailers')
grpc_path=/helloworld.Greeter/SayHello
# The section BENCH_PERF profiles: gRPC's (the default) or, with BENCH_PERF_ON=h2c, h2c's.
perf_path="$grpc_path"
if [ "${BENCH_PERF_ON:-grpc}" = h2c ]; then perf_path=/; fi

ready() { # PORT: h2c answers 200 (ebb's once its app is up)
  for _ in $(seq 1 600); do
    if h2load -n 1 -c 1 -H ':authority: bench.localhost' "http://127.0.0.1:$1/health" 2>/dev/null |
      grep -q '^status codes: 1 2xx'; then return 0; fi
    sleep 0.05
  done
  echo "error: port $1 does not answer h2c" >&2
  cat "$work/ebb.log" >&2
  exit 1
}
for p in "$app_port" "$ebb_port" "$nginx_h2" "$nginx_grpc" "$haproxy_h2" "$haproxy_grpc"; do ready "$p"; done

run() { # NAME PORT PATH [h2load args...] -- [--children] PID...: "name rps p50us p99us cpu_us"
  local name="$1" port="$2" path="$3" args=() t0=0 t1=0
  shift 3
  while [ "$1" != -- ]; do args+=("$1"); shift; done
  shift
  [ $# -gt 0 ] && t0=$(ticks "$@")
  local out
  out="$(h2load -c "$conns" -m "$streams" -t 2 -D "$seconds" --log-file "$work/log" \
    -H ':authority: bench.localhost' "${args[@]}" "http://127.0.0.1:$port$path" 2>&1)"
  [ $# -gt 0 ] && t1=$(ticks "$@")
  local rps ok
  rps="$(awk '/^finished in/ { gsub(",", "", $4); print $4 }' <<<"$out")"
  ok="$(awk '/^status codes:/ { print $3 }' <<<"$out")"
  local lat
  lat="$(awk -F'\t' '{ print $3 }' "$work/log" | sort -n | awk '{ a[NR] = $1 } END {
    printf "%d %d", a[int(NR * 0.5)], a[int(NR * 0.99)] }')"
  awk -v n="$name" -v r="$rps" -v l="$lat" -v t=$((t1 - t0)) -v s="$seconds" -v ok="$ok" 'BEGIN {
    split(l, p, " "); printf "%s %.0f %d %d %.2f %s\n", n, r, p[1], p[2], (r > 0 ? t * 10000 / (r * s) : 0), ok }'
}

median() { # NAME RUNS...: the median of each column
  local name="$1"; shift
  printf '%s\n' "$@" | awk -v name="$name" '
    { r[NR] = $2; a[NR] = $3; b[NR] = $4; c[NR] = $5 }
    function med(x, n,   i, j, t) {
      for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (x[j] < x[i]) { t = x[i]; x[i] = x[j]; x[j] = t }
      return x[int((n + 1) / 2)]
    }
    END { printf "%s %.0f %d %d %.2f\n", name, med(r, NR), med(a, NR), med(b, NR), med(c, NR) }'
}

table() { # RESULT... (direct, ebb, nginx, haproxy)
  local results=("$@")
  echo
  echo "| target | requests/s | p50 | p99 | proxy CPU per request |"
  echo "|---|---|---|---|---|"
  for r in "${results[@]}"; do
    read -r name rps p50 p99 cpu <<<"$r"
    [ "$name" = direct ] && cpu=- || cpu="${cpu}us"
    echo "| $name | $rps | ${p50}us | ${p99}us | $cpu |"
  done
  read -r _ e_rps e_p50 e_p99 e_cpu <<<"${results[1]}"
  for i in 2 3; do
    read -r other o_rps o_p50 o_p99 o_cpu <<<"${results[$i]}"
    awk -v n="$other" -v a="$e_rps" -v b="$o_rps" -v c="$e_p50" -v d="$o_p50" -v e="$e_p99" -v f="$o_p99" \
        -v g="$e_cpu" -v h="$o_cpu" 'BEGIN {
      printf "| ebb / %s | %.2f x throughput | %.2f x p50 | %.2f x p99 | %.2f x CPU per request |\n", n, a / b, c / d, e / f, g / h }'
  done
}

section() { # TITLE PATH NGINX_PORT HAPROXY_PORT [h2load args...]
  local title="$1" path="$2" ngx="$3" hap="$4" runs_e=() runs_n=() runs_h=() perf_pid=
  shift 4
  echo
  echo "$title: h2load -c$conns -m$streams -t2 -D$seconds, $rounds alternating rounds, each figure the median"
  local results=("$(run direct "$app_port" "$path" "$@" --)")
  for _ in $(seq 1 "$rounds"); do
    if [ "$path" = "$perf_path" ]; then bench_perf_start "$ebb_pid"; fi
    runs_e+=("$(run ebb "$ebb_port" "$path" "$@" -- "$ebb_pid")")
    bench_perf_stop
    runs_n+=("$(run nginx "$ngx" "$path" "$@" -- --children "$nginx_pid")")
    runs_h+=("$(run haproxy "$hap" "$path" "$@" -- "$haproxy_pid")")
  done
  for r in "${runs_e[@]}" "${runs_n[@]}" "${runs_h[@]}"; do
    read -r name _ _ _ _ ok <<<"$r"
    [ "${ok:-0}" -gt 0 ] || { echo "error: $name answered no 2xx: $r" >&2; exit 1; }
  done
  results+=("$(median ebb "${runs_e[@]}")" "$(median nginx "${runs_n[@]}")" "$(median haproxy "${runs_h[@]}")")
  table "${results[@]}"
}

section "h2c (GET / echo, HTTP/1.1 to the app)" / "$nginx_h2" "$haproxy_h2"
section "gRPC (unary SayHello, h2c to the app)" "$grpc_path" "$nginx_grpc" "$haproxy_grpc" "${grpc_args[@]}"
