#!/usr/bin/env bash
# Soak: mixed writes and reads with verification between two engines in two
# processes for DURATION seconds (default 600), over tcp (or shm with
# --shm). Prints throughput every INTERVAL seconds (default 10: elapsed, GB
# moved, GB/s in the interval, requests, errors, both processes' RSS), RSS
# at start and end, and the totals: bytes moved, bytes written and verified
# by read-back, checks in the target's own memory, failures. Exits non-zero
# on any failure. Not in CI (scripts/test); the driver is
# tests/src/bin/ferry-soak.rs.
#
#   scripts/soak.sh [DURATION] [--shm] [--threads N]
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/common.sh
ensure_base

DURATION=600
ARGS=()
while [ $# -gt 0 ]; do
    case $1 in
        --shm) ARGS+=(--transport shm) ;;
        --threads) ARGS+=(--threads "$2"); shift ;;
        [0-9]*) DURATION=$1 ;;
        *) echo "usage: $0 [DURATION] [--shm] [--threads N]" >&2; exit 2 ;;
    esac
    shift
done
cargo build --release --workspace --locked -q
exec target/release/ferry-soak --duration "$DURATION" --interval "${INTERVAL:-10}" "${ARGS[@]}"
