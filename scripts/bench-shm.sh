#!/usr/bin/env bash
# Shared-memory transport benchmark against this machine's own limits, all
# measured in the same run:
#   1. `ferry bench memcpy-limit --threads T` at 4 KiB, 64 KiB, 1 MiB and
#      16 MiB blocks: memcpy on one thread and on T threads, T being the
#      number of threads shm copies with (FERRY_SHM_COPY_THREADS, exported
#      to every process; default: the CPUs this script may use);
#   2. `ferry bench` between two processes over shm, both ways in: engine-
#      allocated memory (mapped memfd) and application memory (cross-memory
#      attach), writes and reads, batches of 256 (64 of 1 MiB, 4 of 16 MiB);
#      the mapped 1 MiB and 16 MiB writes once more without non-temporal
#      stores (FERRY_SHM_NONTEMPORAL=off), to show what they bring;
#   3. the same targets over tcp at 1 MiB and 16 MiB (shm against tcp);
#   4. single 4 KiB synchronous writes (batch of 1): latency, both ways in.
# Medians of RUNS runs (default 3) of DURATION seconds (default 2).
#
# Prints a markdown table (or, with --json, the summary as JSON). Raw lines
# go to target/bench-shm.jsonl, the summary with ratios to target/bench-shm-
# summary.json. Never fails on a slow result: it measures, it does not judge.
#
# Builds with cargo unless --no-build (or FERRY_PREBUILT=1) is given or cargo
# is missing: then it uses the binaries in FERRY_BIN_DIR (default
# target/release when it holds a ferry binary, else target/bench-bin: ferry
# and the libferry_transport_{shm,tcp}.so plugins, found through
# FERRY_PLUGIN_PATH), so a machine without Rust runs a build carried to it.
# `--stage` builds and puts just those files, stripped, in target/bench-bin
# (about 20 MB; target/release is hundreds) and exits. Needs bash, awk, sed,
# sort and nproc only.
set -euo pipefail
cd "$(dirname "$0")/.."

JSON=0
BUILD=1
STAGE=0
[ "${FERRY_PREBUILT:-0}" = 1 ] && BUILD=0
for arg in "$@"; do
    case "$arg" in
        --json) JSON=1 ;;
        --no-build) BUILD=0 ;;
        --stage) STAGE=1 ;;
        -h|--help) sed -n '2,29p' "$0"; exit 0 ;;
        *) echo "unknown argument $arg (use --json, --no-build, --stage)" >&2; exit 2 ;;
    esac
done
BIN_DIR=${FERRY_BIN_DIR:-}
if [ -z "$BIN_DIR" ]; then
    BIN_DIR=target/release
    [ -x target/release/ferry ] || [ "$STAGE" = 1 ] || BIN_DIR=target/bench-bin
fi
if [ "$BUILD" = 1 ] && ! command -v cargo >/dev/null 2>&1; then
    if [ -x "$BIN_DIR/ferry" ]; then
        echo "==> no cargo here: using the prebuilt binaries in $BIN_DIR" >&2
        BUILD=0
    else
        echo "error: no cargo to build with and no prebuilt $BIN_DIR/ferry" >&2
        exit 1
    fi
fi
if [ "$BUILD" = 1 ]; then
    . scripts/lib/common.sh
    ensure_base
    cargo build --release --locked -q -p ferry-cli -p ferry-transport-shm -p ferry-transport-tcp
fi
FILES="ferry libferry_transport_shm.so libferry_transport_tcp.so"
for f in $FILES; do
    [ -e "$BIN_DIR/$f" ] || { echo "error: $BIN_DIR/$f is missing (build it, or set FERRY_BIN_DIR)" >&2; exit 1; }
done
if [ "$STAGE" = 1 ]; then
    mkdir -p target/bench-bin
    for f in $FILES; do
        cp -f "$BIN_DIR/$f" target/bench-bin/
        if command -v strip >/dev/null 2>&1; then strip --strip-debug "target/bench-bin/$f"; fi
    done
    echo "staged in target/bench-bin ($(du -sh target/bench-bin | cut -f1)): carry it and run this script there" >&2
    exit 0
fi
B=$BIN_DIR/ferry
# Plugins beside the binary, wherever it was carried.
export FERRY_PLUGIN_PATH=${FERRY_PLUGIN_PATH:-$(cd "$BIN_DIR" && pwd)}

RUNS=${RUNS:-3}
DURATION=${DURATION:-2}
THREADS=${FERRY_SHM_COPY_THREADS:-$(nproc)}
export FERRY_SHM_COPY_THREADS=$THREADS
export FERRY_TRANSPORTS=shm,tcp
mkdir -p target
RAW=target/bench-shm.jsonl
SUMMARY=target/bench-shm-summary.json
: > "$RAW"

# field NAME: the first number after "NAME": in a JSON line on stdin.
field() { sed -n "s/.*\"$1\":\([0-9.eE+-]*\).*/\1/p" | head -n 1; }
median() { sort -g | awk '{v[NR]=$1} END {if (NR) print v[int((NR+1)/2)]; else print 0}'; }
ratio() { awk -v a="$1" -v b="$2" 'BEGIN {if (b > 0) printf "%.3f", a / b; else print 0}'; }

BLOCKS="4K 64K 1M 16M"
declare -A M1 MT
for block in $BLOCKS; do
    echo "==> memcpy $block, 1 and $THREADS thread(s)" >&2
    lines=$(for _ in $(seq "$RUNS"); do
        $B bench memcpy-limit --block "$block" --duration "$DURATION" --threads "$THREADS" --json
    done)
    echo "$lines" >> "$RAW"
    M1[$block]=$(echo "$lines" | while read -r l; do echo "$l" | field gb_per_s; done | median)
    MT[$block]=$(echo "$lines" | while read -r l; do echo "$l" | field threads_gb_per_s; done | median)
done

tmp=$(mktemp -d)
pids=()
cleanup() { for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done; rm -rf "$tmp"; }
trap cleanup EXIT
start_target() { # name extra-args...
    local name=$1; shift
    $B bench target --buffer-size 1G "$@" > "$tmp/$name.out" 2> "$tmp/$name.err" &
    pids+=($!)
    for _ in $(seq 300); do grep -q '^segment ' "$tmp/$name.out" 2>/dev/null && break; sleep 0.1; done
    sed -n 's/^segment //p' "$tmp/$name.out"
}
mapped=$(start_target mapped --allocate)
cma=$(start_target cma)
if [ -z "$mapped" ] || [ -z "$cma" ]; then
    echo "a target did not start:" >&2
    cat "$tmp"/*.err >&2
    exit 1
fi

batch_of() { case "$1" in 1M) echo 64 ;; 16M) echo 4 ;; *) echo 256 ;; esac; }

ROWS=()    # JSON objects of the summary
TABLE=()   # markdown rows
declare -A GBS
# measure TRANSPORT WAY OP BLOCK BATCH NT: RUNS runs, medians recorded.
measure() {
    local transport=$1 way=$2 op=$3 block=$4 batch=$5 nt=$6 seg
    seg=$mapped; [ "$way" = cma ] && seg=$cma
    echo "==> $transport $way $op $block x $batch${nt:+ (FERRY_SHM_NONTEMPORAL=$nt)}" >&2
    local gbs=() ops=() p50=() p99=() j
    for _ in $(seq "$RUNS"); do
        if ! j=$(FERRY_SHM_NONTEMPORAL=${nt:-${FERRY_SHM_NONTEMPORAL:-on}} $B bench initiator --segment "$seg" --op "$op" \
                --block-size "$block" --batch-size "$batch" --duration "$DURATION" \
                --transport "$transport" --json 2> "$tmp/initiator.err"); then
            echo "   failed: $(tail -n 3 "$tmp/initiator.err")" >&2
            continue
        fi
        echo "$j" >> "$RAW"
        gbs+=("$(echo "$j" | field gb_per_s)")
        ops+=("$(echo "$j" | field ops_per_s)")
        p50+=("$(echo "$j" | field p50)")
        p99+=("$(echo "$j" | field p99)")
    done
    local g o l50 l99
    g=$(printf '%s\n' "${gbs[@]:-0}" | median)
    o=$(printf '%s\n' "${ops[@]:-0}" | median)
    l50=$(printf '%s\n' "${p50[@]:-0}" | median)
    l99=$(printf '%s\n' "${p99[@]:-0}" | median)
    GBS["$transport/$way/$op/$block/$batch/$nt"]=$g
    local r1 rt ntx=n/a
    [ "$transport/$way" = shm/mapped ] && ntx=${nt:-${FERRY_SHM_NONTEMPORAL:-on}}
    r1=$(ratio "$g" "${M1[$block]}")
    rt=$(ratio "$g" "${MT[$block]}")
    ROWS+=("{\"transport\":\"$transport\",\"way\":\"$way\",\"op\":\"$op\",\"block\":\"$block\",\"batch\":$batch,\"nontemporal\":\"$ntx\",\"runs\":${#gbs[@]},\"gb_per_s\":$g,\"ops_per_s\":$o,\"p50_us\":$l50,\"p99_us\":$l99,\"ratio_memcpy_1_thread\":$r1,\"ratio_memcpy_threads\":$rt}")
    TABLE+=("$(printf '| %s | %s%s | %s | %s x %s | %.2f | %.0f | %.1f / %.1f | %s | %s |' \
        "$transport" "$way" "${nt:+, nt $nt}" "$op" "$block" "$batch" "$g" "$o" "$l50" "$l99" "$r1" "$rt")")
}

for way in mapped cma; do
    for block in $BLOCKS; do
        for op in write read; do
            measure shm "$way" "$op" "$block" "$(batch_of "$block")" ""
        done
    done
done
for block in 1M 16M; do
    measure shm mapped write "$block" "$(batch_of "$block")" off
done
for way in mapped cma; do
    for block in 1M 16M; do
        for op in write read; do
            measure tcp "$way" "$op" "$block" "$(batch_of "$block")" ""
        done
    done
done
LAT=()
for way in mapped cma; do
    measure shm "$way" write 4K 1 ""
    LAT+=("$way")
done

# shm against tcp, same targets, same run.
VS_TCP=()
for way in mapped cma; do
    for block in 1M 16M; do
        for op in write read; do
            b=$(batch_of "$block")
            VS_TCP+=("{\"way\":\"$way\",\"op\":\"$op\",\"block\":\"$block\",\"shm_over_tcp\":$(ratio "${GBS[shm/$way/$op/$block/$b/]}" "${GBS[tcp/$way/$op/$block/$b/]}")}")
        done
    done
done

join() { local IFS=,; echo "$*"; }
MEMCPY=()
for block in $BLOCKS; do
    MEMCPY+=("\"$block\":{\"gb_per_s_1_thread\":${M1[$block]},\"gb_per_s_threads\":${MT[$block]}}")
done
cat > "$SUMMARY" <<EOF
{"host":"$(hostname)","cpus":$(nproc),"copy_threads":$THREADS,"runs":$RUNS,"duration_s":$DURATION,
"memcpy":{$(join "${MEMCPY[@]}")},
"results":[
$(join "${ROWS[@]}" | sed 's/},{/},\n{/g')
],
"shm_over_tcp":[$(join "${VS_TCP[@]}")]}
EOF

if [ "$JSON" = 1 ]; then
    cat "$SUMMARY"
else
    echo
    printf 'memcpy, 1 / %s thread(s), GB/s:' "$THREADS"
    for block in $BLOCKS; do printf ' %s %.2f / %.2f;' "$block" "${M1[$block]}" "${MT[$block]}"; done
    echo
    echo
    echo "| transport | way in | op | block x batch | GB/s | ops/s | p50 / p99 us | ratio to memcpy, 1 thread | ratio to memcpy, $THREADS threads |"
    echo "|---|---|---|---|---|---|---|---|---|"
    printf '%s\n' "${TABLE[@]}"
    echo
    echo "shm / tcp, same targets: $(join "${VS_TCP[@]}")"
fi
echo "raw: $RAW; summary: $SUMMARY" >&2
