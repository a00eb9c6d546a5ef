#!/usr/bin/env bash
# Builds Ferry's Python wheel (python/): one abi3 wheel for CPython 3.9+,
# with the native module and every transport and device plugin inside it
# (ferry/lib/ferry/plugins, where the loader looks beside the module: no
# environment variable needed once installed), and the plugin probe helper
# beside them (ferry/lib/ferry/ferry-probe).
#
#   packaging/wheel.sh [--dev] [--glibc 2.28] [--out DIR]
#
# By default it is built like the tarball (packaging/build.sh): the `dist`
# profile (no debug info), linked by zig against glibc 2.28, tagged
# manylinux_2_28 and checked for that floor (packaging/check-glibc.sh). When
# zig cannot be installed (no PyPI) it builds natively instead and says so.
# --dev: the dev profile, native (scripts/test; reuses `cargo build`).
# Natively built wheels are tagged for the newest GLIBC_2.N that the module or
# any plugin needs, so pip refuses them where a plugin could not load.
#
# maturin comes from a virtual environment under target/ (target/pyenv,
# created and filled with pip when missing; PYTHON picks the interpreter).
# Prints the wheel's path.
set -euo pipefail
caller=$PWD
cd "$(dirname "$0")/.."
. scripts/lib/common.sh

profile=dist
glibc=2.28
out=
zig=1
while [ $# -gt 0 ]; do
    case "$1" in
        --dev) profile=dev; zig=0 ;;
        --glibc) glibc=${2:?--glibc needs a version}; shift ;;
        --out) out=${2:?--out needs a directory}; shift ;;
        -h|--help) sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "usage: packaging/wheel.sh [--dev] [--glibc 2.28] [--out DIR]" >&2; exit 2 ;;
    esac
    shift
done

# maturin runs in python/: --out made absolute (a relative one is from where
# this script was called; the default, dist, is the repository's).
case $out in "") out=$PWD/dist ;; /*) ;; *) out=$caller/$out ;; esac

venv=target/pyenv
if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
fi
if ! "$venv/bin/maturin" --version >/dev/null 2>&1; then
    "$venv/bin/python" -m pip install -q 'maturin>=1.5,<2'
fi
maturin=$PWD/$venv/bin/maturin

# The plugins: every package whose library is libferry_transport_* or
# libferry_device_* (test-only plugins are libferry_test_*).
plugins=$(cargo metadata --no-deps --format-version 1 | "$venv/bin/python" -c '
import json, sys
for p in json.load(sys.stdin)["packages"]:
    for t in p["targets"]:
        if "cdylib" in t["kind"] and t["name"].startswith(("ferry_transport_", "ferry_device_")):
            print(p["name"], t["name"])')
pkgs=()
while read -r pkg _; do pkgs+=(-p "$pkg"); done <<< "$plugins"

triple=$(uname -m)-unknown-linux-gnu
if [ "$zig" = 1 ] && ! ensure_zigbuild; then
    echo "packaging/wheel.sh: zig is not available; building natively (the wheel's glibc floor is this machine's)" >&2
    zig=0
fi
if [ "$zig" = 1 ]; then
    # As packaging/build.sh: bindgen (the rdma plugin's verbs bindings) under
    # zig needs the system's include directories named.
    multiarch=$(gcc -print-multiarch 2>/dev/null || echo "$(uname -m)-linux-gnu")
    clang_include=$(ls -d /usr/lib/llvm-*/lib/clang/*/include 2>/dev/null | sort -V | tail -1 || true)
    export BINDGEN_EXTRA_CLANG_ARGS="${BINDGEN_EXTRA_CLANG_ARGS:-}${clang_include:+ -isystem $clang_include} -isystem /usr/include/$multiarch -isystem /usr/include"
    cargo zigbuild --locked -q --profile "$profile" --target "$triple.$glibc" "${pkgs[@]}"
    cargo zigbuild --locked -q --profile "$profile" --target "$triple.$glibc" -p ferry-loader --bin ferry-probe
    dir=target/$triple/$profile
    build_args=(--zig --target "$triple" --compatibility "manylinux_${glibc/./_}")
else
    cargo build --locked -q --profile "$profile" -p ferry-python "${pkgs[@]}"
    cargo build --locked -q --profile "$profile" -p ferry-loader --bin ferry-probe
    dir=target/$([ "$profile" = dev ] && echo debug || echo "$profile")
fi

stage=python/ferry/lib/ferry/plugins
rm -rf python/ferry/lib/ferry
mkdir -p "$stage"
while read -r _ lib; do cp "$dir/lib$lib.so" "$stage/"; done <<< "$plugins"
# Where the loader looks for it: <dir of the module>/../lib/ferry/ferry-probe.
install -m 0755 "$dir/ferry-probe" python/ferry/lib/ferry/ferry-probe

if [ "$zig" = 0 ]; then
    # manylinux_2_N for the newest GLIBC_2.N any of them needs (17 at least).
    need=17
    for so in "$dir/lib_ferry.so" "$stage"/*.so python/ferry/lib/ferry/ferry-probe; do
        n=$(objdump -T "$so" | grep -o 'GLIBC_2\.[0-9]*' | sed 's/GLIBC_2\.//' | sort -n | tail -1)
        [ -n "$n" ] && [ "$n" -gt "$need" ] && need=$n
    done
    glibc=2.$need
    build_args=(--compatibility "manylinux_2_$need")
fi

mkdir -p "$out"
rm -f "$out"/ferry-*.whl
(cd python && "$maturin" build --profile "$profile" "${build_args[@]}" --out "$out") >&2
wheel=$(ls "$out"/ferry-*.whl 2>/dev/null | head -1)
[ -n "$wheel" ] || { echo "packaging/wheel.sh: maturin made no wheel" >&2; exit 1; }

# Every ELF file inside within the floor the tag promises.
check=$(mktemp -d)
trap 'rm -rf "$check"' EXIT
"$venv/bin/python" -m zipfile -e "$wheel" "$check"
packaging/check-glibc.sh --floor "$glibc" "$check" >&2
echo "$wheel"
