#!/usr/bin/env bash
# Builds Ferry's Python wheel (python/): one abi3 wheel for CPython 3.9+,
# with the native module and every transport and device plugin inside it
# (ferry/lib/ferry/plugins, where the loader looks beside the module: no
# environment variable needed once installed).
#
#   packaging/wheel.sh [--dev] [--out DIR]
#
#   --dev      the dev profile (what `cargo build` made; scripts/test uses it)
#   --out DIR  where the wheel goes (default dist/)
#
# maturin comes from a virtual environment under target/ (target/pyenv,
# created and filled with pip when missing; PYTHON picks the interpreter).
# The wheel's manylinux tag is the newest glibc symbol version that the
# module or any plugin needs, so pip refuses it where a plugin could not load.
set -euo pipefail
cd "$(dirname "$0")/.."

profile=release
out=dist
while [ $# -gt 0 ]; do
    case "$1" in
        --dev) profile=dev ;;
        --out) out=$2; shift ;;
        *) echo "usage: packaging/wheel.sh [--dev] [--out DIR]" >&2; exit 2 ;;
    esac
    shift
done
dir=$([ "$profile" = dev ] && echo debug || echo release)

venv=target/pyenv
if [ ! -x "$venv/bin/python" ]; then
    "${PYTHON:-python3}" -m venv "$venv"
fi
if ! "$venv/bin/maturin" --version >/dev/null 2>&1; then
    "$venv/bin/python" -m pip install -q 'maturin>=1.5,<2'
fi

# The plugins: every package whose library is libferry_transport_* or
# libferry_device_* (test-only plugins are libferry_test_*).
plugins=$(cargo metadata --no-deps --format-version 1 | "$venv/bin/python" -c '
import json, sys
for p in json.load(sys.stdin)["packages"]:
    for t in p["targets"]:
        if "cdylib" in t["kind"] and t["name"].startswith(("ferry_transport_", "ferry_device_")):
            print(p["name"], t["name"])')
args=()
while read -r pkg _; do args+=(-p "$pkg"); done <<< "$plugins"
cargo build --locked -q --profile "$profile" -p ferry-python "${args[@]}"

stage=python/ferry/lib/ferry/plugins
rm -rf python/ferry/lib/ferry
mkdir -p "$stage"
while read -r _ lib; do cp "target/$dir/lib$lib.so" "$stage/"; done <<< "$plugins"
# Release wheels carry no debug info (the line tables are 90% of each file);
# the plugins keep their symbol names.
strip_args=()
if [ "$profile" = release ]; then
    strip_args=(--strip)
    command -v strip >/dev/null 2>&1 && strip --strip-debug "$stage"/*.so
fi

# manylinux_2_N for the newest GLIBC_2.N any of them needs (17 at least).
need=17
if command -v objdump >/dev/null 2>&1; then
    for so in "target/$dir/lib_ferry.so" "$stage"/*.so; do
        n=$(objdump -T "$so" | grep -o 'GLIBC_2\.[0-9]*' | sed 's/GLIBC_2\.//' | sort -n | tail -1)
        [ -n "$n" ] && [ "$n" -gt "$need" ] && need=$n
    done
fi

mkdir -p "$out"
rm -f "$out"/ferry-*.whl
(cd python && ../"$venv"/bin/maturin build --profile "$profile" "${strip_args[@]}" \
    --compatibility "manylinux_2_$need" --out "../$out")
wheel=$(ls "$out"/ferry-*.whl 2>/dev/null | head -1)
[ -n "$wheel" ] || { echo "packaging/wheel.sh: maturin made no wheel" >&2; exit 1; }
echo "$wheel"
