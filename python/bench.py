#!/usr/bin/env python3
"""Throughput from Python against `ferry bench`, in the same run.

For each transport, one `ferry bench target` serves a buffer; for each block
size and op, `ferry bench initiator` and a Python initiator (this process,
the Mooncake-compatible `ferry.TransferEngine`, batch_transfer_sync_*) take
turns against it with the same block size, batch size, working set and
duration. Prints GB/s of both and their ratio (Python / ferry).

    python python/bench.py                                  # tcp and shm, 1M/4M/16M, host memory
    python python/bench.py --device cuda:0 --blocks 1M,16M  # local buffers in GPU memory (torch)

Needs the `ferry` binary (--ferry, default target/release/ferry or
.gpu/bin/ferry) and the installed `ferry` package (packaging/wheel.sh).
A benchmark, not a test: on a shared machine the numbers are noisy; --repeat
alternates the two initiators and reports medians.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# This file sits beside the package's source (python/ferry), which Python
# would import instead of the installed wheel (the source has no native
# module or plugins): look only at installed packages.
HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import ferry  # noqa: E402

ROOT = HERE.parent
WORKING_SET = 64 << 20  # as `ferry bench`: cycle through memory, not cache


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(t[:-1] if t[-1:] in "KMG" else t) * mult


def human(n: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


def default_batch(block: int) -> int:
    # What tests/gpu/run.sh uses: 64 requests per batch, 16 from 16 MiB.
    return 16 if block >= 16 << 20 else 64


def find_ferry(given: str | None) -> str:
    for c in [given, ROOT / "target/release/ferry", ROOT / ".gpu/bin/ferry"]:
        if c and Path(c).is_file():
            return str(c)
    sys.exit("no ferry binary: pass --ferry PATH (cargo build --release -p ferry-cli makes one)")


class Target:
    """`ferry bench target` in its own process."""

    def __init__(self, ferry_bin: str, size: int, env: dict, allocate: bool):
        # Host memory at the target; with --device the local side is on the GPU.
        args = [ferry_bin, "bench", "target", "--buffer-size", str(size)]
        if allocate:
            args.append("--allocate")
        self.p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        line = self.p.stdout.readline()
        if not line.startswith("segment "):
            self.p.kill()
            sys.exit(f"ferry bench target did not start ({line!r})")
        self.segment = line.split()[1]

    def stop(self):
        self.p.kill()
        self.p.wait()


def ferry_initiator(ferry_bin, env, segment, op, block, batch, duration, device) -> float:
    args = [ferry_bin, "bench", "initiator", "--segment", segment, "--op", op,
            "--block-size", str(block), "--batch-size", str(batch),
            "--duration", str(duration), "--json"]
    if device:
        args += ["--device", device]
    out = subprocess.run(args, capture_output=True, text=True, env=env, timeout=duration * 4 + 120)
    if out.returncode != 0:
        sys.exit(f"ferry bench initiator failed: {out.stderr.strip()}")
    return json.loads(out.stdout.strip().splitlines()[-1])["gb_per_s"]


def python_initiator(protocol, device, segment, op, block, batch, duration) -> float:
    """The same loop as `ferry bench initiator`, from Python, set up afresh
    for each measurement as that process is: a new engine, one thread, one
    untimed batch, then synchronous batches moving on through the remote
    buffer and through a local working set of at least 64 MiB (touched
    before timing)."""
    te = ferry.TransferEngine()
    if te.initialize("127.0.0.1", "P2PHANDSHAKE", protocol, "") != 0:
        sys.exit(f"initialize: {te.last_error}")
    try:
        remote = max(te.get_engine().open(segment).buffers, key=lambda b: b.nbytes)
        slots = max(remote.nbytes // block, 1)
        per_batch = block * batch
        local_slots = max(min(max(per_batch, WORKING_SET) // block, slots), 1)
        length = local_slots * block
        if device:
            import torch

            keep = torch.zeros(length, dtype=torch.uint8, device=device)
            local = keep.data_ptr()
        else:
            keep = ctypes.create_string_buffer(length)  # no numpy needed
            local = ctypes.addressof(keep)
            ctypes.memset(local, 0, length)  # touched, as ferry bench's buffer is
        if te.register_memory(local, length) != 0:
            sys.exit(f"register_memory: {te.last_error}")
        call = te.batch_transfer_sync_write if op == "write" else te.batch_transfer_sync_read
        lengths = [block] * batch
        # One untimed batch first, as `ferry bench initiator` does: connecting
        # and mapping the peer's memory (shm maps a whole allocation once)
        # are not part of the figure. Timing them on one side only cost the
        # Python figure a tenth of a 1 s run on the fastest paths.
        first = range(min(batch, slots))
        if call(segment, [local + (k % local_slots) * block for k in first],
                [remote.addr + k * block for k in first], [block] * len(first)) != 0:
            sys.exit(f"the first {op} failed: {te.last_error}")
        moved, n = 0, 0
        started = time.perf_counter()
        while time.perf_counter() - started < duration:
            ks = range(n * batch, (n + 1) * batch)
            rc = call(segment,
                      [local + (k % local_slots) * block for k in ks],
                      [remote.addr + (k % slots) * block for k in ks],
                      lengths)
            if rc != 0:
                sys.exit(f"{op} failed: {te.last_error}")
            moved += per_batch
            n += 1
        elapsed = time.perf_counter() - started
        te.unregister_memory(local)
        del keep
        return moved / elapsed / 1e9
    finally:
        te.close()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ferry", help="the ferry binary")
    ap.add_argument("--transports", default="tcp,shm")
    ap.add_argument("--blocks", default="1M,4M,16M", help="block sizes (1 MiB and up)")
    ap.add_argument("--ops", default="write,read")
    ap.add_argument("--batch", type=int, help="requests per batch (default 64, 16 from 16M)")
    ap.add_argument("--duration", type=float, default=3.0, help="seconds per measurement")
    ap.add_argument("--repeat", type=int, default=1, help="alternate ferry/Python this many times; medians")
    ap.add_argument("--target-size", default="1G", help="the target's buffer")
    ap.add_argument("--device", help="local buffers in this GPU's memory (cuda:N, needs torch)")
    ap.add_argument("--json", help="append one JSON line per measurement to this file")
    args = ap.parse_args()

    ferry_bin = find_ferry(args.ferry)
    blocks = [parse_size(b) for b in args.blocks.split(",")]
    rows = []
    print(f"ferry {ferry.__version__}; {ferry_bin}; {args.duration:g} s per run, {args.repeat} run(s) each"
          + (f"; local buffers on {args.device}" if args.device else ""), flush=True)
    # Both initiators and the target load the same plugin files: the wheel's
    # (the ferry binary would otherwise use those beside it or in its build
    # directory, possibly from another build).
    plugin_path = os.environ.get("FERRY_PLUGIN_PATH") or ferry.plugin_dir()
    print(f"plugins: {plugin_path}", flush=True)
    for transport in args.transports.split(","):
        env = dict(os.environ, FERRY_TRANSPORTS=transport, FERRY_PLUGIN_PATH=plugin_path)
        os.environ["FERRY_TRANSPORTS"] = transport  # this process's engine too
        target = Target(ferry_bin, parse_size(args.target_size), env, transport == "shm")
        try:
            for block in blocks:
                batch = args.batch or default_batch(block)
                for op in args.ops.split(","):
                    f_runs, p_runs = [], []
                    for _ in range(args.repeat):
                        f_runs.append(ferry_initiator(ferry_bin, env, target.segment, op, block, batch,
                                                      args.duration, args.device))
                        p_runs.append(python_initiator(transport, args.device, target.segment, op, block,
                                                       batch, args.duration))
                    f, p = statistics.median(f_runs), statistics.median(p_runs)
                    row = dict(transport=transport, op=op, block_size=block, batch_size=batch,
                               device=args.device or "host", ferry_gb_per_s=round(f, 3),
                               python_gb_per_s=round(p, 3), ratio=round(p / f, 3) if f else 0.0,
                               ferry_runs=f_runs, python_runs=p_runs)
                    rows.append(row)
                    print(f"  {transport:4} {op:5} {human(block):>4} x {batch:<3} ferry {f:7.2f} GB/s  "
                          f"python {p:7.2f} GB/s  ratio {row['ratio']:.2f}", flush=True)
                    if args.json:
                        with open(args.json, "a") as fh:
                            fh.write(json.dumps(row) + "\n")
        finally:
            target.stop()
    print("\n| transport | op | block | batch | ferry bench GB/s | Python GB/s | Python / ferry |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['transport']} | {r['op']} | {human(r['block_size'])} | {r['batch_size']} | "
              f"{r['ferry_gb_per_s']:.2f} | {r['python_gb_per_s']:.2f} | {r['ratio']:.2f} |")
    worst = min((r["ratio"] for r in rows), default=0.0)
    print(f"\nlowest ratio {worst:.2f} (the goal: within 10% of ferry bench, i.e. >= 0.90)")


if __name__ == "__main__":
    main()
