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

apt_install() {
    local sudo=""
    if [ "$(id -u)" -ne 0 ]; then
        if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
            echo "error: need these packages and cannot install them without root: $*" >&2
            return 1
        fi
    fi
    echo "==> installing $* (apt-get)" >&2
    export DEBIAN_FRONTEND=noninteractive
    $sudo apt-get update -qq >&2
    $sudo apt-get install -y -qq --no-install-recommends "$@" >&2
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
# tests compile C plugins, examples and the verbs emulator), pkg-config, and
# what the RDMA plugin's sideway needs to build (rdma-mummy-sys runs cmake
# and bindgen, which loads libclang). libibverbs itself is never needed to
# build: it is loaded at run time.
ensure_base() {
    ensure_commands cc:gcc pkg-config:pkg-config make:make cmake:cmake readelf:binutils
    ensure_files /usr/include/stdio.h:libc6-dev
    if ! compgen -G '/usr/lib/llvm-*/lib/libclang*.so*' >/dev/null \
        && ! compgen -G '/usr/lib/*/libclang*.so*' >/dev/null; then
        apt_install libclang-dev
    fi
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
