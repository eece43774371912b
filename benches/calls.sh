#!/usr/bin/env bash
# Durable calls benchmark: the embedded queue's enqueue-to-start latency at 10,000 calls/s, then
# `ebb bench calls` with the embedded queue and, against Apache Kafka started here on loopback,
# the Kafka queue with one and with two ebb replicas, and the cost of a start forwarded to the
# call's owner against one through the owner.
#
# The anchor, on the same broker before ebb's rows: Kafka's own kafka-producer-perf-test
# (ProducerPerformance, with ebb's producer settings: acks=all, idempotence, linger.ms=1) and
# kafka-consumer-perf-test (ConsumerPerformance), each alone, on a topic of ebb's 8 partitions,
# with records of a no-op call's size in ebb's topic (177 bytes of value, 36 of key). The bare
# broker's produce-and-consume rate is the rate of moving a record in and out on these CPUs:
# 1 / (1/produced + 1/consumed), each rate as its tool reports it (without its JVM's start).
# ebb's Kafka rows print their ratio to it. Beside ebb's enqueue-to-start latency, the broker's
# own produce-to-consume latency (kafka-e2e-latency, EndToEndLatency), one record at a time. The
# Kafka rows print the broker's CPU time per call beside ebb's (the broker shares the cores), and
# the line after the ratios what half the anchor's rate leaves per call to the two together.
#
# Usage: benches/calls.sh [SECONDS]   (BENCH_KAFKA_RECORDS: records of the anchor, 2,000,000)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
source benches/lib.sh
bench_ebb
seconds="${1:-5}"
# The embedded queue's latency at half the 20,000 calls/s target, five rounds, before the broker
# starts (so it runs alone).
"$ebb" bench calls --seconds "$seconds" --rate 10000 --rounds 5
# Apache Kafka (a KRaft node from scripts/kafka, on loopback), after the embedded rows' latency
# run above.
bench_workdir
bench_awake
port="${BENCH_KAFKA_PORT:-19092}"
libs="$(scripts/kafka fetch)"
scripts/kafka run "$work/kafka" "$port" >"$work/broker.log" 2>&1 &
pids+=($!)
broker=$! # the broker's JVM (scripts/kafka execs it)
for _ in $(seq 1 600); do (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break; sleep 0.1; done
kafka_tool() { java -Xms256m -Xmx1g -cp "$libs/*" "org.apache.kafka.tools.$1" "${@:2}" 2>"$work/tool.err"; }
records="${BENCH_KAFKA_RECORDS:-2000000}"
kafka_tool TopicCommand --bootstrap-server "127.0.0.1:$port" --create --topic anchor \
  --partitions 8 --replication-factor 1 >/dev/null
# Last line: "N records sent, R records/sec (...), ..."
produced="$(kafka_tool ProducerPerformance --topic anchor --num-records "$records" \
  --record-size 213 --throughput -1 --producer-props "bootstrap.servers=127.0.0.1:$port" \
  acks=all enable.idempotence=true linger.ms=1 | tail -1 | awk -F', ' '{print $2}' | awk '{print $1}')"
# Last line: start, end, MB, MB/s, messages, messages/s, rebalance ms, fetch ms, fetch MB/s,
# fetch messages/s (the group's join left out).
consumed="$(kafka_tool ConsumerPerformance --bootstrap-server "127.0.0.1:$port" --topic anchor \
  --messages "$records" --group anchor --timeout 60000 | tail -1 | awk -F', ' '{print $10}')"
anchor="$(awk -v p="$produced" -v c="$consumed" 'BEGIN { printf "%.0f", 1 / (1 / p + 1 / c) }')"
# The broker's own produce-to-consume latency, one record at a time (acks=all): the floor under
# ebb's enqueue-to-start. Last line: "Percentiles: 50th = A, 99th = B, 99.9th = C" (ms).
kafka_tool TopicCommand --bootstrap-server "127.0.0.1:$port" --create --topic e2e \
  --partitions 1 --replication-factor 1 >/dev/null
e2e="$(kafka_tool EndToEndLatency "127.0.0.1:$port" e2e 10000 all 213 | tail -1 | sed 's/^Percentiles: //')"
echo
echo "| the bare broker ($records records of 213 bytes, 8 partitions) | records/s |"
echo "|---|---|"
echo "| kafka-producer-perf-test (acks=all, idempotence, linger.ms=1) | $produced |"
echo "| kafka-consumer-perf-test (fetch) | $consumed |"
echo "| produce and consume: 1 / (1/produced + 1/consumed) | $anchor |"
echo
echo "the bare broker's produce-to-consume latency (kafka-e2e-latency, 10,000 records one at a time, acks=all), ms: $e2e"
echo
"$ebb" bench calls --seconds "$seconds" --kafka "127.0.0.1:$port" --anchor "$anchor" \
  --broker-pid "$broker" ${BENCH_CALLS_ARGS:-}
