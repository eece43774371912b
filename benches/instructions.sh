#!/usr/bin/env bash
# Instructions per proxied request, counted by valgrind's callgrind: the same warm GET through
# ebb's HTTP/1.1 fast path, for each ebb binary and trace setting asked. Unlike wall-clock rounds
# it repeats to a fraction of a percent on a busy machine, so it settles small differences (a
# change that must cost under 2 %) that throughput rounds cannot.
#
# For each target: ebb runs under callgrind in front of the example app (run directly, natively);
# after a warm-up its counters are zeroed, a client sends N requests one after another on one
# keep-alive connection, and the counters are dumped; the same is done for an idle pause of the
# same length, whose count (timers, the traffic flusher) is taken off. Syscalls are the kernel's
# and are not counted.
#
# Targets, each `NAME=BINARY[:SAMPLER]`: SAMPLER unset runs with tracing off; `always_off` or a
# ratio (`0.01`) exports over OTLP/HTTP to an OpenTelemetry Collector on loopback (scripts/otelcol)
# with that sampler. Default: the release binary with tracing off, sampled out, and sampled at 1 %.
# BENCH_CALLGRIND_DIR keeps each target's busy window there as NAME.callgrind (callgrind_annotate
# reads it; the symbols are the binary's).
# Usage: benches/instructions.sh [N] [NAME=BINARY[:SAMPLER]...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
source benches/lib.sh

n="${1:-3000}"
shift || true
bench_packages valgrind binutils python3 curl bc
bench_ebb
bench_workdir
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
  targets=("tracing-off=$ebb" "sampled-out=$ebb:always_off" "sampled-1%=$ebb:0.01")
fi

base="${BENCH_PORT_BASE:-18400}"
app_port=$((base + 1)); ebb_port=$((base + 2)); otlp_port=$((base + 4))

"$ebb" example-app --port "$app_port" &
pids+=($!)
cat >"$work/ebb.toml" <<TOML
[[service]]
name = "bench"
domains = ["bench.localhost"]

[[service.route]]
path = "/{rest:**}"
destinations = [{ addresses = ["127.0.0.1:$app_port"] }]
TOML

if printf '%s\n' "${targets[@]}" | grep -q ':'; then
  bench_otelcol "$otlp_port"
fi

# N keep-alive requests, one after another; fails on any answer other than 200.
cat >"$work/client.py" <<'PY'
import socket, sys
port, n = int(sys.argv[1]), int(sys.argv[2])
s = socket.create_connection(("127.0.0.1", port))
req = b"GET / HTTP/1.1\r\nHost: bench.localhost\r\n\r\n"
buf = b""
for _ in range(n):
    s.sendall(req)
    while b"\r\n\r\n" not in buf:
        buf += s.recv(65536)
    head, buf = buf.split(b"\r\n\r\n", 1)
    if not head.startswith(b"HTTP/1.1 200"):
        sys.exit("unexpected answer: %r" % head[:80])
    length = 0
    for line in head.split(b"\r\n")[1:]:
        k, _, v = line.partition(b":")
        if k.strip().lower() == b"content-length":
            length = int(v)
    while len(buf) < length:
        buf += s.recv(65536)
    buf = buf[length:]
PY

total_ir() { # DUMP: the total instruction count of a callgrind dump
  awk '/^summary:/ {print $2; exit}' "$1"
}

count() { # NAME BINARY SAMPLER: prints "NAME instructions-per-request"
  local name="$1" bin="$2" sampler="$3" dir="${1//[^A-Za-z0-9_-]/_}" pid start elapsed busy idle
  local out="$work/cg-$dir"
  mkdir -p "$out"
  if curl -s -o /dev/null "http://127.0.0.1:$ebb_port/"; then
    echo "error: something already listens on 127.0.0.1:$ebb_port (BENCH_PORT_BASE moves the ports)" >&2
    exit 1
  fi
  local env=(EBB_LOG=warn)
  if [ -n "$sampler" ]; then
    env+=(OTEL_EXPORTER_OTLP_ENDPOINT="http://127.0.0.1:$otlp_port")
    case "$sampler" in
      always_off | always_on) env+=(OTEL_TRACES_SAMPLER="$sampler") ;;
      *) env+=(OTEL_TRACES_SAMPLER=traceidratio OTEL_TRACES_SAMPLER_ARG="$sampler") ;;
    esac
  fi
  # Valgrind 3.19 cannot read the DWARF 5 that rustc writes: a copy without it (symbols kept)
  # runs the same instructions.
  objcopy --strip-debug "$bin" "$out/ebb"
  env "${env[@]}" valgrind --tool=callgrind --callgrind-out-file="$out/cg.%p" \
    "$out/ebb" serve --config "$work/ebb.toml" --data-dir "$work/data-$dir" \
    --listen "127.0.0.1:$ebb_port" --admin-listen "127.0.0.1:$((ebb_port + 1))" \
    >"$out/ebb.log" 2>&1 &
  pid=$!
  pids+=("$pid")
  for _ in $(seq 1 1200); do
    curl -sf -o /dev/null -H "Host: bench.localhost" "http://127.0.0.1:$ebb_port/" && break
    if ! kill -0 "$pid" 2>/dev/null; then
      echo "error: $name: ebb under callgrind exited:" >&2
      tail -20 "$out/ebb.log" >&2
      exit 1
    fi
    sleep 0.1
  done
  python3 "$work/client.py" "$ebb_port" 300 # warm-up
  callgrind_control --zero "$pid" >/dev/null 2>&1
  start=$(date +%s.%N)
  python3 "$work/client.py" "$ebb_port" "$n"
  callgrind_control --dump=busy "$pid" >/dev/null 2>&1
  elapsed=$(echo "$(date +%s.%N) - $start" | bc)
  callgrind_control --zero "$pid" >/dev/null 2>&1
  sleep "$elapsed" # the idle window measured, not a wait for anything
  callgrind_control --dump=idle "$pid" >/dev/null 2>&1
  local dump
  dump="$(grep -l '^desc: Trigger: dump busy' "$out"/cg.* | head -1)"
  busy=$(total_ir "$dump")
  if [ -n "${BENCH_CALLGRIND_DIR:-}" ]; then # the busy window's profile, for callgrind_annotate
    mkdir -p "$BENCH_CALLGRIND_DIR"
    cp "$dump" "$BENCH_CALLGRIND_DIR/$dir.callgrind"
  fi
  idle=$(total_ir "$(grep -l '^desc: Trigger: dump idle' "$out"/cg.* | head -1)")
  kill "$pid"
  wait "$pid" 2>/dev/null || true
  awk -v name="$name" -v b="$busy" -v i="$idle" -v n="$n" \
    'BEGIN { printf "%s %.0f %.0f\n", name, (b - i) / n, i / n }'
}

echo "instructions per request through ebb's HTTP/1.1 fast path (callgrind, $n keep-alive GETs"
echo "each, an idle window of the same length taken off)"
echo
echo "| target | instructions per request | idle window's, per request |"
echo "|---|---|---|"
results=()
for t in "${targets[@]}"; do
  name="${t%%=*}"; rest="${t#*=}"; bin="${rest%%:*}"; sampler=
  [ "$rest" != "$bin" ] && sampler="${rest#*:}"
  r="$(count "$name" "$bin" "$sampler")"
  results+=("$r")
  read -r name per idle <<<"$r"
  echo "| $name | $per | $idle |"
done
read -r first_name first _ <<<"${results[0]}"
for r in "${results[@]:1}"; do
  read -r name per _ <<<"$r"
  awk -v n="$name" -v f="$first_name" -v a="$per" -v b="$first" \
    'BEGIN { printf "| %s / %s | %.4f x | |\n", n, f, a / b }'
done
