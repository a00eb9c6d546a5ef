#!/usr/bin/env bash
# The glibc floor of Ferry's artifact. For every ELF executable and shared
# object under the given paths (directories, files, or a .tar.gz to unpack),
# prints the highest GLIBC_ version it needs, read from its version-needs
# section (readelf -V: what the dynamic loader will demand at start), and
# fails when one needs more than the floor.
#
#   packaging/check-glibc.sh [--floor 2.28] [--tsv] PATH...
#
# The default floor, glibc 2.28, is that of manylinux_2_28 and RHEL 8;
# Ubuntu 20.04 (2.31) and newer are above it. --tsv prints "path<TAB>version"
# lines only (packaging/build.sh records them in the manifest).
set -euo pipefail

floor=2.28
tsv=0
paths=()
while [ $# -gt 0 ]; do
    case "$1" in
        --floor) floor=${2:?--floor needs a version}; shift 2 ;;
        --tsv) tsv=1; shift ;;
        -h|--help) sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        -*) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
        *) paths+=("$1"); shift ;;
    esac
done
[ ${#paths[@]} -gt 0 ] || { echo "usage: $0 [--floor 2.28] [--tsv] PATH..." >&2; exit 2; }
command -v readelf >/dev/null || { echo "error: readelf not found (Debian: apt-get install binutils)" >&2; exit 2; }

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# Expand the arguments into files, unpacking tarballs.
files=()
for p in "${paths[@]}"; do
    if [ -f "$p" ] && [[ "$p" == *.tar.gz || "$p" == *.tgz ]]; then
        d="$tmp/$(basename "$p")"
        mkdir -p "$d"
        tar -xzf "$p" -C "$d" || { echo "error: cannot unpack $p" >&2; exit 2; }
        p=$d
    fi
    if [ -d "$p" ]; then
        while IFS= read -r -d '' f; do files+=("$f"); done < <(find "$p" -type f -print0 | sort -z)
    elif [ -f "$p" ]; then
        files+=("$p")
    else
        echo "error: $p does not exist" >&2
        exit 2
    fi
done

# is_linked_elf FILE: an ELF executable or shared object (not an archive or
# an object file, whose symbols are bound when someone else links them).
is_linked_elf() {
    [ "$(head -c 4 "$1" | od -An -c | tr -d ' ')" = '177ELF' ] || return 1
    readelf -h "$1" 2>/dev/null | grep -qE 'Type:[[:space:]]+(EXEC|DYN)'
}

# highest_glibc FILE: the highest GLIBC_x.y among the versions the file needs
# ("none" when it needs no versioned glibc symbol).
highest_glibc() {
    readelf -V --wide "$1" 2>/dev/null | awk '
        /^Version needs section/ { need = 1; next }
        /^Version (definition|symbols) section/ { need = 0 }
        need && match($0, /Name: GLIBC_[0-9.]+/) { print substr($0, RSTART + 12, RLENGTH - 12) }
    ' | sort -uV | tail -n 1 | grep . || echo none
}

above_floor() { # VERSION: true when VERSION > floor
    [ "$1" != none ] && [ "$1" != "$floor" ] &&
        [ "$(printf '%s\n%s\n' "$1" "$floor" | sort -V | tail -n 1)" = "$1" ]
}

checked=0
bad=()
for f in "${files[@]}"; do
    is_linked_elf "$f" || continue
    checked=$((checked + 1))
    v=$(highest_glibc "$f")
    name=${f#"$tmp"/*/}
    if [ "$tsv" = 1 ]; then
        printf '%s\t%s\n' "$name" "$v"
    else
        printf '  %-12s %s\n' "GLIBC_$v" "$name"
    fi
    if above_floor "$v"; then bad+=("$f"); fi
done

if [ "$checked" -eq 0 ]; then
    echo "error: no ELF executable or shared object under ${paths[*]}" >&2
    exit 1
fi
if [ ${#bad[@]} -gt 0 ]; then
    echo "error: ${#bad[@]} file(s) need a glibc newer than $floor; they would not start on the oldest supported hosts:" >&2
    for f in "${bad[@]}"; do
        echo "  ${f#"$tmp"/*/} needs these symbols:" >&2
        objdump -T "$f" 2>/dev/null |
            awk 'match($0, /GLIBC_[0-9.]+/) { print substr($0, RSTART + 6, RLENGTH - 6), $NF }' |
            sort -uV | while read -r ver sym; do
                if above_floor "$ver"; then echo "    GLIBC_$ver  $sym" >&2; fi
            done
    done
    echo "Build with packaging/build.sh (cargo-zigbuild against glibc $floor), not plain cargo." >&2
    exit 1
fi
[ "$tsv" = 1 ] || echo "  all $checked ELF file(s) need glibc <= $floor"
