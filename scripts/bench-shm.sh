#!/usr/bin/env bash
# Shared-memory transport benchmark against this machine's single-thread
# memcpy, both measured in the same run:
#   1. `ferry bench memcpy-limit` at 4 KiB, 64 KiB, 1 MiB, 16 MiB and 64 MiB
#      (64 MiB working set, so memory, not cache);
#   2. `ferry bench` between two processes over shm, for both ways in:
#      engine-allocated memory (mapped memfd) and application memory
#      (cross-memory attach), write and read, batches of 256 (32 for 16 MiB);
#   3. single 4 KiB synchronous writes (batch of 1): latency.
# Medians of RUNS runs (default 3) of DURATION seconds (default 2). Prints a
# markdown table; raw JSON goes to target/bench-shm.jsonl. Never fails on a
# slow result: it measures, it does not judge.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/common.sh
ensure_base

RUNS=${RUNS:-3}
DURATION=${DURATION:-2}
cargo build --release --workspace --locked -q
B=target/release/ferry
RAW=target/bench-shm.jsonl
: > "$RAW"
export FERRY_TRANSPORTS=shm,tcp

field() { sed -n "s/.*\"$1\":\([0-9.eE+-]*\).*/\1/p"; }
median() { sort -g | awk '{v[NR]=$1} END {if (NR) print v[int((NR+1)/2)]}'; }

declare -A MEMCPY
for block in 4K 64K 1M 16M 64M; do
    echo "==> memcpy $block" >&2
    MEMCPY[$block]=$(for _ in $(seq "$RUNS"); do
        $B bench memcpy-limit --block "$block" --duration "$DURATION" --json | tee -a "$RAW" | field gb_per_s
    done | median)
done

tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"; }
trap cleanup EXIT
start_target() { # name extra-args...
    local name=$1; shift
    $B bench target --buffer-size 1G "$@" > "$tmp/$name.out" 2>/dev/null &
    pids+=($!)
    for _ in $(seq 300); do grep -q '^segment ' "$tmp/$name.out" 2>/dev/null && break; sleep 0.1; done
    sed -n 's/^segment //p' "$tmp/$name.out"
}
mapped=$(start_target mapped --allocate)
cma=$(start_target cma)
[ -n "$mapped" ] && [ -n "$cma" ] || { echo "a target did not start" >&2; exit 1; }

run() { # segment op block batch -> median gb/s and median p50
    local gbs=() p50=()
    for _ in $(seq "$RUNS"); do
        local j
        j=$($B bench initiator --segment "$1" --op "$2" --block-size "$3" --batch-size "$4" \
            --duration "$DURATION" --transport shm --json 2>/dev/null)
        echo "$j" >> "$RAW"
        gbs+=("$(echo "$j" | field gb_per_s)")
        p50+=("$(echo "$j" | sed -n 's/.*"p50":\([0-9.eE+-]*\).*/\1/p')")
    done
    echo "$(printf '%s\n' "${gbs[@]}" | median) $(printf '%s\n' "${p50[@]}" | median)"
}

printf '\nSingle-thread memcpy (64 MiB working set): 4K %.2f, 64K %.2f, 1M %.2f, 16M %.2f, 64M %.2f GB/s\n\n' \
    "${MEMCPY[4K]}" "${MEMCPY[64K]}" "${MEMCPY[1M]}" "${MEMCPY[16M]}" "${MEMCPY[64M]}"
echo "| way in | op | block | batch | GB/s | ratio to memcpy | goal |"
echo "|---|---|---|---|---|---|---|"
for way in mapped cma; do
    seg=$mapped; [ "$way" = cma ] && seg=$cma
    for block in 4K 64K 1M 16M; do
        batch=256; [ "$block" = 16M ] && batch=32
        goal="-"
        case "$way/$block" in
            */4K) goal=">= 1.5 GB/s";;
            mapped/1M|mapped/16M) goal=">= 0.8";;
            cma/1M|cma/16M) goal=">= 0.5";;
        esac
        for op in write read; do
            echo "==> $way $op $block x $batch" >&2
            read -r gbs _ < <(run "$seg" "$op" "$block" "$batch")
            ratio=$(awk -v a="$gbs" -v b="${MEMCPY[$block]}" 'BEGIN {printf "%.2f", a / b}')
            printf '| %s | %s | %s | %s | %.2f | %s | %s |\n' "$way" "$op" "$block" "$batch" "$gbs" "$ratio" "$goal"
        done
    done
done
echo
for way in mapped cma; do
    seg=$mapped; [ "$way" = cma ] && seg=$cma
    echo "==> $way 4K x 1 (latency)" >&2
    read -r _ p50 < <(run "$seg" write 4K 1)
    printf 'Single 4 KiB synchronous write, %s: p50 %.1f us (median of %s runs; goal <= 3 us)\n' "$way" "$p50" "$RUNS"
done
