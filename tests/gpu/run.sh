#!/usr/bin/env bash
# Every GPU check of Ferry, on a machine with an NVIDIA GPU and no Rust
# toolchain. Takes the prefix tests/gpu/prepare.sh assembled (default .gpu):
#
#   bash tests/gpu/run.sh .gpu
#
# Prints everything; copies the JSON it gathers to $OUT when that is set.
# Runs with the fake GPU too (a prefix whose plugins hold the test plugin
# fakegpu as libferry_device_cuda.so): the cuda-only checks then fail, the
# rest show the flow.
# Each check runs even if an earlier one failed; the exit status says
# whether all passed.
#
# The release tarball: with FERRY_TARBALL=ferry-<version>-linux-<arch>.tar.gz
# (packaging/build.sh's output, carried here unchanged), it is first unpacked
# into a fresh temporary directory and its bin/ferry info runs with a clean
# environment (env -i PATH=/usr/bin:/bin): the cuda plugin must be enabled,
# found beside the binary. When the prefix argument does not exist, the other
# checks then use the tarball's binaries (cuda_check, not shipped, is skipped):
#
#   FERRY_TARBALL=dist/ferry-0.1.0-linux-x86_64.tar.gz bash tests/gpu/run.sh
set -uo pipefail
P=${1:-.gpu}
OUT=${OUT:-$(mktemp -d)}
mkdir -p "$OUT"
DUR=${DURATION:-3}
failures=0
section() { printf '\n===== %s\n' "$*"; }
check() { # name command...
    local name=$1; shift
    if "$@"; then echo "PASS $name"; else echo "FAIL $name"; failures=$((failures + 1)); fi
}
field() { sed -n "s/.*\"$1\":\([0-9.eE+-]*\).*/\1/p"; }

# cuda_enabled INFO_JSON: the cuda plugin's state is "enabled".
cuda_enabled() {
    awk '/"name": "cuda"/ { found = 1 } found && /"state":/ { print; exit }' "$1" | grep -q '"enabled"'
}

if [ -n "${FERRY_TARBALL:-}" ]; then
    section "release tarball $FERRY_TARBALL: unpacked into a fresh directory, clean environment"
    unpacked=$(mktemp -d)
    trap 'rm -rf "$unpacked"' EXIT
    if tar -xzf "$FERRY_TARBALL" -C "$unpacked"; then
        T=$(find "$unpacked" -mindepth 1 -maxdepth 1 -type d | head -n 1)
        echo "unpacked into $T"
        env -i PATH=/usr/bin:/bin "$T/bin/ferry" info | tee "$OUT/tarball-info.txt"
        env -i PATH=/usr/bin:/bin "$T/bin/ferry" info --json > "$OUT/tarball-info.json"
        cp "$T/manifest.json" "$OUT/tarball-manifest.json" 2>/dev/null
        check "tarball: plugins found beside its binary" grep -q '"origin": "beside-library"' "$OUT/tarball-info.json"
        check "tarball: cuda plugin enabled" cuda_enabled "$OUT/tarball-info.json"
        [ -x "$P/bin/ferry" ] || P=$T
    else
        check "tarball unpacks" false
    fi
fi
B=$P/bin/ferry

section "machine"
nvidia-smi --query-gpu=name,pci.bus_id,driver_version,memory.total --format=csv,noheader || true
uname -r
ls /usr/lib/x86_64-linux-gnu/ 2>/dev/null | grep -E '^lib(ibverbs|mlx5|cuda)\.so' || true
ls /sys/class/infiniband 2>/dev/null || echo "no /sys/class/infiniband: no RDMA device"

section "ferry info"
$B info | tee "$OUT/info.txt"
$B info --json > "$OUT/info.json"
check "cuda plugin enabled" cuda_enabled "$OUT/info.json"
check "GPU decision shown" grep -q 'registration:' "$OUT/info.txt"

section "RDMA: the rdma plugin with this host's libibverbs (no RDMA NIC here)"
sed -n '/^  rdma /,/^$/p' "$OUT/info.txt" | tee "$OUT/rdma-info.txt"
check "rdma disabled: libibverbs loads, no RDMA device" \
    grep -q 'why not: libibverbs loads, but' "$OUT/rdma-info.txt"

section "RDMA: GPU memory registered by DMA-BUF through the rdma plugin, on emulated NICs"
# The verbs emulator stands in for libibverbs (LD_LIBRARY_PATH) with the eight
# NICs of a DGX H100 (fake sysfs tree): the rdma plugin's real code exports
# cuda:0 memory as DMA-BUF and calls ibv_reg_dmabuf_mr with it. A write from
# that memory then needs a NIC that can reach GPU memory, which the emulator
# is not: it fails cleanly (reported, not a failure of the check).
emu=$P/lib/verbs-emulator
sysfs=$(mktemp -d); fabric=$(mktemp -d)
$B topology --write-fixture dgx-h100 "$sysfs"
emu_env=(env LD_LIBRARY_PATH="$emu" FERRY_VERBS_EMU_CONFIG="$emu/dgx-h100.conf" FERRY_VERBS_EMU_DIR="$fabric"
         FERRY_SYSFS_ROOT="$sysfs" FERRY_TRANSPORTS=rdma)
"${emu_env[@]}" $B info | tee "$OUT/info-emulated.txt" | sed -n '/^  rdma /,/^$/p'
check "rdma enabled on emulated NICs, DMA-BUF on" grep -q 'memory cuda-dmabuf: available' "$OUT/info-emulated.txt"
"${emu_env[@]}" FERRY_LOG=info $B bench rdma-check --device cuda:0 2>&1 | tee "$OUT/rdma-check.txt"
check "cuda:0 memory registered by DMA-BUF through rdma (emulated NICs)" \
    grep -q 'rdma as cuda-dmabuf' "$OUT/rdma-check.txt"
rm -rf "$sysfs" "$fabric"

section "cuda plugin through its C ABI (every pointer kind, DMA-BUF ranges, contexts)"
if [ -x "$P/bin/cuda_check" ]; then
    check "cuda_check" "$P/bin/cuda_check" "$P/lib/ferry/plugins/libferry_device_cuda.so"
else
    echo "SKIP cuda_check: not in $P (tests/gpu/prepare.sh builds it)"
fi

section "device check (allocation, classification, DMA-BUF export, copies)"
check "device check" $B bench device-check --device cuda:0

section "pinned host <-> device copy limit"
$B bench device-limit --device cuda:0 --block 16M --duration "$DUR" --json | tee "$OUT/device-limit.json"
h2d=$(field host_to_device_gb_per_s < "$OUT/device-limit.json")
d2h=$(field device_to_host_gb_per_s < "$OUT/device-limit.json")

for t in tcp shm; do
    section "GPU -> GPU, 1 GiB, two processes, over $t"
    check "GPU->GPU over $t" env FERRY_TRANSPORTS=$t $B demo --size 1G --block 16M --device cuda:0
done

section "ferry bench: device buffers vs host buffers, same transport"
tmp=$(mktemp -d)
start_target() { # name args...
    local name=$1; shift
    $B bench target --buffer-size 1G "$@" > "$tmp/$name" 2>/dev/null &
    echo $! >> "$tmp/pids"
    for _ in $(seq 300); do grep -q '^segment ' "$tmp/$name" && break; sleep 0.1; done
    sed -n 's/^segment //p' "$tmp/$name"
}
printf '| transport | op | block | host GB/s | device GB/s | device/host | device vs pinned copy |\n|---|---|---|---|---|---|---|\n' > "$OUT/bench.md"
for t in tcp shm; do
    export FERRY_TRANSPORTS=$t
    host_extra=""; [ "$t" = shm ] && host_extra="--allocate"
    host_seg=$(start_target "host-$t" $host_extra)
    dev_seg=$(start_target "dev-$t" --device cuda:0)
    for block in 1M 16M; do
        batch=64; [ "$block" = 16M ] && batch=16
        for op in write read; do
            h=$($B bench initiator --segment "$host_seg" --op $op --block-size $block --batch-size $batch --duration "$DUR" --json 2>/dev/null | tee -a "$OUT/bench.jsonl" | field gb_per_s)
            d=$($B bench initiator --segment "$dev_seg" --op $op --block-size $block --batch-size $batch --duration "$DUR" --device cuda:0 --json 2>/dev/null | tee -a "$OUT/bench.jsonl" | field gb_per_s)
            limit=$h2d; [ "$op" = read ] && limit=$d2h
            awk -v t=$t -v o=$op -v b=$block -v h="$h" -v d="$d" -v l="$limit" 'BEGIN {
                r = (h > 0) ? d / h : 0; c = (l > 0) ? d / l : 0;
                printf "| %s | %s | %s | %.2f | %.2f | %.2f | %.2f |\n", t, o, b, h, d, r, c }' >> "$OUT/bench.md"
        done
    done
    unset FERRY_TRANSPORTS
done
kill $(cat "$tmp/pids") 2>/dev/null
cat "$OUT/bench.md"

section "cuda-ipc: GPU memory between two processes of one host, at device speed (issue 15)"
# Limits of this run: a device-to-device copy of 1 GiB on the same GPU
# (cuMemcpyAsync through the cuda plugin) and the pinned copies above.
$B bench device-limit --device cuda:0 --block 16M --duration 1 --dtod 1G --json | tee "$OUT/dtod-limit.json"
dtod=$(field device_to_device_gb_per_s < "$OUT/dtod-limit.json")
plugin_enabled() { # name info-json
    awk -v n="\"name\": \"$1\"" 'index($0, n) { found = 1 } found && /"state":/ { print; exit }' "$2" | grep -q '"enabled"'
}
check "cuda-ipc plugin enabled" plugin_enabled cuda-ipc "$OUT/info.json"
sed -n '/^  cuda-ipc /,/^$/p' "$OUT/info.txt"
for block in 16M 1M; do
    check "cuda-ipc demo: 1 GiB cuda:0 -> cuda:0 in $block blocks, written, read back, verified" \
        bash -o pipefail -c "FERRY_TRANSPORTS=cuda-ipc,tcp $B demo --size 1G --block $block --device cuda:0 | tee '$OUT/cuda-ipc-demo-$block.txt' | grep 'transport  cuda-ipc' >/dev/null"
done
grep -h -E 'transport|GB/s|checksum' "$OUT"/cuda-ipc-demo-*.txt
printf '| path | op | block | GB/s | ratio to same-GPU copy (%.1f GB/s) | p50 us |\n|---|---|---|---|---|---|\n' "${dtod:-0}" > "$OUT/cuda-ipc.md"
ipc_row() { # label op block json
    awk -v p="$1" -v o="$2" -v b="$3" -v d="${dtod:-0}" -v line="$4" 'BEGIN {
        g = 0; if (match(line, /"gb_per_s":[0-9.eE+-]+/)) g = substr(line, RSTART + 11, RLENGTH - 11) + 0
        l = 0; if (match(line, /"p50":[0-9.eE+-]+/)) l = substr(line, RSTART + 6, RLENGTH - 6) + 0
        printf "| %s | %s | %s | %.1f | %.3f | %.1f |\n", p, o, b, g, (d > 0) ? g / d : 0, l }' >> "$OUT/cuda-ipc.md"
}
tmp_ipc=$(mktemp -d)
ipc_target() { # name "VAR=value ..." args...
    local name=$1 envs=$2; shift 2
    env $envs $B bench target --buffer-size 1G "$@" > "$tmp_ipc/$name" 2>"$tmp_ipc/$name.err" &
    echo $! >> "$tmp_ipc/pids"
    for _ in $(seq 300); do grep -q '^segment ' "$tmp_ipc/$name" && break; sleep 0.1; done
    sed -n 's/^segment //p' "$tmp_ipc/$name"
}
dev_seg=$(ipc_target dev "FERRY_TRANSPORTS=cuda-ipc,tcp" --device cuda:0)
declare -A ipc_gbps ipc_route
for block in 16M 1M; do
    batch=64; [ "$block" = 16M ] && batch=16
    for op in write read; do
        j=$(FERRY_TRANSPORTS=cuda-ipc,tcp $B bench initiator --segment "$dev_seg" --op $op --block-size $block \
            --batch-size $batch --duration "$DUR" --device cuda:0 --json 2>/dev/null | tee -a "$OUT/cuda-ipc.jsonl")
        echo "$j" | grep -q '"transport":"cuda-ipc"' || echo "route of $op $block is not cuda-ipc: $j"
        ipc_gbps[$op-$block]=$(echo "$j" | field gb_per_s)
        ipc_row "cuda-ipc cuda:0 -> cuda:0" $op $block "$j"
    done
done
# The staged path of the same run, for the 30x check.
j=$(FERRY_TRANSPORTS=tcp $B bench initiator --segment "$dev_seg" --op write --block-size 16M --batch-size 16 \
    --duration "$DUR" --device cuda:0 --json --transport tcp 2>/dev/null | tee -a "$OUT/cuda-ipc.jsonl")
tcp16=$(echo "$j" | field gb_per_s)
ipc_row "tcp, staged (same target)" write 16M "$j"
# One 4 KiB synchronous write at a time: latency.
j=$(FERRY_TRANSPORTS=cuda-ipc,tcp $B bench initiator --segment "$dev_seg" --op write --block-size 4K --batch-size 1 \
    --duration 2 --device cuda:0 --json 2>/dev/null | tee -a "$OUT/cuda-ipc.jsonl")
p50=$(echo "$j" | sed -n 's/.*"p50":\([0-9.eE+-]*\).*/\1/p')
ipc_row "cuda-ipc, one request at a time" write 4K "$j"
# cuda:0 -> a same-host peer's engine-allocated host memory, and back.
host_seg=$(ipc_target host "FERRY_TRANSPORTS=cuda-ipc,shm,tcp" --allocate)
for op in write read; do
    j=$($B bench initiator --segment "$host_seg" --op $op --block-size 16M --batch-size 16 --duration "$DUR" \
        --device cuda:0 --json 2>/dev/null | tee -a "$OUT/cuda-ipc.jsonl")
    ipc_gbps[host-$op]=$(echo "$j" | field gb_per_s)
    ipc_route[$op]=$(echo "$j" | sed -n 's/.*"transport":"\([^"]*\)".*/\1/p')
    ipc_row "cuda:0 -> peer's allocated host memory (${ipc_route[$op]:-?})" $op 16M "$j"
done
kill $(cat "$tmp_ipc/pids") 2>/dev/null
cat "$OUT/cuda-ipc.md"
ge() { awk -v a="${1:-0}" -v b="${2:-0}" 'BEGIN { exit !(a >= b && a > 0) }'; }
ratio() { awk -v a="${1:-0}" -v b="${2:-0}" 'BEGIN { printf "%.3f", (b > 0) ? a / b : 0 }'; }
for op in write read; do
    r=$(ratio "${ipc_gbps[$op-16M]:-0}" "$dtod"); check "cuda-ipc $op 16M: $r x same-GPU copy >= 0.5" ge "$r" 0.5
    r=$(ratio "${ipc_gbps[$op-1M]:-0}" "$dtod"); check "cuda-ipc $op 1M: $r x same-GPU copy >= 0.25" ge "$r" 0.25
done
r=$(ratio "${ipc_gbps[write-16M]:-0}" "$tcp16"); check "cuda-ipc write 16M: $r x staged tcp of this run >= 30" ge "$r" 30
check "cuda-ipc 4 KiB synchronous write p50 ${p50:-?} us <= 25" awk -v p="${p50:-1e9}" 'BEGIN { exit !(p <= 25) }'
if [ "${ipc_route[write]:-}" = cuda-ipc ]; then
    r=$(ratio "${ipc_gbps[host-write]:-0}" "$d2h"); check "cuda:0 -> peer host memory: $r x pinned d2h >= 0.7" ge "$r" 0.7
    r=$(ratio "${ipc_gbps[host-read]:-0}" "$h2d"); check "peer host memory -> cuda:0: $r x pinned h2d >= 0.7" ge "$r" 0.7
else
    echo "SKIP cuda:0 <-> peer host memory: the route is ${ipc_route[write]:-?}, not cuda-ipc (the engine" \
         "fills share_fd for memory it allocates only with branch shm merged)"
fi
rm -rf "$tmp_ipc"

section "KV-shaped transfers: 256 MiB batches of shuffled blocks, two processes, verified (issue 30)"
OUT=$OUT bash "$(dirname "$0")/kv.sh" "$P"
check "KV-shaped runs all completed and verified" test $? -eq 0

section "Python wheel: torch CUDA tensors between two processes; throughput vs ferry bench"
# The wheel from prepare.sh, installed (no index: no network here) into a
# venv that sees torch. Skipped, with the reason, when either is missing.
whl=$(ls "$P"/wheels/ferry-*.whl 2>/dev/null | head -1)
py=""
for c in ${PYTHON:-} /opt/torch/.venv/bin/python3 python3; do
    if command -v "$c" >/dev/null 2>&1 && "$c" -c 'import torch' 2>/dev/null; then py=$c; break; fi
done
if [ -z "$whl" ]; then
    echo "SKIP: no wheel in $P/wheels (tests/gpu/prepare.sh builds it)"
elif [ -z "$py" ]; then
    echo "SKIP: no python3 that imports torch (set PYTHON)"
else
    venv=$(mktemp -d)/venv
    "$py" -m venv --system-site-packages "$venv" || "$py" -m venv --system-site-packages --without-pip "$venv"
    VPY=$venv/bin/python
    site=$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
    # A venv made from another venv's python does not see that venv's
    # packages: point the new one at torch's site-packages.
    if ! "$VPY" -c 'import torch' 2>/dev/null; then
        "$py" -c 'import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))' > "$site/torch-site.pth"
    fi
    install_wheel() {
        if "$VPY" -m pip --version >/dev/null 2>&1; then
            "$VPY" -m pip install -q --no-index "$whl"
        else # a venv without pip: torch's python installs into it
            "$py" -m pip install -q --no-index --no-deps --target "$site" "$whl"
        fi
    }
    check "pip install --no-index $(basename "$whl")" install_wheel
    "$VPY" -c 'import ferry; print(ferry.info())' | tee "$OUT/python-info.txt"
    check "python: the wheel's cuda plugin is enabled" "$VPY" -c 'import ferry, sys
sys.exit(not any(p["name"] == "cuda" and p["state"] == "enabled" for p in ferry.info()["plugins"]))'
    if "$VPY" -c 'import pytest, numpy' 2>/dev/null; then
        # The CPU suite too, and its torch test with CUDA tensors.
        check "python: pytest python/tests" "$VPY" -m pytest python/tests -q -p no:cacheprovider -rs
    fi
    for t in tcp shm; do
        check "python: torch CUDA tensors, two processes, over $t" "$VPY" tests/gpu/python_cuda.py run --transport $t
    done
    # As SGLang calls it (protocol "tcp"), every transport loaded: GPU
    # tensors take cuda-ipc with no option, from both allocators.
    for alloc in default expandable; do
        check "python: torch CUDA tensors ($alloc allocator) take cuda-ipc" \
            "$VPY" tests/gpu/python_cuda.py run --transport tcp --transports all --alloc $alloc --expect cuda-ipc --size 256M
    done
    rm -f "$OUT/python-bench.jsonl"
    # Medians of 3 alternating runs of 1 s: one run each swung by 10-25% on
    # this shared host (about the same device time as 1 run of 2 s).
    py_bench() {
        "$VPY" python/bench.py --ferry "$B" --blocks 1M,16M --duration "${PY_DURATION:-1}" \
            --repeat "${PY_REPEAT:-3}" "$@" \
            --json "$OUT/python-bench.jsonl" | tee -a "$OUT/python-bench.txt"
    }
    check "python bench: host buffers" py_bench
    check "python bench: local buffers on cuda:0" py_bench --device cuda:0
    check "python: throughput within 10% of ferry bench (1 MiB+ blocks, same run)" "$VPY" -c 'import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
low = [r for r in rows if r["ratio"] < 0.9]
for r in low: print("  below 0.9:", r)
sys.exit(1 if low or not rows else 0)' "$OUT/python-bench.jsonl"
    # KV-cache-shaped batches from Python (issue 30): 256 MiB of shuffled
    # blocks per batch over cuda-ipc, through the Mooncake API (lists of
    # ints) and the block-layout API (arrays), as ratios to the same run's
    # contiguous 256 MiB device copy; issue_ms is the submit call alone.
    rm -f "$OUT/python-kv.jsonl"
    check "python kv: cuda-ipc, lists and arrays, verified" \
        "$VPY" python/bench_kv.py --device cuda:0 --transports cuda-ipc --duration "${PY_DURATION:-1}" \
            --json "$OUT/python-kv.jsonl"
    check "python kv: Mooncake lists >= 0.02/0.1/0.35/0.6 x dtod (4K/16K/64K/256K), 16K issue <= 2 ms" \
        "$VPY" -c 'import json, sys
goal = {4096: 0.02, 16384: 0.1, 65536: 0.35, 262144: 0.6}
rows = [json.loads(l) for l in open(sys.argv[1])]
bad = 0
for r in rows:
    if r["api"] != "mooncake":
        continue
    ok = r["ratio"] >= goal.get(r["block"], 0) and (r["block"] != 16384 or r["issue_ms"] <= 2.0)
    bad += not ok
    print(("ok  " if ok else "LOW ") + json.dumps(r))
sys.exit(1 if bad or not rows else 0)' "$OUT/python-kv.jsonl" | tee "$OUT/python-kv.txt"
fi

section "summary"
echo "pinned copy limit: host->device ${h2d:-?} GB/s, device->host ${d2h:-?} GB/s"
echo "same-GPU copy limit (1 GiB): ${dtod:-?} GB/s"
[ -f "$OUT/cuda-ipc.md" ] && cat "$OUT/cuda-ipc.md"
[ -f "$OUT/kv.md" ] && cat "$OUT/kv.md"
[ -f "$OUT/python-kv.txt" ] && cat "$OUT/python-kv.txt"
[ -f "$OUT/kv-staged-ratios.txt" ] && cat "$OUT/kv-staged-ratios.txt"
echo "$failures check(s) failed"
exit $((failures > 0))
