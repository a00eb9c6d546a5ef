#!/usr/bin/env bash
# Builds the one Ferry artifact every node gets:
#
#   dist/ferry-<version>-linux-<arch>.tar.gz   (and its .sha256)
#
# bin/ferry, lib/libferry.so and .a, every plugin of the workspace
# (lib/ferry/plugins/libferry_{transport,device}_*.so; test-only plugins are
# not shipped), the plugin probe helper (lib/ferry/ferry-probe, where the
# loader looks for it, beside the plugins), the headers, pkg-config and CMake files, the C examples, the
# plugin kit, README, LICENSE and manifest.json. Built with cargo-zigbuild
# against glibc 2.28 and checked for that floor; layout and reasons in
# docs/packaging.md.
#
#   packaging/build.sh [--profile dist|release|dev] [--glibc 2.28] [--out DIR]
#
# Prints the tarball's path and nothing else on success; the build log on
# failure. Installs what it needs when missing (apt-get; cargo-zigbuild and
# zig from PyPI into target/tools). Exit status 3: those tools cannot be
# installed here (no PyPI), which callers may treat as "cannot package".
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib/common.sh

profile=dist
glibc=2.28
out_dir=$PWD/dist
while [ $# -gt 0 ]; do
    case "$1" in
        --profile) profile=${2:?--profile needs a name}; shift 2 ;;
        --glibc) glibc=${2:?--glibc needs a version}; shift 2 ;;
        --out) out_dir=${2:?--out needs a directory}; shift 2 ;;
        -h|--help) sed -n '2,18p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "error: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
done

die() { echo "error: $*" >&2; exit 1; }

ensure_base
ensure_commands readelf:binutils objdump:binutils strip:binutils tar:tar gzip:gzip python3:python3
ensure_zigbuild || exit 3

version=$(sed -n '/^\[workspace\.package\]/,/^\[/ s/^version *= *"\([^"]*\)".*/\1/p' Cargo.toml)
[ -n "$version" ] || die "no version in Cargo.toml's [workspace.package]"
arch=$(uname -m)
triple=$arch-unknown-linux-gnu
name=ferry-$version-linux-$arch
work=$PWD/target/packaging
stage=$work/$name
mkdir -p "$work" "$out_dir"
log=$work/build.log

# 1. Build the whole workspace for the glibc floor. cargo's JSON messages
# name the files this build produced, so a stale plugin left in target/ by
# another branch is never shipped.
# bindgen (the rdma plugin's rdma-mummy-sys generates verbs bindings from
# headers) runs libclang, which under zig's wrappers does not search the
# system include directories; the bindings are declarations only, the same
# for any glibc, so the build machine's headers are right.
multiarch=$(gcc -print-multiarch 2>/dev/null || echo "$arch-linux-gnu")
# libclang's own headers (stddef.h) come first, as clang would put them.
clang_include=$(ls -d /usr/lib/llvm-*/lib/clang/*/include 2>/dev/null | sort -V | tail -1 || true)
export BINDGEN_EXTRA_CLANG_ARGS="${BINDGEN_EXTRA_CLANG_ARGS:-}${clang_include:+ -isystem $clang_include} -isystem /usr/include/$multiarch -isystem /usr/include"
if ! cargo zigbuild --profile "$profile" --locked --workspace --target "$triple.$glibc" \
    --message-format=json-render-diagnostics > "$work/artifacts.json" 2> "$log"; then
    cat "$log" >&2
    die "cargo zigbuild failed (log above, also in $log)"
fi
mapfile -t artifacts < <(python3 -c '
import json, sys
for line in open(sys.argv[1]):
    if not line.startswith("{"):
        continue
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact":
        print("\n".join(m.get("filenames") or []))
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["executable"])
' "$work/artifacts.json" | sort -u)

pick() { # NAME-GLOB: the built artifacts whose file name matches
    local a
    for a in "${artifacts[@]}"; do
        # shellcheck disable=SC2053 # $1 is a glob on purpose
        [[ "$(basename "$a")" == $1 ]] && echo "$a"
    done
    return 0
}
one() { # NAME: exactly one built artifact of that name
    local found
    found=$(pick "$1")
    [ -n "$found" ] && [ "$(wc -l <<<"$found")" -eq 1 ] || die "the build produced no single $1 (got: ${found:-nothing})"
    echo "$found"
}

# 2. Lay out the prefix.
rm -rf "$stage"
mkdir -p "$stage"/{bin,lib/ferry/plugins,lib/pkgconfig,lib/cmake/ferry,include/ferry} \
    "$stage"/share/ferry/{examples/c,plugin-kit} "$stage"/share/doc/ferry
install -m 0755 "$(one ferry)" "$stage/bin/ferry"
install -m 0755 "$(one libferry.so)" "$stage/lib/libferry.so"
install -m 0644 "$(one libferry.a)" "$stage/lib/libferry.a"
# The static library carries the Rust standard library's debug info.
strip --strip-debug "$stage/lib/libferry.a"

# Plugins are first loaded and probed in this child process (docs/plugins.md).
install -m 0755 "$(one ferry-probe)" "$stage/lib/ferry/ferry-probe"

mapfile -t plugins < <(pick 'libferry_transport_*.so'; pick 'libferry_device_*.so')
[ ${#plugins[@]} -gt 0 ] || die "the build produced no plugin (libferry_transport_*.so, libferry_device_*.so)"
for so in "${plugins[@]}"; do
    install -m 0755 "$so" "$stage/lib/ferry/plugins/"
done

install -m 0644 capi/include/ferry.h "$stage/include/ferry.h"
install -m 0644 plugins-abi/include/ferry/plugin.h "$stage/include/ferry/plugin.h"
# Paths in ferry.pc are relative to the file itself: the prefix may move.
sed -e 's|@PREFIX@|${pcfiledir}/../..|' -e 's|@LIBDIR@|${prefix}/lib|' \
    -e 's|@INCLUDEDIR@|${prefix}/include|' -e "s|@VERSION@|$version|" \
    capi/ferry.pc.in | grep -v '^# ' > "$stage/lib/pkgconfig/ferry.pc"
for f in ferry-config ferry-config-version; do
    sed "s|@VERSION@|$version|g" "packaging/cmake/$f.cmake.in" > "$stage/lib/cmake/ferry/$f.cmake"
done
install -m 0644 examples/c/*.c examples/c/*.h examples/c/CMakeLists.txt "$stage/share/ferry/examples/c/"
install -m 0644 examples/c-plugin/memcpy_transport.c examples/c-plugin/Makefile \
    examples/c-plugin/README.md "$stage/share/ferry/plugin-kit/"
install -m 0644 docs/*.md "$stage/share/doc/ferry/"
sed -e "s|@VERSION@|$version|g" -e "s|@ARCH@|$arch|g" packaging/README.dist.md > "$stage/README.md"
install -m 0644 LICENSE "$stage/LICENSE"

# 3. The glibc floor of every shipped ELF file.
packaging/check-glibc.sh --floor "$glibc" "$stage" > /dev/null ||
    die "a shipped file needs a glibc newer than $glibc (packaging/check-glibc.sh $stage says which)"
packaging/check-glibc.sh --floor "$glibc" --tsv "$stage" > "$work/glibc.tsv"

# 4. The manifest, from what the staged ferry itself finds, with a clean
# environment: exactly the plugins beside its library.
env -i PATH=/usr/bin:/bin "$stage/bin/ferry" info --json > "$work/info.json" 2> "$log" || {
    cat "$log" >&2
    die "$stage/bin/ferry info failed"
}
commit=$(git rev-parse HEAD 2>/dev/null || echo unknown)
dirty=()
[ -z "$(git status --porcelain 2>/dev/null)" ] || dirty=(--dirty)
python3 packaging/manifest.py --stage "$stage" --info "$work/info.json" --glibc "$work/glibc.tsv" \
    --version "$version" --target "$triple" --glibc-floor "$glibc" --profile "$profile" \
    --commit "$commit" "${dirty[@]}" > "$work/manifest.json" || die "cannot write the manifest"
install -m 0644 "$work/manifest.json" "$stage/manifest.json"

# 5. The archive: sorted, owned by root, dated by the commit, so the same
# source gives the same bytes.
epoch=$(git log -1 --format=%ct 2>/dev/null || echo 0)
tarball=$out_dir/$name.tar.gz
tar --sort=name --owner=0 --group=0 --numeric-owner --mtime="@$epoch" \
    -C "$work" -cf - "$name" | gzip -n > "$tarball.tmp"
mv "$tarball.tmp" "$tarball"
(cd "$out_dir" && sha256sum "$name.tar.gz" > "$name.tar.gz.sha256")
echo "$tarball"
