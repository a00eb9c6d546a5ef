#!/usr/bin/env bash
# A mixed cluster on this one machine: N hosts (default 8: 4 GPU hosts with
# InfiniBand and RoCE NICs, 2 CPU hosts with RoCE NICs, 2 TCP-only VMs),
# each a network + IPC namespace on a bridge with its own sysfs fixture, one
# etcd. Prints the all-to-all matrix (transport, NICs at each end, path
# class, GB/s, every byte verified, every cell checked against the rules),
# then a NIC failure, a host killed and restarted, etcd stopped for 10 s,
# the scale figures and two misconfigured hosts. Needs root (namespaces).
# Everything it creates is removed on exit, Ctrl-C included.
#
#   scripts/cluster-sim.sh [N]            release build, the whole run
#   scripts/cluster-sim.sh --short        N = 4, one fault (what scripts/test runs)
#
# Options after N are passed on (--cell BYTES). FERRY_CLUSTER_PROFILE=debug
# uses the debug build instead of building a release one. Every node's log
# (each decision at info) is kept in target/cluster-sim/logs
# (FERRY_CLUSTER_LOGS). Exit status 77:
# skipped (no namespaces here; the reason is printed).
# The driver is tests/src/bin/ferry-cluster/ (docs/cluster.md).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/common.sh
ensure_base
# Without them the driver says what is missing and exits 77 (skipped).
ensure_cluster_tools || true

ARGS=()
case "${1:-}" in
    --short) ARGS+=(--short); shift ;;
    [0-9]*) ARGS+=(--hosts "$1"); shift ;;
esac
ARGS+=("$@")

PROFILE=${FERRY_CLUSTER_PROFILE:-release}
case $PROFILE in
    release) cargo build --release --workspace --locked -q ;;
    debug) cargo build --workspace --locked -q ;;
    *) echo "FERRY_CLUSTER_PROFILE: release or debug" >&2; exit 2 ;;
esac
export FERRY_CLUSTER_LOGS=${FERRY_CLUSTER_LOGS:-target/cluster-sim/logs}
exec "target/$PROFILE/ferry-cluster" "${ARGS[@]}"
