#!/usr/bin/env bash
# Two builds of Ferry taking turns on the same one-peer benchmarks, so a
# change is judged against the code before it in the same run (the machine's
# noise moves both alike):
#
#   scripts/ab.sh OLD_DIR NEW_DIR
#
# Each DIR holds a `ferry` binary and its plugins (libferry_transport_*.so),
# e.g. target/release of two checkouts. Per round and build (turns alternate,
# the first build of a round alternates too): one target and one initiator of
# that build, tcp with one connection (AB_TRANSPORT, AB_CONNECTIONS), then
#   - one 4 KiB write at a time: p50 latency;
#   - 64 KiB writes and reads, batches of 256: GB/s;
#   - 1 MiB writes, batches of 32: GB/s.
# Prints each build's median over AB_ROUNDS rounds (default 5) of AB_DURATION
# seconds (default 2), and new / old. Raw JSON lines: target/ab.jsonl.
# Not a test: it never fails on a slow result.
set -euo pipefail
cd "$(dirname "$0")/.."

[ $# -eq 2 ] || { echo "usage: scripts/ab.sh OLD_DIR NEW_DIR (each with ferry and its plugins)" >&2; exit 2; }
for d in "$1" "$2"; do
    [ -x "$d/ferry" ] || { echo "$d/ferry: not an executable (build it: cargo build --release)" >&2; exit 2; }
    ls "$d"/libferry_transport_*.so >/dev/null 2>&1 || { echo "$d: no libferry_transport_*.so plugins" >&2; exit 2; }
done
OLD=$(cd "$1" && pwd)
NEW=$(cd "$2" && pwd)
ROUNDS=${AB_ROUNDS:-5}
DURATION=${AB_DURATION:-2}
export FERRY_TRANSPORTS=${AB_TRANSPORT:-tcp}
export FERRY_TCP_CONNECTIONS=${AB_CONNECTIONS:-1}
mkdir -p target
RAW=target/ab.jsonl
: > "$RAW"

tmp=$(mktemp -d)
target_pid=
cleanup() { [ -n "$target_pid" ] && kill "$target_pid" 2>/dev/null; rm -rf "$tmp"; }
trap cleanup EXIT

field() { sed -n "s/.*\"$1\":\([0-9.eE+-]*\).*/\1/p"; }
median() { sort -g | awk '{v[NR]=$1} END {if (NR) print v[int((NR+1)/2)]}'; }
spread() { sort -g | awk 'NR == 1 {a = $1} {b = $1} END {printf "%.2f-%.2f", a, b}'; }

# The cases: name op block batch field.
CASES="p50_4k_write write 4K 1 p50
gbs_64k_write write 64K 256 gb_per_s
gbs_64k_read read 64K 256 gb_per_s
gbs_1m_write write 1M 32 gb_per_s"

one() { # build-dir label: one target, every case once
    local dir=$1 label=$2
    FERRY_PLUGIN_PATH=$dir "$dir/ferry" bench target --buffer-size 256M > "$tmp/target.out" 2>/dev/null &
    target_pid=$!
    for _ in $(seq 100); do grep -q '^segment ' "$tmp/target.out" 2>/dev/null && break; sleep 0.1; done
    local segment
    segment=$(sed -n 's/^segment //p' "$tmp/target.out")
    [ -n "$segment" ] || { echo "$label: the target did not start" >&2; exit 1; }
    while read -r name op block batch fld; do
        local j v
        j=$(FERRY_PLUGIN_PATH=$dir "$dir/ferry" bench initiator --segment "$segment" --op "$op" \
            --block-size "$block" --batch-size "$batch" --duration "$DURATION" --json 2>/dev/null)
        echo "{\"build\":\"$label\",\"case\":\"$name\",\"result\":$j}" >> "$RAW"
        v=$(echo "$j" | field "$fld")
        echo "$v" >> "$tmp/$label.$name"
    done <<< "$CASES"
    kill "$target_pid" 2>/dev/null || true
    wait "$target_pid" 2>/dev/null || true
    target_pid=
}

for r in $(seq "$ROUNDS"); do
    echo "==> round $r of $ROUNDS" >&2
    if [ $((r % 2)) -eq 1 ]; then one "$OLD" old; one "$NEW" new; else one "$NEW" new; one "$OLD" old; fi
done

echo
echo "$FERRY_TRANSPORTS, $FERRY_TCP_CONNECTIONS connection(s), median of $ROUNDS rounds of ${DURATION} s, builds taking turns"
echo "old: $OLD"
echo "new: $NEW"
echo
echo "| case | old | new | new / old | old spread | new spread |"
echo "|---|---|---|---|---|---|"
while read -r name _ _ _ _; do
    o=$(median < "$tmp/old.$name")
    n=$(median < "$tmp/new.$name")
    os=$(spread < "$tmp/old.$name")
    ns=$(spread < "$tmp/new.$name")
    awk -v c="$name" -v o="$o" -v n="$n" -v os="$os" -v ns="$ns" \
        'BEGIN {printf "| %s | %.2f | %.2f | %.3f | %s | %s |\n", c, o, n, (o > 0 ? n / o : 0), os, ns}'
done <<< "$CASES"
echo
echo "(p50 in us: lower is better; GB/s: higher is better)"
