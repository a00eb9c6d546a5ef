#!/usr/bin/env bash
# Staged tcp (or SWEEP_TRANSPORT) between two processes on cuda:0 (issue
# 30's staged goal), 1 MiB and 16 KiB blocks by layout (or SWEEP_API),
# write and read, under each setting named in SWEEP (default below), every
# setting against its own 1 MiB rows in the same run. For choosing staging's defaults; not part of run.sh.
#
#   bash tests/gpu/staged-sweep.sh .gpu
#   SWEEP="FERRY_STAGING_DEPTH=8|FERRY_STAGING_CHUNK=8M" bash tests/gpu/staged-sweep.sh .gpu
#   SWEEP_TRANSPORT=shm SWEEP_API=requests bash tests/gpu/staged-sweep.sh .gpu
#
# Two builds of the engine against each other (a prefix each, e.g. the old
# binary beside the same plugins in .gpu-old), taking turns:
#
#   for r in 1 2; do for p in .gpu-old .gpu; do
#       OUT=/tmp/sw/$p-$r SWEEP=default SWEEP_TRANSPORT=shm bash tests/gpu/staged-sweep.sh $p
#   done; done
#
# Writes sweep.txt (one line per setting: GB/s per row, the 16K/1M ratios,
# submit p50) and sweep-breakdown.txt (the staging job's account) to $OUT.
set -uo pipefail
P=${1:-.gpu}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
B=$P/bin/ferry
SWEEP=${SWEEP:-"default|FERRY_STAGING_DEPTH=8|FERRY_STAGING_CHUNK=16M|default"}
D=${SWEEP_DURATION:-1}
T=${SWEEP_TRANSPORT:-tcp}
API=${SWEEP_API:-layout}
tmp=$(mktemp -d)
trap 'kill $(cat "$tmp/pid" 2>/dev/null) 2>/dev/null; rm -rf "$tmp"' EXIT
FERRY_TRANSPORTS=shm,tcp $B bench target --buffer-size 1G --device cuda:0 --layout-block 16K,1M > "$tmp/t" 2> "$tmp/t.err" &
echo $! > "$tmp/pid"
for _ in $(seq 300); do grep -q '^segment ' "$tmp/t" && break; sleep 0.1; done
seg=$(sed -n 's/^segment //p' "$tmp/t")
field() { sed -n "s/.*\"$1\":\([0-9.eE+-]*\).*/\1/p"; }
IFS='|' read -ra settings <<< "$SWEEP"
for s in "${settings[@]}"; do
    envs=""; [ "$s" != default ] && envs=$s
    line="$s:"
    for op in write read; do
        declare -A g=()
        for block in 1M 16K; do
            j=$(env FERRY_TRANSPORTS=shm,tcp FERRY_LOG=warn,ferry_core::engine::staging::job=debug $envs \
                $B bench initiator --pattern kv --batch-bytes 256M --duration "$D" --verify --json \
                --segment "$seg" --device cuda:0 --transport "$T" --api "$API" --op $op --block-size $block \
                2> "$tmp/i.err")
            if ! echo "$j" | grep -q '"verified":true'; then
                echo "FAILED $s $op $block: $(tail -n 2 "$tmp/i.err")"; continue
            fi
            g[$block]=$(echo "$j" | field gb_per_s)
            sub=$(echo "$j" | field submit_p50_us)
            line="$line $op/$block $(printf %.2f "${g[$block]}") GB/s (submit $(printf %.0f "$sub") us)"
            echo "$s $op $block: $(grep -o 'staging job: .*' "$tmp/i.err" | tail -n 1)" >> "$OUT/sweep-breakdown.txt"
        done
        line="$line $op 16K/1M $(awk -v a="${g[16K]:-0}" -v b="${g[1M]:-0}" 'BEGIN { printf "%.2f", (b > 0) ? a / b : 0 }');"
    done
    echo "$line" | tee -a "$OUT/sweep.txt"
done
