#!/usr/bin/env bash
# TCP transport benchmark, against this machine's own limit measured in the
# same run:
#   1. the single-stream TCP loopback limit (one process writes 1 MiB blocks
#      into a socket, another reads them: `ferry bench tcp-limit`);
#   2. `ferry bench` between two processes at 4 KiB, 64 KiB, 1 MiB and 16 MiB,
#      write and read, batches of 256 (32 for 16 MiB);
#   3. single 4 KiB synchronous writes and reads (batch of 1): latency.
# Each figure is the median of RUNS runs (default 3) of DURATION seconds
# (default 3). Prints a markdown table; writes the raw JSON lines to
# target/bench-tcp.jsonl. Not a test: it never fails on a slow result.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/common.sh
ensure_base

RUNS=${RUNS:-3}
DURATION=${DURATION:-3}
cargo build --release --workspace --locked -q
B=target/release/ferry
RAW=target/bench-tcp.jsonl
: > "$RAW"
export FERRY_TRANSPORTS=tcp

field() { sed -n "s/.*\"$1\":\([0-9.eE+-]*\).*/\1/p"; }
median() { sort -g | awk '{v[NR]=$1} END {if (NR) print v[int((NR+1)/2)]}'; }

echo "==> single-stream TCP loopback limit ($RUNS x ${DURATION}s)" >&2
limit=$(for _ in $(seq "$RUNS"); do
    $B bench tcp-limit --duration "$DURATION" --json | tee -a "$RAW" | field gb_per_s
done | median)

tmp=$(mktemp -d)
cleanup() { [ -n "${target_pid:-}" ] && kill "$target_pid" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT
$B bench target --buffer-size 1G > "$tmp/target.out" 2>/dev/null &
target_pid=$!
for _ in $(seq 100); do grep -q '^segment ' "$tmp/target.out" 2>/dev/null && break; sleep 0.1; done
segment=$(sed -n 's/^segment //p' "$tmp/target.out")
[ -n "$segment" ] || { echo "the target did not start" >&2; exit 1; }

run() { # op block batch -> median gb/s and median p50 latency
    local gbs=() p50=()
    for _ in $(seq "$RUNS"); do
        local j
        j=$($B bench initiator --segment "$segment" --op "$1" --block-size "$2" \
            --batch-size "$3" --duration "$DURATION" --json 2>/dev/null)
        echo "$j" >> "$RAW"
        gbs+=("$(echo "$j" | field gb_per_s)")
        p50+=("$(echo "$j" | sed -n 's/.*"p50":\([0-9.eE+-]*\).*/\1/p')")
    done
    echo "$(printf '%s\n' "${gbs[@]}" | median) $(printf '%s\n' "${p50[@]}" | median)"
}

printf '\nSingle-stream TCP loopback limit: %.2f GB/s (median of %s)\n\n' "$limit" "$RUNS"
echo "| op | block | batch | GB/s | ratio to TCP limit | goal |"
echo "|---|---|---|---|---|---|"
for block in 4K 64K 1M 16M; do
    case $block in 4K) goal=0.15;; 64K) goal=0.7;; *) goal=0.85;; esac
    batch=256; [ "$block" = 16M ] && batch=32
    for op in write read; do
        echo "==> $op $block x $batch" >&2
        read -r gbs _ < <(run "$op" "$block" "$batch")
        ratio=$(awk -v a="$gbs" -v b="$limit" 'BEGIN {printf "%.2f", a / b}')
        printf '| %s | %s | %s | %.2f | %s | >= %s |\n' "$op" "$block" "$batch" "$gbs" "$ratio" "$goal"
    done
done
echo
for op in write read; do
    echo "==> $op 4K x 1 (latency)" >&2
    read -r _ p50 < <(run "$op" 4K 1)
    printf 'Single 4 KiB synchronous %s: p50 %.1f us (median of %s runs; goal <= 15 us)\n' "$op" "$p50" "$RUNS"
done
