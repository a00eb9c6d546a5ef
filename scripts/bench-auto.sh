#!/usr/bin/env bash
# The automatic transport choice against each transport forced, in one run:
# host memory between two processes of this host, 1 MiB and 16 MiB blocks,
# writes and reads. One target engine runs every enabled transport; the
# initiator runs once per transport with FERRY_TRANSPORTS=<it> (forced) and
# once without (automatic), interleaved, RUNS times (default 3) of DURATION
# seconds (default 2); medians. Prints a markdown table with the ratio
# auto / best forced transport (goal >= 0.95) and each one's ratio to this
# machine's single-thread memcpy, measured in the same run.
#
#   scripts/bench-auto.sh [--json] [--no-build]
#
# --json      one JSON object on stdout instead of the table
# --no-build  use prebuilt binaries (target/release/ferry, or $FERRY_BIN),
#             for machines without Rust
# TRANSPORTS  the transports to force (default: those the target runs,
#             from its banner); TARGET_ARGS extra `ferry bench target` args
#             (--allocate: engine-allocated memory). Never fails on a slow
#             result: it measures, it does not judge.
set -euo pipefail
cd "$(dirname "$0")/.."

JSON=0
BUILD=1
for a in "$@"; do
    case "$a" in
        --json) JSON=1 ;;
        --no-build) BUILD=0 ;;
        -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
        *) echo "bench-auto.sh: unknown argument $a (--json, --no-build)" >&2; exit 2 ;;
    esac
done
if [ "$BUILD" = 1 ]; then
    . scripts/lib/common.sh
    ensure_base
    cargo build --release --workspace --locked -q
fi
B=${FERRY_BIN:-target/release/ferry}
[ -x "$B" ] || { echo "bench-auto.sh: $B is not built (run without --no-build, or set FERRY_BIN)" >&2; exit 1; }
RUNS=${RUNS:-3}
DURATION=${DURATION:-2}
RAW=${RAW:-target/bench-auto.jsonl}
mkdir -p "$(dirname "$RAW")"
: > "$RAW"
unset FERRY_TRANSPORTS

field() { sed -n "s/.*\"$1\":\"\{0,1\}\([^,\"}]*\).*/\1/p"; }
median() { sort -g | awk '{v[NR]=$1} END {if (NR) print v[int((NR+1)/2)]; else print 0}'; }

tmp=$(mktemp -d)
pid=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null || true; rm -rf "$tmp"; }
trap cleanup EXIT
# shellcheck disable=SC2086
$B bench target --buffer-size 1G ${TARGET_ARGS:-} > "$tmp/target.out" 2> "$tmp/target.err" &
pid=$!
for _ in $(seq 300); do grep -q '^segment ' "$tmp/target.out" 2>/dev/null && break; sleep 0.1; done
seg=$(sed -n 's/^segment //p' "$tmp/target.out")
[ -n "$seg" ] || { echo "the target did not start:" >&2; cat "$tmp/target.err" >&2; exit 1; }
if [ -z "${TRANSPORTS:-}" ]; then
    for _ in $(seq 50); do grep -q 'transports:' "$tmp/target.err" && break; sleep 0.1; done
    TRANSPORTS=$(sed -n 's/.*; transports: \(.*\)\. Stop with.*/\1/p' "$tmp/target.err" | tr -d ',')
fi
[ -n "$TRANSPORTS" ] || { echo "bench-auto.sh: no transport at the target" >&2; exit 1; }

declare -A MEMCPY
for block in 1M 16M; do
    echo "==> memcpy $block" >&2
    MEMCPY[$block]=$(for _ in $(seq "$RUNS"); do
        $B bench memcpy-limit --block "$block" --duration "$DURATION" --json | tee -a "$RAW" | field gb_per_s
    done | median)
done

one() { # transport|auto op block batch -> "gb/s picked-transport"
    local j
    if [ "$1" = auto ]; then
        j=$($B bench initiator --segment "$seg" --op "$2" --block-size "$3" --batch-size "$4" \
            --duration "$DURATION" --json 2>/dev/null) || j='{"gb_per_s":0,"transport":"failed"}'
    else
        j=$(FERRY_TRANSPORTS=$1 $B bench initiator --segment "$seg" --op "$2" --block-size "$3" \
            --batch-size "$4" --duration "$DURATION" --json 2>/dev/null) || j='{"gb_per_s":0,"transport":"failed"}'
    fi
    echo "$j" >> "$RAW"
    echo "$(echo "$j" | field gb_per_s) $(echo "$j" | field transport)"
}

rows=()
for block in 1M 16M; do
    batch=64; [ "$block" = 16M ] && batch=8
    for op in write read; do
        declare -A got=()
        picks=()
        for _ in $(seq "$RUNS"); do
            for t in $TRANSPORTS auto; do
                echo "==> $op $block x $batch: $t" >&2
                read -r gbs picked < <(one "$t" "$op" "$block" "$batch")
                got[$t]="${got[$t]:-} $gbs"
                [ "$t" = auto ] && picks+=("$picked")
            done
        done
        best=0; best_t=-
        cells=""
        for t in $TRANSPORTS; do
            m=$(printf '%s\n' ${got[$t]} | median)
            cells="$cells $t=$m"
            if awk -v a="$m" -v b="$best" 'BEGIN {exit !(a > b)}'; then best=$m; best_t=$t; fi
        done
        auto=$(printf '%s\n' ${got[auto]} | median)
        picked=$(printf '%s\n' "${picks[@]}" | sort | uniq -c | sort -rn | awk '{print $2}' | head -1)
        ratio=$(awk -v a="$auto" -v b="$best" 'BEGIN {printf "%.2f", (b > 0 ? a / b : 0)}')
        rows+=("$op $block $batch $best_t $best $auto $picked $ratio${cells}")
    done
done

if [ "$JSON" = 1 ]; then
    printf '{"segment":"%s","runs":%s,"duration_s":%s,"memcpy_gb_per_s":{"1M":%s,"16M":%s},"rows":[' \
        "$seg" "$RUNS" "$DURATION" "${MEMCPY[1M]}" "${MEMCPY[16M]}"
    sep=""
    for r in "${rows[@]}"; do
        read -r op block batch best_t best auto picked ratio rest <<< "$r"
        forced=""
        fsep=""
        for c in $rest; do forced="$forced$fsep\"${c%%=*}\":${c#*=}"; fsep=","; done
        printf '%s{"op":"%s","block":"%s","batch":%s,"forced_gb_per_s":{%s},"best":"%s","best_gb_per_s":%s,"auto_gb_per_s":%s,"auto_transport":"%s","auto_over_best":%s}' \
            "$sep" "$op" "$block" "$batch" "$forced" "$best_t" "$best" "$auto" "$picked" "$ratio"
        sep=","
    done
    echo '],"goal_auto_over_best":0.95}'
    exit 0
fi

printf '\nSingle-thread memcpy (64 MiB working set): 1M %.2f, 16M %.2f GB/s\n\n' "${MEMCPY[1M]}" "${MEMCPY[16M]}"
header="| op | block | batch |"
line="|---|---|---|"
for t in $TRANSPORTS; do header="$header $t GB/s |"; line="$line---|"; done
echo "$header auto GB/s | auto chose | best | auto / best | best / memcpy |"
echo "$line---|---|---|---|---|"
for r in "${rows[@]}"; do
    read -r op block batch best_t best auto picked ratio rest <<< "$r"
    out="| $op | $block | $batch |"
    for c in $rest; do out="$out $(printf '%.2f' "${c#*=}") |"; done
    vs=$(awk -v a="$best" -v b="${MEMCPY[$block]}" 'BEGIN {printf "%.2f", (b > 0 ? a / b : 0)}')
    printf '%s %.2f | %s | %s | %s | %s |\n' "$out" "$auto" "$picked" "$best_t" "$ratio" "$vs"
done
echo
echo "Goal: auto / best >= 0.95 (medians of $RUNS runs of ${DURATION} s; raw JSON in $RAW)."
