#!/usr/bin/env bash
# The one device run, in two parts that each fit a device command's limit
# (10 minutes), on the prefix tests/gpu/prepare.sh assembled (default .gpu):
#
#   bash tests/gpu/all.sh .gpu gpu     # tests/gpu/run.sh (every GPU check,
#                                      # cuda-ipc included) and a GPU sweep
#   bash tests/gpu/all.sh .gpu bench   # host memory on this machine's cores:
#                                      # scripts/bench-shm.sh, scripts/bench-auto.sh
#   bash tests/gpu/all.sh .gpu metrics # metrics on against off, tcp and shm;
#                                      # BASELINE=path/to/another/ferry takes
#                                      # turns with it in the same run
#   bash tests/gpu/all.sh DIR scale    # issue 32 on this machine's cores:
#                                      # scripts/scale.sh ab and scripts/ab.sh
#                                      # (tcp, shm), DIR/old against DIR/new,
#                                      # each a folder with ferry, ferry-probe
#                                      # and the tcp and shm plugins
#                                      # (tests/gpu/prepare-scale.sh OLD_COMMIT)
#   bash tests/gpu/all.sh .gpu nixl    # tests/gpu/nixl.sh: NIXL's API and vLLM's
#                                      # NixlConnector on cuda:0, Ferry beside
#                                      # the real NIXL (needs tests/gpu/nixl-prepare.sh)
#
# Everything is printed; what the checks and benchmarks write goes into one
# tarball under $OUT (the device tool brings back few files), and the
# summaries beside it.
set -uo pipefail
cd "$(dirname "$0")/../.."
P=${1:-.gpu}
PART=${2:-gpu}
DEST=${OUT:-$(mktemp -d)}
W=$(mktemp -d)
B=$P/bin/ferry
export FERRY_PLUGIN_CACHE=off
status=0
case $PART in
gpu)
    OUT=$W DURATION=${DURATION:-2} bash tests/gpu/run.sh "$P" 2>&1 | tee "$W/run.log"
    status=${PIPESTATUS[0]}
    printf '\n===== ferry bench sweep (host and cuda:0 memory, same-run limits)\n'
    timeout 150 "$B" bench sweep --out "$W/sweep" --blocks 4K,64K,1M,16M --duration 0.5 --device cuda:0 2>&1 | tail -40
    cp "$W/run.log" "$DEST/gpu-run.log"
    ;;
bench)
    # bench-shm.sh takes ferry and the two plugins from one folder.
    mkdir -p "$W/bin"
    ln -s "$PWD/$B" "$W/bin/ferry"
    ln -s "$PWD/$P/lib/ferry/plugins/libferry_transport_shm.so" "$PWD/$P/lib/ferry/plugins/libferry_transport_tcp.so" "$W/bin/"
    printf '\n===== scripts/bench-shm.sh\n'
    FERRY_BIN_DIR=$W/bin RUNS=${RUNS:-3} DURATION=${DURATION:-2} scripts/bench-shm.sh --json --no-build 2>&1 | tee "$W/bench-shm.log"
    status=${PIPESTATUS[0]}
    cp target/bench-shm-summary.json "$DEST/" 2>/dev/null
    cp target/bench-shm.jsonl "$W/" 2>/dev/null
    printf '\n===== scripts/bench-auto.sh (no FERRY_TRANSPORTS: the automatic choice, against each transport forced)\n'
    TRANSPORTS="shm tcp" FERRY_BIN=$B RUNS=${RUNS:-3} DURATION=${DURATION:-2} scripts/bench-auto.sh --no-build 2>"$W/bench-auto.err" | tee "$W/bench-auto.txt"
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
    cp "$W/bench-auto.txt" "$DEST/"
    cp target/bench-auto.jsonl "$W/" 2>/dev/null
    ;;
metrics)
    for run in 1 2; do
        for b in ${BASELINE:-} "$B"; do
            printf '\n===== %s bench metrics-overhead (run %s)\n' "$b" "$run"
            timeout 280 "$b" bench metrics-overhead --rounds "${ROUNDS:-20}" --duration "${DURATION:-0.2}" 2>&1 | tee -a "$W/metrics-overhead.log"
            [ "${PIPESTATUS[0]}" = 0 ] || status=1
        done
    done
    ;;
scale)
    printf '\n===== scripts/scale.sh ab (old %s, new %s), SCALE_N=%s\n' "$(cat "$P/old/commit" 2>/dev/null)" "$(cat "$P/new/commit" 2>/dev/null)" "${SCALE_N:=1 16 256}"
    SCALE_N=$SCALE_N timeout "${SCALE_TIMEOUT:-420}" scripts/scale.sh ab "$P/old" "$P/new" 2>&1 | tee "$W/scale.log"
    status=${PIPESTATUS[0]}
    cp -r target/scale "$W/" 2>/dev/null
    for t in ${AB_TRANSPORTS:-tcp shm}; do
        printf '\n===== scripts/ab.sh, %s, one peer (old, new taking turns)\n' "$t"
        AB_TRANSPORT=$t AB_ROUNDS=${AB_ROUNDS:-5} scripts/ab.sh "$P/old" "$P/new" 2>&1 | tee -a "$W/ab.log"
        [ "${PIPESTATUS[0]}" = 0 ] || status=1
    done
    ;;
nixl)
    OUT=$W bash tests/gpu/nixl.sh "$P" 2>&1 | tee "$W/nixl.log"
    status=${PIPESTATUS[0]}
    cp "$W/nixl.log" "$DEST/gpu-nixl.log"
    ;;
*) echo "all.sh: part is gpu, bench, metrics, scale or nixl" >&2; exit 2 ;;
esac
tar -czf "$DEST/gpu-$PART-files.tgz" -C "$W" . 2>/dev/null
exit "$status"
