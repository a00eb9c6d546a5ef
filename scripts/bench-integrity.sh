#!/usr/bin/env bash
# What session integrity costs on TCP, in one run: the same `ferry bench`
# against three builds/configurations, interleaved round by round so the
# machine's noise hits them alike:
#   base     the commit before session tags (BASE, default: main's merge
#            base), built from `git archive` into target/integrity-base
#   headers  this tree, the default (frame headers and descriptors tagged)
#   payload  this tree with FERRY_INTEGRITY=payload (payloads tagged too)
# at 4 KiB x 256, 1 MiB x 16 and 16 MiB x 4, write and read, plus the
# single-stream TCP loopback limit. Each figure is the median of RUNS
# (default 3) runs of DURATION seconds (default 2). Prints a markdown table
# with each figure's ratio to base: throughput, and CPU time (initiator and
# target, user + system) per GB moved, which a machine shared with other
# work measures far more steadily than throughput. Raw JSON in
# target/bench-integrity.jsonl. Not a test: it never fails on a slow result.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/common.sh
ensure_base

RUNS=${RUNS:-3}
DURATION=${DURATION:-2}
BASE=${BASE:-$(git merge-base HEAD main 2>/dev/null || git rev-parse HEAD~1)}
RAW=target/bench-integrity.jsonl
: > "$RAW"
export FERRY_TRANSPORTS=tcp FERRY_PLUGIN_PROBE_HELPER=off FERRY_PLUGIN_CACHE=off

# The base build, from its own sources, its binaries kept apart.
basedir=target/integrity-base
if [ ! -x "$basedir/bin/ferry" ] || [ "$(cat "$basedir/commit" 2>/dev/null)" != "$BASE" ]; then
    echo "==> building base $BASE" >&2
    rm -rf "$basedir/src" && mkdir -p "$basedir/src" "$basedir/bin"
    git archive "$BASE" | tar -x -C "$basedir/src"
    # The same target directory: the dependencies are built once.
    (cd "$basedir/src" && cargo build --release -q -p ferry-cli -p ferry-transport-tcp \
        --target-dir "$OLDPWD/target")
    cp target/release/ferry target/release/libferry_transport_tcp.so "$basedir/bin/"
    echo "$BASE" > "$basedir/commit"
fi
echo "==> building this tree" >&2
cargo build --release -q -p ferry-cli -p ferry-transport-tcp
mkdir -p target/integrity-this
cp target/release/ferry target/release/libferry_transport_tcp.so target/integrity-this/

field() { sed -n "s/.*\"$1\":\([0-9.eE+-]*\).*/\1/p"; }
median() { sort -g | awk '{v[NR]=$1} END {if (NR) print v[int((NR+1)/2)]}'; }

limit=$(for _ in $(seq "$RUNS"); do
    target/integrity-this/ferry bench tcp-limit --duration "$DURATION" --json | tee -a "$RAW" | field gb_per_s
done | median)

tmp=$(mktemp -d)
target_pid=
cleanup() { [ -n "$target_pid" ] && kill "$target_pid" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT

# config -> "bindir integrity"
dir_of() { case $1 in base) echo "$basedir/bin";; *) echo target/integrity-this;; esac; }
integrity_of() { case $1 in payload) echo payload;; *) echo headers;; esac; }

start_target() { # config
    local d; d=$(dir_of "$1")
    FERRY_PLUGIN_PATH="$d" FERRY_INTEGRITY=$(integrity_of "$1") \
        "$d/ferry" bench target --buffer-size 512M > "$tmp/target.out" 2>/dev/null &
    target_pid=$!
    for _ in $(seq 600); do grep -q '^segment ' "$tmp/target.out" 2>/dev/null && break; sleep 0.1; done
    segment=$(sed -n 's/^segment //p' "$tmp/target.out")
    [ -n "$segment" ] || { echo "the $1 target did not start" >&2; exit 1; }
}
stop_target() { kill "$target_pid" 2>/dev/null; wait "$target_pid" 2>/dev/null || true; target_pid=; }

cases="write:4K:256 read:4K:256 write:1M:16 read:1M:16 write:16M:4 read:16M:4"
declare -A gbs cpu
secs() { # "0m1.250s" -> 1.250
    echo "$1" | awk -F'[ms]' '{print $1 * 60 + $2}'
}
target_ticks() { awk '{print $14 + $15}' "/proc/$target_pid/stat"; }
tick=$(getconf CLK_TCK)
for round in $(seq "$RUNS"); do
    for config in base headers payload; do
        echo "==> round $round: $config" >&2
        start_target "$config"
        d=$(dir_of "$config")
        for c in $cases; do
            IFS=: read -r op block batch <<< "$c"
            t0=$(target_ticks)
            out=$( { FERRY_PLUGIN_PATH="$d" FERRY_INTEGRITY=$(integrity_of "$config") \
                "$d/ferry" bench initiator --segment "$segment" --op "$op" --block-size "$block" \
                --batch-size "$batch" --duration "$DURATION" --json 2>/dev/null; times; } )
            t1=$(target_ticks)
            j=$(echo "$out" | head -1)
            read -r u s < <(echo "$out" | tail -1)
            bytes=$(echo "$j" | field bytes)
            # CPU seconds of both sides per GB moved.
            per_gb=$(awk -v u="$(secs "$u")" -v s="$(secs "$s")" -v t=$((t1 - t0)) -v k="$tick" -v b="$bytes" \
                'BEGIN {printf "%.4f", (u + s + t / k) / (b / 1e9)}')
            echo "{\"config\":\"$config\",\"round\":$round,\"cpu_s_per_gb\":$per_gb,\"result\":$j}" >> "$RAW"
            gbs[$config:$op:$block:$batch]+="$(echo "$j" | field gb_per_s) "
            cpu[$config:$op:$block:$batch]+="$per_gb "
        done
        stop_target
    done
done

printf '\nSingle-stream TCP loopback limit: %.2f GB/s (median of %s); load average: %s\n\n' \
    "$limit" "$RUNS" "$(cut -d' ' -f1-3 /proc/loadavg)"
echo "| op | block x batch | base GB/s | headers GB/s | headers / base | payload GB/s | payload / base | base / TCP limit | CPU s/GB base | headers / base | payload / base |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
for c in $cases; do
    IFS=: read -r op block batch <<< "$c"
    b=$(printf '%s\n' ${gbs[base:$c]} | median)
    h=$(printf '%s\n' ${gbs[headers:$c]} | median)
    p=$(printf '%s\n' ${gbs[payload:$c]} | median)
    cb=$(printf '%s\n' ${cpu[base:$c]} | median)
    ch=$(printf '%s\n' ${cpu[headers:$c]} | median)
    cp=$(printf '%s\n' ${cpu[payload:$c]} | median)
    awk -v op="$op" -v bl="$block x $batch" -v b="$b" -v h="$h" -v p="$p" -v l="$limit" \
        -v cb="$cb" -v ch="$ch" -v cp="$cp" \
        'BEGIN {printf "| %s | %s | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f | %.3f | %.3f | %.3f |\n",
            op, bl, b, h, h / b, p, p / b, b / l, cb, ch / cb, cp / cb}'
done
