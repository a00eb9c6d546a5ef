#!/usr/bin/env bash
# How cost grows with peers (issue 32), on this host's loopback, over tcp:
#   a     N initiator processes (each its own engine, 4 tcp connections)
#         against ONE target process; the target is measured.
#   b     ONE initiator engine (`ferry bench scale-initiator`) against N
#         target processes; the initiator is measured.
#   both  a, then b.
#   ab OLD_DIR NEW_DIR   the same sweep (both modes) with two builds, taking
#         turns at every point. A DIR holds `ferry` and the plugin files
#         (libferry_transport_tcp.so, ferry-probe). A build whose ferry has
#         no `bench scale-initiator` is driven by NEW_DIR's ferry, with its
#         own plugins (they hold the transport threads being compared).
#
# For each N in SCALE_N (default "1 16 64 256"), once every peer moved its
# first batch, the measured process is sampled from /proc/PID (status:
# Threads, VmRSS; fd/; stat: utime+stime) at the start and end of a window of
# SCALE_DURATION seconds (default 5), and the initiators count the bytes of
# batches completing inside that same window. Reported per point: threads,
# open fds, established data connections, RSS, RSS per connection beyond the
# sweep's first point, RSS beyond the registered memory per connection, CPU
# seconds per GB moved, aggregate GB/s, peers served and refused.
#
# 64 KiB blocks, SCALE_OP=write (or read). Every initiator sends 1 MiB
# frames (FERRY_TCP_FRAME_BYTES; 4 MiB by default), 64 requests per peer at
# a time, so every peer's batch fills all 4 connections: mode a, 64
# requests per batch and one submitting thread per initiator; mode b, 256
# per batch (4 targets at a time, every target in turn), two threads.
# Peers all come from 127.0.0.1, so when 4 x N passes a cap meant per peer
# host, the cap is raised for the run and the script says so
# (SCALE_DEFAULT_CAPS=1 keeps the defaults, to see what they refuse). Mode a
# starts its initiators in waves of SCALE_WAVE (32), each wave connected
# before the next starts: N engines starting at once on 2 cores take longer
# than the 1 s a connection has to authenticate, which measures the
# start-up stampede, not the steady state. Peers run at nice
# SCALE_PEER_NICE (10); SCALE_START_TIMEOUT (180 s) bounds their start.
#
# Builds what it needs (cargo, release) unless FERRY_BIN names a ferry
# binary (its directory holding the plugins, or FERRY_PLUGIN_PATH);
# SCALE_LABEL names it in the results (default: the commit);
# SCALE_DRIVER names the ferry that runs scale-initiator when that build's
# has none. Writes a
# table, target/scale/<time>-<label>.json per build, and plots (`ferry
# bench scale-plot`) into target/scale/<time>/; SCALE_KEEP_LOGS=1 keeps
# every process's output in target/scale/<time>-logs. Needs bash,
# coreutils, procps and awk. Measures, never judges: it fails only when a
# process cannot start or the measurement cannot be taken.
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,46p' "$0"; }
MODE=${1:-}
OLD_DIR="" NEW_DIR=""
case "$MODE" in
    a|b|both) [ $# -eq 1 ] || { echo "error: mode $MODE takes no more arguments (settings are SCALE_* variables: --help)" >&2; exit 2; } ;;
    ab)
        [ $# -eq 3 ] || { echo "error: usage: scripts/scale.sh ab OLD_DIR NEW_DIR" >&2; exit 2; }
        OLD_DIR=$(cd "$2" 2>/dev/null && pwd) || { echo "error: $2 is not a directory" >&2; exit 2; }
        NEW_DIR=$(cd "$3" 2>/dev/null && pwd) || { echo "error: $3 is not a directory" >&2; exit 2; }
        ;;
    -h|--help) usage; exit 0 ;;
    "") echo "error: give a mode: a, b, both, or ab OLD_DIR NEW_DIR (--help says more)" >&2; exit 2 ;;
    *) echo "error: unknown mode $MODE: use a, b, both, or ab OLD_DIR NEW_DIR (--help says more)" >&2; exit 2 ;;
esac

SCALE_N=${SCALE_N:-"1 16 64 256"}
SCALE_DURATION=${SCALE_DURATION:-5}
SCALE_OP=${SCALE_OP:-write}
SCALE_START_TIMEOUT=${SCALE_START_TIMEOUT:-180}
SCALE_DEFAULT_CAPS=${SCALE_DEFAULT_CAPS:-0}
SCALE_WAVE=${SCALE_WAVE:-32}
BLOCK=64K
CONNECTIONS=4
FRAME_BYTES=1048576
TARGET_BUFFER=64M   # mode a: the measured target's registered memory
PEER_BUFFER=4M      # each mode-a initiator's, each mode-b target's; the mode-b initiator's
case "$SCALE_OP" in write|read) ;; *) echo "error: SCALE_OP must be write or read, not $SCALE_OP" >&2; exit 2 ;; esac
for n in $SCALE_N; do
    [[ "$n" =~ ^[1-9][0-9]*$ ]] || { echo "error: SCALE_N holds $n, not a positive count" >&2; exit 2; }
done
[[ "$SCALE_WAVE" =~ ^[1-9][0-9]*$ ]] || { echo "error: SCALE_WAVE must be a positive count, not $SCALE_WAVE" >&2; exit 2; }
[[ "$SCALE_DURATION" =~ ^[0-9]+(\.[0-9]+)?$ ]] || { echo "error: SCALE_DURATION must be seconds, not $SCALE_DURATION" >&2; exit 2; }
MAX_N=$(printf '%s\n' $SCALE_N | sort -n | tail -1)

# The builds: "label ferry-binary plugin-dir" lines.
BUILDS=()
if [ -n "$OLD_DIR" ]; then
    BUILDS+=("old $OLD_DIR/ferry $OLD_DIR" "new $NEW_DIR/ferry $NEW_DIR")
elif [ -n "${FERRY_BIN:-}" ]; then
    [ -x "$FERRY_BIN" ] || { echo "error: FERRY_BIN=$FERRY_BIN is not an executable" >&2; exit 1; }
    dir=$(cd "$(dirname "$FERRY_BIN")" && pwd)
    BUILDS+=("${SCALE_LABEL:-build} $dir/$(basename "$FERRY_BIN") ${FERRY_PLUGIN_PATH:-$dir}")
else
    command -v cargo >/dev/null 2>&1 || { echo "error: no cargo here to build with; set FERRY_BIN to a built ferry" >&2; exit 1; }
    # A fresh machine: the C compiler and the rest a build needs.
    . scripts/lib/common.sh
    ensure_base
    echo "==> cargo build --release (ferry, the tcp plugin, ferry-probe)" >&2
    cargo build --release --locked -q -p ferry-cli -p ferry-transport-tcp -p ferry-loader
    label=${SCALE_LABEL:-$(git rev-parse --short HEAD 2>/dev/null || echo build)}
    BUILDS+=("$label $PWD/target/release/ferry $PWD/target/release")
fi
for b in "${BUILDS[@]}"; do
    read -r _ f d <<< "$b"
    [ -x "$f" ] || { echo "error: $f is missing or not executable" >&2; exit 1; }
    [ -e "$d/libferry_transport_tcp.so" ] || { echo "error: $d/libferry_transport_tcp.so is missing (the tcp plugin)" >&2; exit 1; }
done
# The initiator: every build's own ferry if it has scale-initiator, else
# the last build's (the new one in ab).
read -r _ DRIVER _ <<< "${BUILDS[${#BUILDS[@]}-1]}"
DRIVER=${SCALE_DRIVER:-$DRIVER}
"$DRIVER" bench scale-initiator --help >/dev/null 2>&1 ||
    { echo "error: $DRIVER has no \`bench scale-initiator\` (build this checkout, or give a newer one)" >&2; exit 1; }
initiator_of() { if "$1" bench scale-initiator --help >/dev/null 2>&1; then echo "$1"; else echo "$DRIVER"; fi; }

# File descriptors: the measured process holds 4 per peer plus control
# connections; every process of the run belongs to this user.
need_fds=$((MAX_N * (CONNECTIONS + 2) + 256))
if [ "$(ulimit -n)" != unlimited ] && [ "$(ulimit -n)" -lt "$need_fds" ]; then
    hard=$(ulimit -Hn)
    if [ "$hard" != unlimited ] && [ "$hard" -lt "$need_fds" ]; then
        echo "error: N = $MAX_N needs about $need_fds open files per process; the hard limit is $hard (raise it, e.g. in /etc/security/limits.conf, or lower SCALE_N)" >&2
        exit 1
    fi
    ulimit -n "$need_fds"
fi
need_procs=$((MAX_N * 16 + 512))
if [ "$(ulimit -u)" != unlimited ] && [ "$(ulimit -u)" -lt "$need_procs" ]; then
    echo "warning: ulimit -u is $(ulimit -u); $MAX_N engines may need about $need_procs threads" >&2
fi

CORES=$(nproc)
TICKS=$(getconf CLK_TCK 2>/dev/null || echo 100)
STAMP=$(date -u +%Y%m%dT%H%M%SZ)
OUT=target/scale
mkdir -p "$OUT"
tmp=$(mktemp -d)
PIDS=()
cleanup() {
    local p
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    if [ "${SCALE_KEEP_LOGS:-0}" = 1 ]; then
        rm -rf "$OUT/$STAMP-logs" && mv "$tmp" "$OUT/$STAMP-logs" && echo "logs: $OUT/$STAMP-logs" >&2
    else
        rm -rf "$tmp"
    fi
}
trap cleanup EXIT
trap 'exit 130' INT TERM

export FERRY_TRANSPORTS=tcp
export FERRY_TCP_CONNECTIONS=$CONNECTIONS

# proc_sample PID: "threads fds rss_kib cpu_ticks" of the process now.
proc_sample() {
    local pid=$1 threads rss fds ticks
    threads=$(awk '/^Threads:/ {print $2}' "/proc/$pid/status") || return 1
    rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status") || return 1
    fds=$(ls "/proc/$pid/fd" | wc -l)
    # After the command name (which may hold spaces): utime and stime are
    # the 12th and 13th fields.
    ticks=$(sed 's/^.*) //' "/proc/$pid/stat" | awk '{printf "%.0f\n", $12 + $13}') || return 1
    echo "$threads $fds $rss $ticks"
}

# data_connections PID PORT...: established TCP connections of the process
# with none of the given (control) ports at either end.
data_connections() {
    local pid=$1; shift
    local inodes
    inodes=$(find "/proc/$pid/fd" -lname 'socket:*' -printf '%l\n' 2>/dev/null | tr -dc '0-9\n')
    # /proc/net/tcp writes ports as 4 upper-case hex digits.
    local hex=() p
    for p in "$@"; do hex+=("$(printf '%04X' "$p")"); done
    { echo "$inodes"; echo "--"; echo "${hex[*]}"; echo "--"; cat /proc/net/tcp /proc/net/tcp6 2>/dev/null; } | awk '
        BEGIN { part = 0 }
        $0 == "--" { part++; next }
        part == 0 { if ($1 != "") mine[$1] = 1; next }
        part == 1 { for (i = 1; i <= NF; i++) ctl[$i] = 1; next }
        $4 == "01" && ($10 in mine) {
            nl = split($2, l, ":"); nr = split($3, r, ":")
            if (!(l[nl] in ctl) && !(r[nr] in ctl)) n++
        }
        END { print n + 0 }'
}

# wait_segment FILE PID: the segment a `ferry bench target` printed.
wait_segment() {
    local i
    for i in $(seq 600); do
        grep -q '^segment ' "$1" 2>/dev/null && { sed -n 's/^segment //p' "$1"; return 0; }
        kill -0 "$2" 2>/dev/null || return 1
        sleep 0.1
    done
    return 1
}

now() { date +%s.%N; }

# The N peers stand for N hosts but share this host's cores with the
# measured process: each runs one I/O thread, sleeps instead of polling
# while it waits, and runs at nice SCALE_PEER_NICE (10), so that the
# measured process is not left waiting for a core behind hundreds of
# runnable peer threads (the scheduler shares by thread). The measured
# process keeps every default.
LIGHT="FERRY_TCP_IO_THREADS=1 FERRY_SPIN_US=0 FERRY_TCP_SPIN_US=0"
PEER_NICE=${SCALE_PEER_NICE:-10}
# SCALE_PEER_SCHED=idle runs the peers under SCHED_IDLE instead (chrt -i 0):
# they get a core only when the measured process leaves one, as peers on
# hosts of their own would not take its cores at all.
case ${SCALE_PEER_SCHED:-nice} in
    nice) PEER_RUN=(nice -n "$PEER_NICE") ;;
    idle) PEER_RUN=(chrt -i 0) ;;
    *) echo "error: SCALE_PEER_SCHED=${SCALE_PEER_SCHED}: use nice or idle" >&2; exit 2 ;;
esac

# Caps meant per peer host, raised when 127.0.0.1 stands for N hosts.
caps_env() { # N -> assignments for the target's environment
    local n=$1 conns=$(($1 * CONNECTIONS))
    [ "$SCALE_DEFAULT_CAPS" = 1 ] && return 0
    if [ "$conns" -gt 256 ]; then
        echo "FERRY_TCP_MAX_CONNECTIONS_PER_HOST=$conns"
        [ "$conns" -gt 1024 ] && echo "FERRY_TCP_MAX_CONNECTIONS=$conns"
    fi
    [ "$n" -gt 2 ] && echo "FERRY_AUTH_MAX_PENDING_PER_HOST=64"
    return 0
}
CAPS_NOTE="All peers connect from 127.0.0.1, which the target counts as one host: tcp.max_connections_per_host (256) is raised to 4 x N when 4 x N passes it, and auth_max_pending_per_host (8) to 64 (auth_max_pending, the total) when N > 2, so one host standing for N hosts is not refused as a flood would be. SCALE_DEFAULT_CAPS=1 keeps the defaults."
[ "$SCALE_DEFAULT_CAPS" = 1 ] && CAPS_NOTE="Default caps (SCALE_DEFAULT_CAPS=1)."

# wait_ready N: waits until every initiator printed `ready` or exited.
# Initiator k writes $tmp/i$k.out and $tmp/i$k.err; their pids are IPIDS.
wait_ready() {
    local n=$1 started=$SECONDS k ready gone
    while :; do
        ready=0 gone=0
        for k in $(seq 0 $((n - 1))); do
            if grep -q '^ready' "$tmp/i$k.out" 2>/dev/null; then ready=$((ready + 1))
            elif ! kill -0 "${IPIDS[$k]}" 2>/dev/null; then gone=$((gone + 1)); fi
        done
        [ $((ready + gone)) -ge "$n" ] && { echo "$ready"; return 0; }
        if [ $((SECONDS - started)) -gt "$SCALE_START_TIMEOUT" ]; then
            echo "error: after ${SCALE_START_TIMEOUT} s only $ready of $n initiators are ready (SCALE_START_TIMEOUT)" >&2
            return 1
        fi
        sleep 0.2
    done
}

# cpu_ticks PID...: utime + stime of these processes, together (a command
# name without spaces, so fields 14 and 15).
cpu_ticks() {
    local files=() p
    for p in "$@"; do [ -r "/proc/$p/stat" ] && files+=("/proc/$p/stat"); done
    [ ${#files[@]} -gt 0 ] || { echo 0; return 0; }
    awk '{ t += $14 + $15 } END { printf "%.0f\n", t }' "${files[@]}" 2>/dev/null || echo 0
}

# busy_ticks: every CPU's busy time on this machine (all users, all processes).
busy_ticks() { awk '/^cpu / { printf "%.0f\n", $2 + $3 + $4 + $7 + $8 + $9; exit }' /proc/stat; }

# measure PID PORTS...: writes the window file, samples PID (and the peers,
# PEER_PIDS, and the whole machine) at its start, middle and end; prints
# "threads fds rss_kib cpu_s data_conns window_s peers_cpu_s
# machine_busy_cores".
measure() {
    local pid=$1; shift
    local t0 t1 s0 s1 conns p0 p1 m0 m1
    t0=$(awk -v t="$(now)" 'BEGIN {printf "%.3f", t + 0.3}')
    t1=$(awk -v t="$t0" -v d="$SCALE_DURATION" 'BEGIN {printf "%.3f", t + d}')
    echo "$t0 $t1" > "$tmp/window.new" && mv "$tmp/window.new" "$tmp/window"
    sleep "$(awk -v t="$t0" -v n="$(now)" 'BEGIN {d = t - n; printf "%.3f", (d > 0 ? d : 0)}')"
    s0=$(proc_sample "$pid") || { echo "error: the measured process $pid is gone" >&2; return 1; }
    p0=$(cpu_ticks "${PEER_PIDS[@]}"); m0=$(busy_ticks)
    # Threads, descriptors, RSS and connections mid-window, every peer at
    # work (a sampler slowed by load could reach the end too late).
    local tm
    tm=$(awk -v a="$t0" -v b="$t1" 'BEGIN {printf "%.3f", (a + b) / 2}')
    sleep "$(awk -v t="$tm" -v n="$(now)" 'BEGIN {d = t - n; printf "%.3f", (d > 0 ? d : 0)}')"
    local mid
    mid=$(proc_sample "$pid") || { echo "error: the measured process $pid is gone" >&2; return 1; }
    conns=$(data_connections "$pid" "$@")
    sleep "$(awk -v t="$t1" -v n="$(now)" 'BEGIN {d = t - n; printf "%.3f", (d > 0 ? d : 0)}')"
    s1=$(proc_sample "$pid") || { echo "error: the measured process $pid is gone" >&2; return 1; }
    p1=$(cpu_ticks "${PEER_PIDS[@]}"); m1=$(busy_ticks)
    local late
    late=$(awk -v t="$t1" -v n="$(now)" 'BEGIN {printf "%.1f", n - t}')
    awk -v l="$late" 'BEGIN {exit !(l > 1)}' &&
        echo "warning: the end sample came $late s after the window (load): its CPU figures cover more than the window" >&2
    read -r _ _ _ c0 <<< "$s0"
    read -r th fd rss _ <<< "$mid"
    read -r _ _ _ c1 <<< "$s1"
    awk -v th="$th" -v fd="$fd" -v rss="$rss" -v c0="$c0" -v c1="$c1" -v hz="$TICKS" \
        -v conns="$conns" -v d="$SCALE_DURATION" -v p0="$p0" -v p1="$p1" -v m0="$m0" -v m1="$m1" \
        'BEGIN {printf "%d %d %d %.3f %d %.3f %.3f %.2f\n", th, fd, rss, (c1 - c0) / hz, conns, d,
            (p1 - p0) / hz, (m1 - m0) / hz / d}'
}

# json_field NAME < JSON: a number field of a one-line JSON object.
json_field() { sed -n "s/.*\"$1\":\([0-9.eE+-]*\).*/\1/p" | head -n 1; }

# stop_all: waits for the initiators (they stop at the window's end), then
# ends every process of the point.
stop_all() {
    local p i
    for i in $(seq 100); do
        local alive=0
        for p in "${IPIDS[@]}"; do kill -0 "$p" 2>/dev/null && { alive=1; break; }; done
        [ "$alive" = 0 ] && break
        sleep 0.1
    done
    for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
    for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
    PIDS=() IPIDS=()
}

# point MODE N LABEL FERRY PLUGINS: one measurement; appends a JSON line to
# $tmp/points-LABEL.jsonl.
point() {
    local mode=$1 n=$2 label=$3 ferry=$4 plugins=$5
    local init k seg pid measured registered served refused bytes why m
    init=$(initiator_of "$ferry")
    rm -f "$tmp"/i*.out "$tmp"/i*.err "$tmp"/t*.out "$tmp"/t*.err "$tmp/window"
    PIDS=() IPIDS=() PEER_PIDS=()
    # The first initiators wait for the window while every later wave
    # starts: each wave may take SCALE_START_TIMEOUT.
    local wait_s=$((SCALE_START_TIMEOUT * (n / SCALE_WAVE + 2)))
    local init_args=(bench scale-initiator --op "$SCALE_OP" --block-size "$BLOCK" --per-peer 64
        --buffer-size "$PEER_BUFFER" --window-file "$tmp/window" --duration "$wait_s" --json)
    local ports=()
    echo "==> $label: mode $mode, N = $n" >&2
    if [ "$mode" = a ]; then
        # shellcheck disable=SC2046 # caps_env prints NAME=value words
        env $(caps_env "$n") FERRY_PLUGIN_PATH="$plugins" \
            "$ferry" bench target --buffer-size "$TARGET_BUFFER" > "$tmp/t0.out" 2> "$tmp/t0.err" &
        measured=$!; PIDS+=("$measured")
        seg=$(wait_segment "$tmp/t0.out" "$measured") ||
            { echo "error: the target did not start: $(tail -n 3 "$tmp/t0.err")" >&2; return 1; }
        ports+=("${seg##*:}")
        for k in $(seq 0 $((n - 1))); do
            # shellcheck disable=SC2086 # $LIGHT is NAME=value words
            "${PEER_RUN[@]}" env FERRY_PLUGIN_PATH="$plugins" $LIGHT FERRY_TCP_FRAME_BYTES=$FRAME_BYTES \
                "$init" "${init_args[@]}" --segments "$seg" --batch-size 64 --threads 1 \
                > "$tmp/i$k.out" 2> "$tmp/i$k.err" &
            PIDS+=("$!"); IPIDS+=("$!"); PEER_PIDS+=("$!")
            if [ $(((k + 1) % SCALE_WAVE)) = 0 ] && [ $((k + 1)) -lt "$n" ]; then
                wait_ready $((k + 1)) > /dev/null || { stop_all; return 1; }
            fi
        done
        registered=$(( $(echo "$TARGET_BUFFER" | tr -d M) * 1024 ))
    else
        local segs=() tpids=()
        for k in $(seq 0 $((n - 1))); do
            # shellcheck disable=SC2086 # $LIGHT is NAME=value words
            "${PEER_RUN[@]}" env FERRY_PLUGIN_PATH="$plugins" $LIGHT \
                "$ferry" bench target --buffer-size "$PEER_BUFFER" > "$tmp/t$k.out" 2> "$tmp/t$k.err" &
            PIDS+=("$!"); tpids+=("$!"); PEER_PIDS+=("$!")
        done
        for k in $(seq 0 $((n - 1))); do
            seg=$(wait_segment "$tmp/t$k.out" "${tpids[$k]}") ||
                { echo "error: target $k did not start: $(tail -n 3 "$tmp/t$k.err")" >&2; return 1; }
            segs+=("$seg"); ports+=("${seg##*:}")
        done
        FERRY_PLUGIN_PATH="$plugins" FERRY_TCP_FRAME_BYTES=$FRAME_BYTES \
            "$init" "${init_args[@]}" --segments "$(IFS=,; echo "${segs[*]}")" --batch-size 256 --threads 2 \
            > "$tmp/i0.out" 2> "$tmp/i0.err" &
        measured=$!; PIDS+=("$measured"); IPIDS+=("$measured")
        registered=$(( $(echo "$PEER_BUFFER" | tr -d M) * 1024 ))
    fi
    local nready
    nready=$(wait_ready "${#IPIDS[@]}") || { stop_all; return 1; }
    [ "$nready" -gt 0 ] || {
        echo "error: no initiator got going: $(tail -n 3 "$tmp/i0.err")" >&2; stop_all; return 1; }
    sleep 1
    m=$(measure "$measured" "${ports[@]}") || { stop_all; return 1; }
    stop_all
    bytes=0 served=0 refused=0 why=""
    if [ "$mode" = a ]; then
        for k in $(seq 0 $((n - 1))); do
            local j
            j=$(grep '^{' "$tmp/i$k.out" 2>/dev/null || true)
            if [ -n "$j" ] && [ "$(echo "$j" | json_field served)" = 1 ]; then
                served=$((served + 1))
                bytes=$((bytes + $(echo "$j" | json_field bytes)))
            else
                refused=$((refused + 1))
                [ -z "$why" ] && why=$(grep -v '^ ' "$tmp/i$k.err" | tail -n 1)
            fi
        done
    else
        local j
        j=$(grep '^{' "$tmp/i0.out" 2>/dev/null || true)
        [ -n "$j" ] || { echo "error: the initiator reported nothing: $(tail -n 3 "$tmp/i0.err")" >&2; return 1; }
        served=$(echo "$j" | json_field served)
        refused=$((n - served))
        bytes=$(echo "$j" | json_field bytes)
        [ "$refused" -gt 0 ] && why=$(grep 'not served' "$tmp/i0.err" | head -n 1)
    fi
    [ -n "$why" ] && echo "   refused, e.g.: $why" >&2
    # What the measured target logged as refused (its throttled lines
    # carry the counts since the previous line).
    local logged=0
    [ "$mode" = a ] && logged=$(sed -n 's/.*refused \([0-9][0-9]*\) connection.*/\1/p' "$tmp/t0.err" | awk '{ n += $1 } END { print n + 0 }')
    [ "$logged" -gt 0 ] && echo "   the target logged $logged refused connection(s): $(grep -m1 'refused' "$tmp/t0.err")" >&2
    read -r th fd rss cpu conns win peers_cpu busy <<< "$m"
    awk -v mode="$mode" -v n="$n" -v th="$th" -v fd="$fd" -v rss="$rss" -v cpu="$cpu" \
        -v conns="$conns" -v win="$win" -v bytes="$bytes" -v served="$served" -v refused="$refused" \
        -v reg="$registered" -v logged="$logged" -v pcpu="$peers_cpu" -v busy="$busy" 'BEGIN {
        gb = bytes / 1e9
        printf "{\"mode\":\"%s\",\"n\":%d,\"threads\":%d,\"fds\":%d,\"connections\":%d,\"rss_kib\":%d,", mode, n, th, fd, conns, rss
        printf "\"registered_kib\":%d,\"cpu_s\":%.3f,\"window_s\":%.3f,\"bytes\":%.0f,", reg, cpu, win, bytes
        printf "\"gb_per_s\":%.4f,\"cpu_s_per_gb\":%s,\"served\":%d,\"refused\":%d,", gb / win, (gb > 0 ? sprintf("%.4f", cpu / gb) : "null"), served, refused
        printf "\"refusals_logged\":%d,\"peers_cpu_s\":%.3f,\"machine_busy_cores\":%.2f}\n", logged, pcpu, busy
    }' >> "$tmp/points-$label.jsonl"
}

# finish LABEL FERRY PLUGINS: RSS per connection against each mode's first
# point, the table rows, and the result file.
finish() {
    local label=$1 ferry=$2 plugins=$3 file=$OUT/$STAMP-$1.json
    [ -s "$tmp/points-$label.jsonl" ] || return 0
    local commit
    commit=$(git rev-parse --short HEAD 2>/dev/null || echo unknown)
    awk '
        function f(name,   m) { if (match($0, "\"" name "\":[^,}]*")) return substr($0, RSTART + length(name) + 3, RLENGTH - length(name) - 3); return "" }
        {
            mode = f("mode"); gsub(/"/, "", mode)
            rss = f("rss_kib") + 0; conns = f("connections") + 0; reg = f("registered_kib") + 0
            if (!(mode in base_rss)) { base_rss[mode] = rss; base_conns[mode] = conns }
            per = (conns > base_conns[mode]) ? sprintf("%.1f", (rss - base_rss[mode]) / (conns - base_conns[mode])) : "null"
            beyond = (conns > 0) ? sprintf("%.1f", (rss - reg) / conns) : "null"
            sub(/}$/, ",\"rss_per_conn_kib\":" per ",\"rss_beyond_registered_per_conn_kib\":" beyond "}")
            print
        }' "$tmp/points-$label.jsonl" > "$tmp/points-$label.final"
    {
        printf '{"label":"%s","ferry":"%s","plugins":"%s","initiator":"%s","commit":"%s","date":"%s",' \
            "$label" "$ferry" "$plugins" "$(initiator_of "$ferry")" "$commit" "$STAMP"
        printf '"op":"%s","block_size":65536,"connections_per_peer":%d,"frame_bytes":1048576,"window_s":%s,"cores":%d,' \
            "$SCALE_OP" "$CONNECTIONS" "$SCALE_DURATION" "$CORES"
        printf '"load_average":"%s","caps":"%s","points":[' "$(cut -d' ' -f1-3 /proc/loadavg)" "$CAPS_NOTE"
        paste -sd, "$tmp/points-$label.final"
        printf ']}\n'
    } > "$file"
    echo "$file"
}

table() { # LABEL...
    echo
    echo "$CAPS_NOTE"
    echo "$CORES cores, $SCALE_OP of 64 KiB blocks, window $SCALE_DURATION s; load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
    echo
    echo "| build | mode | N | threads | fds | data conns | RSS MiB | RSS/conn KiB (vs first N) | (RSS - registered)/conn KiB | CPU s/GB | GB/s | served / refused | cores: measured / peers / machine |"
    echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
    local label
    for label in "$@"; do
        [ -s "$tmp/points-$label.final" ] || continue
        awk -v label="$label" '
            function f(name) { if (match($0, "\"" name "\":[^,}]*")) return substr($0, RSTART + length(name) + 3, RLENGTH - length(name) - 3); return "" }
            {
                mode = f("mode"); gsub(/"/, "", mode)
                printf "| %s | %s | %s | %s | %s | %s | %.1f | %s | %s | %s | %.3f | %s / %s | %.2f / %.2f / %s |\n", label, mode, f("n"), f("threads"), f("fds"),
                    f("connections"), f("rss_kib") / 1024, (f("rss_per_conn_kib") == "null" ? "-" : f("rss_per_conn_kib")),
                    f("rss_beyond_registered_per_conn_kib"), (f("cpu_s_per_gb") == "null" ? "-" : f("cpu_s_per_gb")), f("gb_per_s"),
                    f("served"), f("refused") (f("refusals_logged") > 0 ? " (" f("refusals_logged") " logged)" : ""),
                    f("cpu_s") / f("window_s"), f("peers_cpu_s") / f("window_s"), f("machine_busy_cores")
            }' "$tmp/points-$label.final"
    done
}

MODES=$MODE
case "$MODE" in both|ab) MODES="a b" ;; esac
echo "$CAPS_NOTE" >&2
# Plugins are probed once per build before the sweep, so N engines
# starting at once read the probe cache instead of each probing.
for b in "${BUILDS[@]}"; do
    read -r label f d <<< "$b"
    FERRY_PLUGIN_PATH="$d" "$f" info > /dev/null 2>&1 || true
    [ "$(initiator_of "$f")" = "$f" ] || echo "note: $label's ferry has no scale-initiator: its runs use $DRIVER with $label's plugins" >&2
done
for mode in $MODES; do
    for n in $SCALE_N; do
        for b in "${BUILDS[@]}"; do
            read -r label f d <<< "$b"
            point "$mode" "$n" "$label" "$f" "$d" ||
                echo "warning: $label, mode $mode, N = $n: no figure (above: why)" >&2
        done
    done
done
files=()
labels=()
for b in "${BUILDS[@]}"; do
    read -r label f d <<< "$b"
    file=$(finish "$label" "$f" "$d")
    [ -n "$file" ] && files+=("$file") && labels+=("$label")
done
[ ${#files[@]} -gt 0 ] || { echo "error: no point was measured" >&2; exit 1; }
table "${labels[@]}"
echo
printf 'results: %s\n' "${files[@]}"
"$DRIVER" bench scale-plot --out "$OUT/$STAMP" "${files[@]}" | sed 's/^/plot: /'
