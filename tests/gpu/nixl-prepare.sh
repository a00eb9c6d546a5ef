#!/usr/bin/env bash
# Assembles what tests/gpu/nixl.sh needs on the GPU machine, which has
# python3.12 with torch (CUDA 13), numpy, triton and transformers, no
# registry and at most 64 MiB carried in all, into .gpu/nixl/ (git-ignored,
# beside tests/gpu/prepare.sh's prefix):
#
#   site.tar.xz  vLLM 0.34.0's .py files (its 239 MB wheel is compiled code
#                the NixlConnector worker path never loads: vllm._C and
#                friends are stubbed, python/tests/clients/heavy_stubs.py)
#                and the small packages its import graph needs that the
#                machine lacks, cp312 wheels unpacked (nixl.sh puts them
#                after the machine's own packages on sys.path);
#   nixl.tar.xz  the real NIXL 1.5.1 for CUDA 13 (nixl, nixl-cu13), cut to
#                its Python API, core libraries and UCX plugin with the UCX
#                modules and every library they need (the storage and cloud
#                plugins' libraries left out), for the baseline beside Ferry.
#
#   bash tests/gpu/nixl-prepare.sh          # after tests/gpu/prepare.sh
#
# Downloads go to target/nixl-gpu/dl (pip's cache makes a rerun offline).
set -euo pipefail
cd "$(dirname "$0")/../.."
exclude=$(git rev-parse --git-path info/exclude)
mkdir -p "$(dirname "$exclude")"
grep -qx '/.gpu/' "$exclude" 2>/dev/null || echo '/.gpu/' >> "$exclude"

PY=3.12
VLLM=vllm==0.34.0
NIXL="nixl==1.5.1 nixl-cu13==1.5.1"
# What vLLM's NixlConnector path imports beyond torch, numpy, triton and
# transformers (and transformers' own dependencies: huggingface_hub,
# tokenizers, safetensors, regex, PyYAML, requests, tqdm, filelock,
# packaging, typing_extensions), pinned as python/tests/clients runs them
# (scripts/test-clients' venv, listed from its sys.modules).
DEPS="aiohappyeyeballs==2.7.1 aiohttp==3.14.5 aiosignal==1.4.0 annotated-doc==0.0.7 \
annotated-types==0.8.0 anyio==4.16.0 attrs==26.1.0 cachetools==8.0.2 cbor2==6.3.0 click==8.5.1 \
cloudpickle==3.1.3 einops==0.8.2 fastapi==0.165.0 frozenlist==1.8.0 h11==0.16.0 httpcore2==2.16.2 \
httpx2==2.16.2 llguidance==1.9.1 msgspec==0.23.0 multidict==7.2.1 opentelemetry-api==1.45.2 \
orjson==3.13.0 pillow==13.0.0 prometheus_client==0.24.1 propcache==0.5.4 psutil==7.2.2 \
py-cpuinfo==9.0.0 pybase64==1.5.1 pydantic==2.14.4 pydantic_core==2.50.5 pyzmq==27.3.0 \
sentencepiece==0.2.3 starlette==1.10.0 truststore==0.10.5 typing-inspection==0.4.5 uvicorn==0.55.0 \
uvloop==0.23.0 yarl==1.25.1 importlib_metadata zipp"

dl=target/nixl-gpu/dl
w=target/nixl-gpu/work
mkdir -p "$dl"
rm -rf "$w" .gpu/nixl
mkdir -p "$w/site" "$w/nixl" .gpu/nixl
pip_dl() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp \
        --abi "cp${PY/./}" --abi abi3 --abi none --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d "$dl" "$@"
}
echo "==> downloading $VLLM, its small dependencies and $NIXL (cp${PY/./} wheels) into $dl" >&2
# shellcheck disable=SC2086 # word lists
pip_dl $VLLM $DEPS $NIXL

# vLLM: its .py files only.
unzip -q -o "$dl"/vllm-0.34.0-*.whl '*.py' -d "$w/site"
# The dependencies, whole.
for whl in "$dl"/*.whl; do
    case $(basename "$whl") in vllm-*|nixl-*|nixl_cu13-*) continue ;; esac
    unzip -q -o "$whl" -d "$w/site"
done
rm -rf "$w"/site/*.dist-info/RECORD

# NIXL: the Python API, the UCX plugin and the UCX modules, and the
# closure of the libraries they need (by DT_NEEDED, within the wheel): the
# storage, cloud and telemetry plugins' libraries stay out.
unzip -q -o "$dl"/nixl-1.5.1-*.whl -d "$w/nixl"
unzip -q -o "$dl"/nixl_cu13-1.5.1-*.whl -d "$w/nixl"
libs=$w/nixl/nixl_cu13.libs
meson=$w/nixl/.nixl_cu13.mesonpy.libs
# Plugins: UCX's alone; UCX modules: CUDA memory and same-host copies (no
# NIC on the GPU machine: its InfiniBand modules and their verbs stay out).
find "$libs" "$meson" -name 'libplugin_*.so' ! -name 'libplugin_UCX.so' -delete
find "$libs" "$meson" -name 'libtelemetry_exporter_*' -delete
rm -f "$libs"/ucx/libuct_ib* "$libs"/ucx/libucx_perftest*
rm -rf "$w"/nixl/nixl_ep* "$w"/nixl/nixl_cu13.scripts "$w"/nixl/nixl_cu13-*.data "$w"/nixl/*.dist-info/RECORD
keep=$(mktemp)
queue=$(find "$w/nixl/nixl_cu13" "$libs" "$meson" -mindepth 1 -path '*/nixl/*' -o -path '*/ucx/*' -o -path '*/plugins/*' -o -path '*/nixl_cu13/*' | grep '\.so' | grep -v '\.la$')
printf '%s\n' $queue > "$keep"
while [ -n "$queue" ]; do
    next=""
    for f in $queue; do
        for need in $(readelf -d "$f" 2>/dev/null | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
            hit=$(find "$libs" "$meson" -maxdepth 1 -name "$need" | head -1)
            if [ -n "$hit" ] && ! grep -qxF "$hit" "$keep"; then
                echo "$hit" >> "$keep"
                next="$next $hit"
            fi
        done
    done
    queue=$next
done
for f in "$libs"/*.so* "$meson"/*.so*; do
    grep -qxF "$f" "$keep" || rm -f "$f"
done
rm -f "$keep"
# Line tables are for debugging here, not there: the folder must travel small.
find "$w/nixl" "$w/site" -name '*.so*' -type f -exec strip --strip-debug {} + 2>/dev/null || true
XZ_OPT=-T0 tar -C "$w/site" -cJf .gpu/nixl/site.tar.xz .
XZ_OPT=-T0 tar -C "$w/nixl" -cJf .gpu/nixl/nixl.tar.xz .
du -sh "$w/site" "$w/nixl" >&2
ls -l .gpu/nixl >&2
du -sh .gpu >&2
