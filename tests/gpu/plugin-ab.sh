#!/usr/bin/env bash
# One transport plugin against another build of it, on one host, taking
# turns: KV-shaped host-memory batches (256 MiB of shuffled blocks, verified)
# between an initiator and a target that both load the prefix's plugins (A)
# or both find DIR's build of the transport first (B,
# FERRY_PLUGIN_PATH=DIR). Loans differ by up to 1.8x in GB/s, so a change
# is measured against its parent in the same run, not against an earlier
# loan's figures.
#
#   bash tests/gpu/plugin-ab.sh .gpu DIR [TRANSPORT] [BLOCKS]
#
# TRANSPORT defaults to shm; BLOCKS (default "1M 4K") are the block sizes,
# the first the reference of the ratios; AB_ROUNDS (3) rounds; AB_OPS
# ("write read"). Prints each round's GB/s and the medians; exits 1 when a
# run failed or was not verified.
set -uo pipefail
P=${1:?usage: plugin-ab.sh PREFIX DIR [TRANSPORT] [BLOCKS]}
DIR=${2:?usage: plugin-ab.sh PREFIX DIR [TRANSPORT] [BLOCKS]}
T=${3:-shm}
BLOCKS=${4:-1M 4K}
B=$P/bin/ferry
tmp=$(mktemp -d)
trap 'kill $(cat "$tmp"/pid.* 2>/dev/null) 2>/dev/null; rm -rf "$tmp"' EXIT
declare -A seg
for side in A B; do
    envs="FERRY_TRANSPORTS=shm,tcp"
    [ $side = B ] && envs="$envs FERRY_PLUGIN_PATH=$DIR"
    env $envs $B bench target --buffer-size 1G --allocate --layout-block "$(echo $BLOCKS | tr ' ' ,)" \
        > "$tmp/target.$side" 2> "$tmp/target.$side.err" &
    echo $! > "$tmp/pid.$side"
    for _ in $(seq 300); do grep -q '^segment ' "$tmp/target.$side" && break; sleep 0.1; done
    seg[$side]=$(sed -n 's/^segment //p' "$tmp/target.$side")
    [ -n "${seg[$side]}" ] || { echo "target $side did not start: $(tail -n 3 "$tmp/target.$side.err")"; exit 1; }
done
echo "B loads: $(FERRY_PLUGIN_PATH=$DIR $B info --json 2>/dev/null | grep -o "\"path\": *\"$DIR/[^\"]*\"" | head -n 1)"
. "$(dirname "$0")/median.sh"
declare -A all
fail=0
for op in ${AB_OPS:-write read}; do
    for round in $(seq "${AB_ROUNDS:-3}"); do
        for block in $BLOCKS; do
            for side in A B; do
                envs="FERRY_TRANSPORTS=shm,tcp"
                [ $side = B ] && envs="$envs FERRY_PLUGIN_PATH=$DIR"
                j=$(env $envs $B bench initiator --pattern kv --segment "${seg[$side]}" --transport "$T" --api layout \
                    --op $op --block-size $block --batch-bytes 256M --duration 1 --verify --json 2> "$tmp/err")
                if ! echo "$j" | grep -q '"verified":true'; then
                    echo "FAILED $side $op $block: $(tail -n 2 "$tmp/err")"; fail=1; continue
                fi
                g=$(echo "$j" | sed -n 's/.*"gb_per_s":\([0-9.eE+-]*\).*/\1/p')
                all[$side/$op/$block]+=" $g"
                printf 'round %s %s %-5s %s: %.2f GB/s\n' "$round" $side $op $block "$g"
            done
        done
    done
done
ref=${BLOCKS%% *}
echo "medians (GB/s), and each block size x the same side's $ref:"
for op in ${AB_OPS:-write read}; do
    for side in A B; do
        line="  $side $op:"
        r=$(echo "${all[$side/$op/$ref]:-}" | median)
        for block in $BLOCKS; do
            m=$(echo "${all[$side/$op/$block]:-}" | median)
            line="$line $block $(awk -v m="${m:-0}" -v r="${r:-0}" 'BEGIN { printf "%.2f (x%.2f)", m, (r > 0) ? m / r : 0 }')"
        done
        echo "$line"
    done
done
exit $fail
