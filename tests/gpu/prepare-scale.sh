#!/usr/bin/env bash
# Lays out two builds for `tests/gpu/all.sh DIR scale` (issue 32's A/B on a
# machine with cores for the peers): DIR/old from OLD_COMMIT (built in a
# scratch worktree) and DIR/new from this checkout, each a flat folder with
# ferry, ferry-probe and the tcp and shm plugins, stripped so both travel
# small (the device tool's carry). Usage:
#   tests/gpu/prepare-scale.sh OLD_COMMIT [DIR]    (DIR defaults to .gpu-scale)
set -euo pipefail
cd "$(dirname "$0")/../.."
[ $# -ge 1 ] || { echo "usage: tests/gpu/prepare-scale.sh OLD_COMMIT [DIR]" >&2; exit 2; }
old=$(git rev-parse --verify "$1^{commit}")
dir=${2:-.gpu-scale}
exclude=$(git rev-parse --git-path info/exclude)
grep -qx "/$dir/" "$exclude" 2>/dev/null || echo "/$dir/" >> "$exclude"
pkgs=(-p ferry-cli -p ferry-transport-tcp -p ferry-transport-shm -p ferry-loader)
layout() { # SRC_RELEASE_DIR DEST COMMIT
    rm -rf "$2" && mkdir -p "$2"
    cp "$1/ferry" "$1/ferry-probe" "$1"/libferry_transport_tcp.so "$1"/libferry_transport_shm.so "$2/"
    strip --strip-debug "$2"/*
    echo "$3" > "$2/commit"
}
cargo build --release --locked -q "${pkgs[@]}"
layout target/release "$dir/new" "$(git rev-parse --short HEAD)"
wt=${OLD_WORKTREE:-target/scale-old-worktree}
[ -d "$wt" ] || git worktree add --detach "$wt" "$old" >/dev/null
git -C "$wt" checkout -q --detach "$old"
(cd "$wt" && cargo build --release --locked -q "${pkgs[@]}")
layout "$wt/target/release" "$dir/old" "$(git rev-parse --short "$old")"
du -sh "$dir"/*
