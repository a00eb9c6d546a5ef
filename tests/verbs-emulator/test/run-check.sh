#!/bin/sh
# Runs the C two-process test against the emulator in <build dir>, with a
# private fabric directory and the DGX config. Bounded: 120 s.
set -eu
here=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$here/build}" && pwd)
tmp=$(mktemp -d "${TMPDIR:-/tmp}/ferry-verbs-check.XXXXXX")
trap 'rm -rf "$tmp"' EXIT INT TERM
export FERRY_VERBS_EMU_CONFIG="$here/dgx-h100.conf"
export FERRY_VERBS_EMU_DIR="$tmp/fabric"
export VERBS_TEST_TMP="$tmp"
unset FERRY_VERBS_EMU_FAULTS FERRY_SYSFS_ROOT
export LD_LIBRARY_PATH="$build${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
timeout 120 "$build/verbs_emu_test"
left=$(find "$tmp/fabric" -type f -o -type p 2>/dev/null | grep -v '/ctx/' || true)
echo "fabric entries left behind by the crashed target (stale, swept by the next opener):"
echo "${left:-  none}" | sed 's/^/  /'
