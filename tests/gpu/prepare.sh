#!/usr/bin/env bash
# Builds the release binaries on this (development) machine and lays them out
# in .gpu/ (git-ignored) as an install prefix: bin/ferry and
# lib/ferry/plugins/*.so, and the Python wheel in wheels/. The GPU machine has
# no Rust toolchain: this folder travels there (the device tool's `carry`) and
# tests/gpu/run.sh uses it.
set -euo pipefail
cd "$(dirname "$0")/../.."
# Keep .gpu/ out of git (works in a linked worktree too, where .git is a file).
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"
# What a fresh machine lacks for the workspace (cmake and libclang for the
# rdma plugin's sideway, a C compiler), as scripts/test installs it.
. scripts/lib/common.sh
ensure_base
cargo build --release --workspace --locked -q
cargo build --release --locked -q -p ferry-device-cuda --example cuda_check
# The verbs emulator (test-only libibverbs.so.1): run.sh points the rdma
# plugin at emulated NICs with it to register real GPU memory by DMA-BUF.
make -s -C tests/verbs-emulator
rm -rf .gpu
mkdir -p .gpu/bin .gpu/lib/ferry/plugins .gpu/lib/verbs-emulator
cp target/release/ferry target/release/examples/cuda_check .gpu/bin/
for so in target/release/libferry_transport_*.so target/release/libferry_device_*.so; do
    [ -e "$so" ] && cp "$so" .gpu/lib/ferry/plugins/
done
# What the memory allows a scattered copy, by thread count (issue 30's host rows).
cc -O2 -mavx2 -pthread -o .gpu/bin/scatter-probe tests/gpu/scatter_probe.c
cp tests/verbs-emulator/build/libibverbs.so.1 tests/verbs-emulator/dgx-h100.conf .gpu/lib/verbs-emulator/
# Line tables are for debugging here, not there: the folder must travel small.
strip --strip-debug .gpu/bin/* .gpu/lib/ferry/plugins/*.so
# The Python wheel (plugins inside, no debug info); run.sh installs it beside torch.
packaging/wheel.sh --out .gpu/wheels >/dev/null
ls -l .gpu/bin .gpu/lib/ferry/plugins .gpu/lib/verbs-emulator .gpu/wheels
