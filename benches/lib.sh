# Sourced by the benchmark scripts, after scripts/env.sh: what they share.

# Installs the Debian packages given that are missing.
bench_packages() {
  local need=() pkg sudo=
  for pkg in "$@"; do dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg"); done
  [ ${#need[@]} -gt 0 ] || return 0
  [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
}

# Sets `ebb`: $EBB_BIN, else the release binary, built now.
bench_ebb() {
  if [ -n "${EBB_BIN:-}" ]; then
    ebb="$EBB_BIN"
  else
    cargo build --locked --release --bin ebb
    ebb="$CARGO_TARGET_DIR/release/ebb"
  fi
}

# Sets `work`, a temporary directory, and `pids`, the processes to stop: both go at exit.
bench_workdir() {
  work="$(mktemp -d)"
  pids=()
  trap bench_cleanup EXIT
}

bench_cleanup() {
  local p
  for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
  wait 2>/dev/null || true
  rm -rf "$work"
}

# With BENCH_AWAKE=1, keeps every core busy with a spinner at `SCHED_IDLE` (`chrt --idle`), which
# runs only when a core would otherwise be idle; by default the cores are left to idle. Why: on a
# virtual machine a core with nothing to run halts, and waking it again (an interrupt through the
# hypervisor) costs far more than a wake-up on a running core. Under a proxy benchmark's
# ping-pong the cores halt and wake thousands of times a second, and what that costs moved from
# round to round on the 2-core VM the figures come from: in one run of `tcp.sh`, HAProxy served
# 101k req/s at 8.1 us of CPU per request in four rounds and 181k at 4.2 us in the fifth. With
# the cores awake a run's rounds agree within a few percent. Not the default: the spinners are
# not free for a latency tail (wrk's p99 through ebb went from 1.35 to 3.77 ms, HAProxy's from
# 1.65 to 2.46 ms, in `proxy.sh`), so they suit throughput and CPU comparisons (`tcp.sh`) more
# than p99s. The spinners' CPU time is nobody's: each target's CPU per request counts its own
# processes only. Call after bench_workdir.
bench_awake() {
  if [ "${BENCH_AWAKE:-0}" != 1 ]; then
    echo "cores left to idle (BENCH_AWAKE=1 keeps them awake): rounds may differ by the cores' halts and wake-ups"
    return 0
  fi
  local i
  for i in $(seq 1 "$(nproc)"); do
    chrt --idle 0 sh -c 'while :; do :; done' &
    pids+=($!)
  done
  echo "each of the $(nproc) cores kept awake by an idle-priority spinner (BENCH_AWAKE=1)"
}

# With BENCH_PERF=FILE, starts `perf record` on PID, writing FILE, and sets `perf_pid`
# (BENCH_PERF_ARGS: its options, `-F 1999 -g` by default; `-F 999 --call-graph dwarf,16384` names
# the callers in code built without frame pointers); without, does nothing: PID.
bench_perf_start() {
  perf_pid=
  [ -n "${BENCH_PERF:-}" ] || return 0
  # shellcheck disable=SC2086 # the options are words
  perf record -q ${BENCH_PERF_ARGS:--F 1999 -g} -p "$1" -o "$BENCH_PERF" 2>/dev/null &
  perf_pid=$!
}

# Stops the recording bench_perf_start started, if any (perf writes its file as it stops).
bench_perf_stop() {
  [ -n "${perf_pid:-}" ] || return 0
  kill -INT "$perf_pid"
  wait "$perf_pid" || true
  perf_pid=
}

# CPU time (clock ticks, 1/100 s) the processes given spent so far, with their children's
# (nginx serves from its workers) when asked first: [--children] PID...
ticks() {
  local kids=0 t=0 p
  if [ "$1" = --children ]; then kids=1; shift; fi
  for p in "$@" $([ $kids = 1 ] && pgrep -P "$1" | tr '\n' ' '); do
    t=$((t + $(awk '{print $14 + $15}' "/proc/$p/stat" 2>/dev/null || echo 0)))
  done
  echo "$t"
}

# The kernel's share of ticks: PID's CPU time in system mode (its sockets' work, its syscalls).
kernel_ticks() {
  awk '{print $15}' "/proc/$1/stat" 2>/dev/null || echo 0
}

# Writes "$work/nginx/nginx.conf" for an nginx in the foreground from "$work/nginx": the head
# every benchmark shares, up to and with the opening of the `http` block, then standard input
# (the rest of the block and its closing brace).
bench_nginx_conf() {
  mkdir -p "$work/nginx"
  { cat <<NGINX
worker_processes auto;
daemon off;
pid $work/nginx/nginx.pid;
error_log $work/nginx/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $work/nginx/body;
  proxy_temp_path $work/nginx/proxy;
  fastcgi_temp_path $work/nginx/fastcgi;
  uwsgi_temp_path $work/nginx/uwsgi;
  scgi_temp_path $work/nginx/scgi;
NGINX
    cat
  } >"$work/nginx/nginx.conf"
}

# Starts an OpenTelemetry Collector (scripts/otelcol, or $EBB_OTELCOL) taking OTLP/HTTP on
# 127.0.0.1:PORT and writing the spans to "$work/traces.jsonl" (rotated at 64 MB): PORT.
bench_otelcol() {
  local otelcol="${EBB_OTELCOL:-$(scripts/otelcol build)}"
  cat >"$work/otelcol.yaml" <<YAML
receivers:
  otlp:
    protocols:
      http:
        endpoint: 127.0.0.1:$1
exporters:
  file:
    path: $work/traces.jsonl
    rotation:
      max_megabytes: 64
      max_backups: 1
service:
  telemetry:
    metrics:
      level: none
  pipelines:
    traces:
      receivers: [otlp]
      exporters: [file]
YAML
  "$otelcol" --config "$work/otelcol.yaml" >"$work/otelcol.log" 2>&1 &
  pids+=($!)
}
