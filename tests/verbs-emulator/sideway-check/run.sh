#!/bin/sh
# Builds sideway-check and runs it against the emulator in <build dir>
# (default ../build), with a private fabric directory and the DGX config.
#   run.sh [build-dir]         the full check
#   run.sh --real              `list` against the system's libibverbs.so.1
set -eu
here=$(cd "$(dirname "$0")" && pwd)
cargo build --release --quiet --manifest-path "$here/Cargo.toml"
bin="$here/target/release/sideway-check"
if [ "${1:-}" = "--real" ]; then
	exec timeout 60 "$bin" list
fi
build=$(cd "${1:-$here/../build}" && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/ferry-sideway-check.XXXXXX")
trap 'rm -rf "$tmp"' EXIT INT TERM
export FERRY_VERBS_EMU_CONFIG="$here/../dgx-h100.conf"
export FERRY_VERBS_EMU_DIR="$tmp/fabric"
unset FERRY_VERBS_EMU_FAULTS
export LD_LIBRARY_PATH="$build${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
timeout 120 "$bin"
