# Shared by scripts/*: install what a fresh Debian machine with only the Rust
# toolchain lacks, once, and only when it is missing.

# ensure_commands CMD:PACKAGE ... installs PACKAGE (with apt-get) when CMD is
# not on PATH.
ensure_commands() {
    local missing=()
    for pair in "$@"; do
        local cmd=${pair%%:*} pkg=${pair#*:}
        command -v "$cmd" >/dev/null 2>&1 || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    apt_install "${missing[@]}"
}

# ensure_files PATH:PACKAGE ... installs PACKAGE when PATH does not exist.
ensure_files() {
    local missing=()
    for pair in "$@"; do
        local path=${pair%%:*} pkg=${pair#*:}
        [ -e "$path" ] || missing+=("$pkg")
    done
    [ ${#missing[@]} -eq 0 ] && return 0
    apt_install "${missing[@]}"
}

# as_root runs a command as root (directly, or through sudo).
as_root() {
    if [ "$(id -u)" -eq 0 ]; then "$@"; return; fi
    if ! command -v sudo >/dev/null 2>&1; then
        echo "error: need root (or sudo) to run: $*" >&2
        return 1
    fi
    sudo "$@"
}

# apt_update refreshes apt's lists once per script run.
apt_update() {
    [ -n "${FERRY_APT_UPDATED:-}" ] && return 0
    DEBIAN_FRONTEND=noninteractive as_root apt-get update -qq >&2 || return 1
    FERRY_APT_UPDATED=1
}

apt_install() {
    if [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null 2>&1; then
        echo "error: need these packages and cannot install them without root: $*" >&2
        return 1
    fi
    echo "==> installing $* (apt-get)" >&2
    apt_update
    # dpkg's progress lines go nowhere; apt's and dpkg's errors stay on stderr.
    DEBIAN_FRONTEND=noninteractive as_root apt-get install -y -qq --no-install-recommends "$@" >/dev/null
}

# ensure_rust_components COMPONENT ... (clippy, rustfmt)
ensure_rust_components() {
    local c
    for c in "$@"; do
        case "$c" in
            clippy) cargo clippy --version >/dev/null 2>&1 && continue ;;
            rustfmt) cargo fmt --version >/dev/null 2>&1 && continue ;;
        esac
        echo "==> rustup component add $c" >&2
        rustup component add "$c" >&2
    done
}

# The base every script needs: a C compiler and linker (cargo links with cc,
# tests compile C plugins, examples and the verbs emulator), pkg-config, CA
# certificates (cargo and pip fetch over HTTPS; a minimal Debian has none),
# and what the RDMA plugin's sideway needs to build (rdma-mummy-sys runs
# cmake and bindgen, which loads libclang). libibverbs itself is never
# needed to build: it is loaded at run time.
ensure_base() {
    ensure_commands cc:gcc pkg-config:pkg-config make:make cmake:cmake readelf:binutils
    ensure_files /usr/include/stdio.h:libc6-dev /etc/ssl/certs/ca-certificates.crt:ca-certificates
    ensure_libclang
}

# find_libclang prints the libclang that bindgen would load, if any. bindgen
# (default feature `runtime`) asks clang-sys, which looks in $LIBCLANG_PATH,
# else under /usr/local/llvm*/lib*, /usr/local/lib* and /usr/lib* (two
# levels down) for libclang.so, libclang-*.so, libclang.so.* or
# libclang-*.so.*, and skips libclang-cpp (a different library: the one a
# fresh image with llvm-N has, which a glob on libclang*.so* mistakes for
# libclang).
find_libclang() {
    local roots=(/usr/local /usr/lib /usr/lib32 /usr/lib64 /usr/libx32) depth=4
    [ -n "${LIBCLANG_PATH:-}" ] && { roots=("$LIBCLANG_PATH"); depth=1; }
    # find fails on a root that does not exist: not an error here.
    { find "${roots[@]}" -maxdepth "$depth" \( -type f -o -type l \) \
        \( -name libclang.so -o -name 'libclang-*.so' -o -name 'libclang.so.*' -o -name 'libclang-*.so.*' \) \
        ! -name '*-cpp.*' 2>/dev/null || true; } | sort -V | tail -1
}

# ensure_libclang installs libclang (libclang1-N) and clang's own headers
# (libclang-common-N-dev: stddef.h and friends, which bindgen's parse of the
# verbs headers includes) when either is missing; N is the version of
# Debian's libclang-dev, or of the libclang already there.
ensure_libclang() {
    local lib n
    lib=$(find_libclang)
    if [ -n "$lib" ] && compgen -G '/usr/lib/llvm-*/lib/clang/*/include/stddef.h' >/dev/null; then
        return 0
    fi
    n=$(basename "${lib:-none}" | sed -n 's/^libclang-\([0-9][0-9]*\)\..*/\1/p')
    if [ -z "$n" ]; then
        apt_update
        n=$({ apt-cache depends libclang-dev 2>/dev/null || true; } |
            sed -n 's/.*Depends: libclang-\([0-9][0-9]*\)-dev.*/\1/p' | head -1)
    fi
    if [ -n "$n" ]; then
        apt_install "libclang1-$n" "libclang-common-$n-dev"
    else
        apt_install libclang-dev
    fi
    [ -n "$(find_libclang)" ] || {
        echo "error: libclang is still missing after installing it; set LIBCLANG_PATH to the directory holding libclang.so" >&2
        return 1
    }
}

# The build tools of the release artifact (packaging/build.sh), from PyPI,
# pinned to the versions packaging was verified with: cargo-zigbuild links
# through zig, whose bundled glibc stubs let one build run on glibc 2.28.
FERRY_ZIGBUILD_VERSION=0.24.1
FERRY_ZIGLANG_VERSION=0.17.1

# ensure_zigbuild puts cargo-zigbuild and zig on PATH, installing them into a
# virtual environment under target/tools (FERRY_TOOLS_DIR) when missing.
# Returns 3 when they cannot be installed (no Python venv, no PyPI), so a
# caller can tell "cannot build here" from a broken build.
ensure_zigbuild() {
    local venv=${FERRY_TOOLS_DIR:-$PWD/target/tools}/zigbuild
    local want="cargo-zigbuild==$FERRY_ZIGBUILD_VERSION ziglang==$FERRY_ZIGLANG_VERSION"
    if [ "$(cat "$venv/.ferry-pins" 2>/dev/null)" != "$want" ]; then
        ensure_commands python3:python3
        rm -rf "$venv"
        if ! python3 -m venv "$venv" >/dev/null 2>&1; then
            apt_install python3-venv python3-pip || true
            python3 -m venv "$venv" >/dev/null 2>&1 || {
                echo "error: cannot create a Python virtual environment at $venv (python3 -m venv)" >&2
                return 3
            }
        fi
        echo "==> installing $want (pip, into $venv)" >&2
        # shellcheck disable=SC2086 # $want is two requirement words
        if ! "$venv/bin/python3" -m pip install -q $want >&2; then
            echo "error: cannot install $want from PyPI" >&2
            rm -rf "$venv"
            return 3
        fi
        echo "$want" > "$venv/.ferry-pins"
    fi
    # cargo-zigbuild finds zig as `python3 -m ziglang`: the venv's python3.
    export PATH="$venv/bin:$PATH"
}

# python3 able to make a virtual environment with pip (ensurepip; Debian
# splits it into python3-venv). The Python package's build and tests run in
# target/pyenv.
ensure_python_venv() {
    ensure_commands python3:python3
    python3 -c 'import venv, ensurepip' 2>/dev/null || apt_install python3-venv
}

# What the cluster simulation (scripts/cluster-sim.sh) runs besides the
# build: `ip` (iproute2) for namespaces, veth pairs and the bridge,
# `unshare`, `mount` and `hostname` (util-linux, hostname) for each host's
# IPC/UTS namespace and fixture, and a real etcd (etcd-server).
ensure_cluster_tools() {
    ensure_commands ip:iproute2 unshare:util-linux mount:mount hostname:hostname etcd:etcd-server
}

# ensure_mooncake installs Mooncake's own Python package (the reference the
# compatibility test python/tests/test_mooncake_compat.py compares Ferry
# with) into the venv whose python is $1. Its engine links libibverbs,
# librdmacm, libnuma and libcurl, so it needs them to import, even for tcp. Never fails: where it cannot be
# installed it says why, and the test is skipped with that reason
# (FERRY_MOONCAKE_SKIP).
FERRY_MOONCAKE_PACKAGE=mooncake-transfer-engine-non-cuda
ensure_mooncake() {
    local py=$1 err
    "$py" -c 'import mooncake.engine' 2>/dev/null && return 0
    if [ "$(uname -m)" != x86_64 ]; then
        export FERRY_MOONCAKE_SKIP="$FERRY_MOONCAKE_PACKAGE has wheels for x86_64 only"
    elif ! ensure_files /usr/lib/x86_64-linux-gnu/libibverbs.so.1:libibverbs1 \
        /usr/lib/x86_64-linux-gnu/librdmacm.so.1:librdmacm1 \
        /usr/lib/x86_64-linux-gnu/libnuma.so.1:libnuma1 \
        /usr/lib/x86_64-linux-gnu/libcurl.so.4:libcurl4; then
        export FERRY_MOONCAKE_SKIP="libibverbs1, librdmacm1, libnuma1 and libcurl4 (which $FERRY_MOONCAKE_PACKAGE needs to import) cannot be installed"
    elif ! "$py" -m pip install -q "$FERRY_MOONCAKE_PACKAGE" >&2; then
        export FERRY_MOONCAKE_SKIP="pip cannot install $FERRY_MOONCAKE_PACKAGE (no PyPI, or no wheel for this Python)"
    elif ! err=$("$py" -c 'import mooncake.engine' 2>&1); then
        export FERRY_MOONCAKE_SKIP="$FERRY_MOONCAKE_PACKAGE is installed but does not import: $(printf '%s' "$err" | tail -1)"
    fi
    [ -n "${FERRY_MOONCAKE_SKIP:-}" ] && echo "note: Mooncake's package is missing, its comparison will be skipped: $FERRY_MOONCAKE_SKIP" >&2
    return 0
}
