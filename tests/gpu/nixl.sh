#!/usr/bin/env bash
# NIXL's agent API and vLLM's NixlConnector on the GPU machine, Ferry and
# the real NIXL in the same run (issue 33). Takes the prefix of
# tests/gpu/prepare.sh (the wheel) with tests/gpu/nixl-prepare.sh's
# nixl/ beside it:
#
#   bash tests/gpu/nixl.sh .gpu          # or: bash tests/gpu/all.sh .gpu nixl
#
# 1. tests/gpu/nixl_gpu.py: prepared lists and index arrays on cuda:0
#    tensors, two processes, verified; 16 KiB x 16,384 and 256 KiB x 1,024
#    blocks, READ and WRITE: ferry.nixl (every transport loaded, then
#    cuda-ipc alone) and the real NIXL 1.5.1 (UCX).
# 2. tests/gpu/vllm_nixl_gpu.py: vLLM's NixlConnector worker path with
#    cuda:0 caches, verified: FerryNixlConnector, the alias, the real NIXL.
# Every check runs even if an earlier one failed; the exit status says
# whether all passed.
set -uo pipefail
cd "$(dirname "$0")/../.."
P=${1:-.gpu}
OUT=${OUT:-$(mktemp -d)}
failures=0
section() { printf '\n===== %s\n' "$*"; }
check() { # name command...
    local name=$1; shift
    if "$@"; then echo "PASS $name"; else echo "FAIL $name"; failures=$((failures + 1)); fi
}

whl=$(ls "$P"/wheels/ferry-*.whl 2>/dev/null | head -1)
py=""
for c in ${PYTHON:-} /opt/torch/.venv/bin/python3 python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import torch' 2>/dev/null; then py=$c; break; fi
done
if [ -z "$whl" ] || [ -z "$py" ] || [ ! -f "$P/nixl/site.tar.xz" ]; then
    echo "SKIP: needs $P/wheels (tests/gpu/prepare.sh), $P/nixl (tests/gpu/nixl-prepare.sh) and a python3 with torch"
    exit 1
fi
W=$(mktemp -d)
venv=$W/venv
"$py" -m venv --system-site-packages "$venv" || "$py" -m venv --system-site-packages --without-pip "$venv"
VPY=$venv/bin/python
site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
"$VPY" -c 'import torch' 2>/dev/null ||
    "$py" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' > "$site/torch-site.pth"
if "$VPY" -m pip --version >/dev/null 2>&1; then
    check "pip install --no-index $(basename "$whl")" "$VPY" -m pip install -q --no-index "$whl"
else
    check "pip install --no-index $(basename "$whl")" "$py" -m pip install -q --no-index --no-deps --target "$site" "$whl"
fi
mkdir -p "$W/site" "$W/nixl"
tar -C "$W/site" -xJf "$P/nixl/site.tar.xz"
tar -C "$W/nixl" -xJf "$P/nixl/nixl.tar.xz"
"$VPY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)'

# The real NIXL (nixl-cu13) needs the CUDA 13 runtime: torch's.
cudart=$("$VPY" -c 'import os, torch
root = os.path.dirname(os.path.dirname(torch.__file__))
for d, _, files in os.walk(root):
    if any(f.startswith("libcudart.so.13") for f in files):
        print(d); break')
real_nixl() {
    PYTHONPATH=$W/nixl${PYTHONPATH:+:$PYTHONPATH} LD_LIBRARY_PATH=${cudart:+$cudart:}${LD_LIBRARY_PATH:-} "$@"
}
echo "CUDA runtime for the real NIXL: ${cudart:-not found}"
real_nixl "$VPY" -c 'import nixl._api, nixl; print("real NIXL:", nixl._api.__file__)' ||
    echo "the real NIXL does not import here: its rows below fail with the reason"

section "NIXL's API on cuda:0 tensors: prepared lists, index arrays (16 KiB x 16,384, 256 KiB x 1,024)"
check "ferry.nixl, every transport loaded" "$VPY" tests/gpu/nixl_gpu.py run --impl ferry --label ferry
check "ferry.nixl, FERRY_TRANSPORTS=cuda-ipc" env FERRY_TRANSPORTS=cuda-ipc "$VPY" tests/gpu/nixl_gpu.py run --impl ferry --label ferry-cuda-ipc
check "real NIXL 1.5.1 (UCX)" real_nixl "$VPY" tests/gpu/nixl_gpu.py run --impl nixl --label nixl

section "vLLM 0.34's NixlConnector worker path, cuda:0 caches, two processes"
real="torch,triton"
for m in torchvision; do "$VPY" -c "import $m" 2>/dev/null && real="$real,$m"; done
export FERRY_APPEND_PATH=$W/site FERRY_HEAVY_STUBS_REAL=$real
for via in connector alias; do
    check "vLLM worker path on Ferry ($via)" "$VPY" tests/gpu/vllm_nixl_gpu.py --via $via
done
check "vLLM worker path on the real NIXL" real_nixl "$VPY" tests/gpu/vllm_nixl_gpu.py --via nixl

echo "$failures check(s) failed"
exit $((failures > 0))
