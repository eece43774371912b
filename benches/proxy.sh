#!/usr/bin/env bash
# Proxy benchmark, in one go on this machine:
#   1. warm throughput and latency (wrk) of the example app directly, of ebb in front of it, and of
#      nginx and HAProxy as keep-alive reverse proxies in front of it (each reusing its backend
#      connections, and each adding the forwarding headers ebb adds: X-Forwarded-For, -Proto,
#      -Host and Forwarded, so the app does the same work behind each), in alternating rounds, with the ratios ebb/nginx and ebb/HAProxy, and the CPU
#      time each proxy spent per request (wrk, the proxy and the app share the cores, so throughput
#      also moves with how the scheduler interleaves them; CPU per request does not);
#   2. a meta service's rewrite: the same, through an ebb `[[service]]` route that rewrites the
#      path (`/api/{rest:**}` to `/v2/{rest}`) and sets a request header, against nginx (`rewrite`
#      and `proxy_set_header`) and HAProxy (`set-path` and `set-header`) doing the same;
#   3. traces: the same warm GET through ebb with tracing off (the ebb above), with tracing on and
#      every request sampled out (OTEL_TRACES_SAMPLER=always_off), with 1 % of requests sampled
#      (traceidratio 0.01) and with every request sampled, exported to an OpenTelemetry Collector
#      on loopback (scripts/otelcol), in alternating rounds, with the ratios to tracing off
#      (benches/instructions.sh counts the same in instructions per request, which repeats
#      closely enough to show a difference of 2 %);
#   4. cold-start overhead (`ebb bench cold-start`): first byte through ebb for a workload at zero
#      minus the app's own start-to-ready time, and a cold burst of 200 requests against an app
#      with a tiny accept backlog, through ebb against the same burst sent to the app directly.
# Installs wrk, nginx and haproxy (Debian packages) when missing.
# Usage: benches/proxy.sh [SECONDS] [CONNS]   (EBB_BIN: an ebb binary to use instead of building
# the release one)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
source benches/lib.sh

seconds="${1:-10}"
conns="${2:-64}"
bench_packages wrk nginx haproxy curl
bench_ebb
bench_workdir
bench_awake

base="${BENCH_PORT_BASE:-18000}"
app_port=$((base + 1)); ebb_port=$((base + 2)); admin_port=$((base + 3)); nginx_port=$((base + 4))
haproxy_port=$((base + 5)); nginx_meta_port=$((base + 6)); haproxy_meta_port=$((base + 7))

wait_http() { # URL HOST
  for _ in $(seq 1 600); do
    if curl -sf -o /dev/null -H "Host: $2" "$1"; then return 0; fi
    sleep 0.05
  done
  echo "error: $1 did not answer" >&2
  exit 1
}

# The app, directly.
"$ebb" example-app --port "$app_port" &
pids+=($!)

# ebb in front of the same app binary, kept warm (min_replicas = 1).
cat >"$work/ebb.toml" <<TOML
[[app]]
name = "bench"
domains = ["bench.localhost"]
command = ["ebb", "example-app"]
min_replicas = 1
idle_after_ms = 3600000

[[service]]
name = "meta"
domains = ["meta.localhost"]

[[service.route]]
path = "/api/{rest:**}"
rewrite_path = "/v2/{rest}"
request_headers = { set = { "x-from" = "ebb" } }
destinations = [{ addresses = ["127.0.0.1:$app_port"] }]
TOML
EBB_LOG=warn "$ebb" serve --config "$work/ebb.toml" --data-dir "$work/data" \
  --listen "127.0.0.1:$ebb_port" --admin-listen "127.0.0.1:$admin_port" >/dev/null &
pids+=($!)
ebb_pid=$!

# nginx as a keep-alive reverse proxy in front of the app.
bench_nginx_conf <<NGINX
  upstream app { server 127.0.0.1:$app_port; keepalive 256; }
  server {
    listen 127.0.0.1:$nginx_port;
    location / {
      proxy_pass http://app;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header Host \$host;
      proxy_set_header X-Forwarded-For \$proxy_add_x_forwarded_for;
      proxy_set_header X-Forwarded-Proto \$scheme;
      proxy_set_header X-Forwarded-Host \$host;
      proxy_set_header Forwarded "for=\$remote_addr;host=\"\$host\";proto=\$scheme";
    }
  }
  server {
    listen 127.0.0.1:$nginx_meta_port;
    location /api/ {
      rewrite ^/api/(.*)\$ /v2/\$1 break;
      proxy_pass http://app;
      proxy_http_version 1.1;
      proxy_set_header Connection "";
      proxy_set_header Host \$host;
      proxy_set_header X-From ebb;
      proxy_set_header X-Forwarded-For \$proxy_add_x_forwarded_for;
      proxy_set_header X-Forwarded-Proto \$scheme;
      proxy_set_header X-Forwarded-Host \$host;
      proxy_set_header Forwarded "for=\$remote_addr;host=\"\$host\";proto=\$scheme";
    }
  }
}
NGINX
nginx -p "$work/nginx" -c "$work/nginx/nginx.conf" &
pids+=($!)
nginx_pid=$!

# HAProxy with two threads (one per core, like ebb and nginx), keep-alive and connection reuse.
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
frontend proxy
  bind 127.0.0.1:$haproxy_port
  http-request set-header X-Forwarded-Proto http
  http-request set-header X-Forwarded-Host %[req.hdr(host)]
  http-request set-header Forwarded "for=%[src];host=\"%[req.hdr(host)]\";proto=http"
  default_backend app
frontend meta
  bind 127.0.0.1:$haproxy_meta_port
  http-request set-path %[path,regsub(^/api/,/v2/)] if { path_beg /api/ }
  http-request set-header X-From ebb
  http-request set-header X-Forwarded-Proto http
  http-request set-header X-Forwarded-Host %[req.hdr(host)]
  http-request set-header Forwarded "for=%[src];host=\"%[req.hdr(host)]\";proto=http"
  default_backend app
backend app
  server app 127.0.0.1:$app_port maxconn 1000
HAPROXY
haproxy -db -f "$work/haproxy.cfg" >"$work/haproxy.log" 2>&1 &
pids+=($!)
haproxy_pid=$!

wait_http "http://127.0.0.1:$app_port/health" x
wait_http "http://127.0.0.1:$ebb_port/health" bench.localhost
wait_http "http://127.0.0.1:$nginx_port/health" x
wait_http "http://127.0.0.1:$haproxy_port/health" x

run() { # NAME PORT [--children] PID...
  local name="$1" port="$2" out t0 t1
  shift 2
  t0="$( [ $# -gt 0 ] && ticks "$@" || echo 0)"
  out="$(wrk -t2 -c"$conns" -d"${seconds}s" --latency -H "Host: $req_host" "http://127.0.0.1:$port$req_path")"
  t1="$( [ $# -gt 0 ] && ticks "$@" || echo 0)"
  local rps p50 p99 cpu
  rps="$(awk '/^Requests\/sec:/ {print $2}' <<<"$out")"
  p50="$(awk '$1 == "50%" {print $2}' <<<"$out")"
  p99="$(awk '$1 == "99%" {print $2}' <<<"$out")"
  # The proxy's CPU per request in microseconds (a tick is 1/100 s).
  cpu="$(awk -v t=$((t1 - t0)) -v r="$rps" -v s="$seconds" 'BEGIN { printf "%.2f", t * 10000 / (r * s) }')"
  echo "$name $rps $p50 $p99 $cpu"
}

# wrk prints latencies with units (us, ms, s); normalise to microseconds.
to_us() {
  awk -v v="$1" 'BEGIN {
    n = v + 0
    if (v ~ /us$/) print n; else if (v ~ /ms$/) print n * 1000; else if (v ~ /s$/) print n * 1000000; else print n
  }'
}

rounds="${BENCH_ROUNDS:-5}"
req_host=bench.localhost req_path=/
echo "warm: wrk -t2 -c$conns -d${seconds}s, GET / (echo), 2 cores shared by wrk, proxy and app;"
echo "ebb, nginx and HAProxy measured in $rounds alternating rounds, each figure the median of its rounds"
results=("$(run direct "$app_port")")
ebb_runs=()
ngx_runs=()
hap_runs=()
for _ in $(seq 1 "$rounds"); do
  ebb_runs+=("$(run ebb "$ebb_port" "$ebb_pid")")
  ngx_runs+=("$(run nginx "$nginx_port" --children "$nginx_pid")")
  hap_runs+=("$(run haproxy "$haproxy_port" "$haproxy_pid")")
done
# The median of each column over the rounds, latencies in microseconds.
median() { # NAME RUNS...
  local name="$1"; shift
  printf '%s\n' "$@" | while read -r _ rps p50 p99 cpu; do
    echo "$rps $(to_us "$p50") $(to_us "$p99") $cpu"
  done | awk -v name="$name" '
    { r[NR] = $1; a[NR] = $2; b[NR] = $3; c[NR] = $4 }
    function med(x, n,   i, j, t) {
      for (i = 1; i <= n; i++) for (j = i + 1; j <= n; j++) if (x[j] < x[i]) { t = x[i]; x[i] = x[j]; x[j] = t }
      return x[int((n + 1) / 2)]
    }
    END { printf "%s %.2f %.0fus %.0fus %.2f\n", name, med(r, NR), med(a, NR), med(b, NR), med(c, NR) }'
}
table() { # RESULT... (direct, ebb, then the anchors): the table and ebb's ratios to each anchor
  local results=("$@")
  echo
  echo "| target | requests/s | p50 | p99 | proxy CPU per request |"
  echo "|---|---|---|---|---|"
  for r in "${results[@]}"; do
    read -r name rps p50 p99 cpu <<<"$r"
    if [ "$name" = direct ]; then cpu=-; else cpu="${cpu}us"; fi
    echo "| $name | $rps | $p50 | $p99 | $cpu |"
  done
  read -r _ ebb_rps ebb_p50 ebb_p99 ebb_cpu <<<"${results[1]}"
  for i in 2 3; do
    read -r other o_rps o_p50 o_p99 o_cpu <<<"${results[$i]}"
    awk -v n="$other" -v a="$ebb_rps" -v b="$o_rps" -v c="$(to_us "$ebb_p99")" -v d="$(to_us "$o_p99")" \
        -v e="$(to_us "$ebb_p50")" -v f="$(to_us "$o_p50")" -v g="$ebb_cpu" -v h="$o_cpu" 'BEGIN {
      printf "| ebb / %s | %.2f x throughput | %.2f x p50 | %.2f x p99 | %.2f x CPU per request |\n", n, a / b, e / f, c / d, g / h
    }'
  done
}
results+=("$(median ebb "${ebb_runs[@]}")" "$(median nginx "${ngx_runs[@]}")" "$(median haproxy "${hap_runs[@]}")")
table "${results[@]}"

# The meta service: its route's rewrite through ebb, nginx and HAProxy, in alternating rounds.
req_host=meta.localhost req_path=/api/echo
wait_http "http://127.0.0.1:$ebb_port/api/health" meta.localhost
wait_http "http://127.0.0.1:$nginx_meta_port/api/health" meta.localhost
wait_http "http://127.0.0.1:$haproxy_meta_port/api/health" meta.localhost
echo
echo "meta service: GET /api/echo rewritten to /v2/echo with X-From set, the same wrk, $rounds alternating rounds"
results=("$(run direct "$app_port")")
ebb_runs=(); ngx_runs=(); hap_runs=()
for _ in $(seq 1 "$rounds"); do
  ebb_runs+=("$(run ebb "$ebb_port" "$ebb_pid")")
  ngx_runs+=("$(run nginx "$nginx_meta_port" --children "$nginx_pid")")
  hap_runs+=("$(run haproxy "$haproxy_meta_port" "$haproxy_pid")")
done
results+=("$(median ebb "${ebb_runs[@]}")" "$(median nginx "${ngx_runs[@]}")" "$(median haproxy "${hap_runs[@]}")")
table "${results[@]}"

# Traces: three more ebbs beside the first, with every request sampled out, 1 % sampled and every
# request sampled, all exporting over OTLP/HTTP to a collector on loopback.
otlp_port=$((base + 8)); off_port=$((base + 9)); on_port=$((base + 11)); some_port=$((base + 13))
bench_otelcol "$otlp_port"
traced_ebb() { # NAME PORT SAMPLER [RATIO]: starts an ebb exporting traces, sets traced_pid
  OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:$otlp_port" OTEL_TRACES_SAMPLER="$3" \
    OTEL_TRACES_SAMPLER_ARG="${4:-1}" EBB_LOG=warn "$ebb" serve --config "$work/ebb.toml" --data-dir "$work/data-$1" \
    --listen "127.0.0.1:$2" --admin-listen "127.0.0.1:$(($2 + 1))" >/dev/null &
  pids+=($!)
  traced_pid=$!
}
traced_ebb sampled-out "$off_port" always_off
off_pid=$traced_pid
traced_ebb sampled "$on_port" always_on
on_pid=$traced_pid
traced_ebb sampled-1% "$some_port" traceidratio 0.01
some_pid=$traced_pid
req_host=bench.localhost req_path=/
wait_http "http://127.0.0.1:$off_port/health" bench.localhost
wait_http "http://127.0.0.1:$on_port/health" bench.localhost
wait_http "http://127.0.0.1:$some_port/health" bench.localhost
echo
echo "traces: GET / through ebb with tracing off, on with every request sampled out, on with 1 %"
echo "sampled, and on with every request sampled, exported over OTLP/HTTP to a collector on"
echo "loopback; $rounds alternating rounds"
plain_runs=(); out_runs=(); some_runs=(); in_runs=()
for _ in $(seq 1 "$rounds"); do
  plain_runs+=("$(run ebb-tracing-off "$ebb_port" "$ebb_pid")")
  out_runs+=("$(run ebb-sampled-out "$off_port" "$off_pid")")
  some_runs+=("$(run ebb-sampled-1% "$some_port" "$some_pid")")
  in_runs+=("$(run ebb-sampled-all "$on_port" "$on_pid")")
done
results=("$(median ebb-tracing-off "${plain_runs[@]}")" "$(median ebb-sampled-out "${out_runs[@]}")"
  "$(median ebb-sampled-1% "${some_runs[@]}")" "$(median ebb-sampled-all "${in_runs[@]}")")
echo
echo "| target | requests/s | p50 | p99 | ebb CPU per request |"
echo "|---|---|---|---|---|"
for r in "${results[@]}"; do
  read -r name rps p50 p99 cpu <<<"$r"
  echo "| $name | $rps | $p50 | $p99 | ${cpu}us |"
done
read -r _ off_rps _ off_p99 off_cpu <<<"${results[0]}"
for i in 1 2 3; do
  read -r name rps _ p99 cpu <<<"${results[$i]}"
  awk -v n="$name" -v a="$rps" -v b="$off_rps" -v c="$(to_us "$p99")" -v d="$(to_us "$off_p99")" \
      -v g="$cpu" -v h="$off_cpu" 'BEGIN {
    printf "| %s / tracing off | %.3f x throughput | | %.2f x p99 | %.2f x CPU per request |\n", n, a / b, c / d, g / h
  }'
done
echo
echo "cold start:"
EBB_LOG=warn "$ebb" bench cold-start
