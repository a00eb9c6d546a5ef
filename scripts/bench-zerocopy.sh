#!/usr/bin/env bash
# Whether MSG_ZEROCOPY would make tcp's large sends faster on this machine:
# plain send() and send(MSG_ZEROCOPY) of 1 MiB and 16 MiB blocks over a
# loopback connection, taking turns, 3 rounds of 2 s each. Prints GB/s per
# round. Not a test: it never fails on a slow result.
#
# On loopback the kernel copies zero-copy pages anyway, and pays for the
# completion notifications on top (docs/benchmarks.md, "How cost grows").
set -euo pipefail
cd "$(dirname "$0")/.."
out=target/zerocopy
mkdir -p target
cc -O2 -pthread -o "$out" scripts/lib/zerocopy.c
for block in $((1 << 20)) $((16 << 20)); do
    "$out" "$block"
done
