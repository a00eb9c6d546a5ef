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
# build: it is loaded at run time. protoc: the etcd client compiles its
# protocol at build time.
ensure_base() {
    ensure_commands cc:gcc pkg-config:pkg-config make:make cmake:cmake readelf:binutils \
        protoc:protobuf-compiler
    ensure_files /usr/include/stdio.h:libc6-dev
    if ! compgen -G '/usr/lib/llvm-*/lib/libclang*.so*' >/dev/null \
        && ! compgen -G '/usr/lib/*/libclang*.so*' >/dev/null; then
        apt_install libclang-dev
    fi
}
