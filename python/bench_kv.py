#!/usr/bin/env python3
"""KV-cache-shaped transfers from Python: N blocks of S bytes per batch, from
shuffled local blocks to shuffled remote blocks, two processes, through
Ferry's block-layout API (numpy index arrays) and through the Mooncake API
(lists of int addresses), with the same run's contiguous copy of the batch's
bytes as the limit (a torch device-to-device copy with --device, else a
numpy host copy).

    python python/bench_kv.py                                 # host memory (numpy), tcp and shm
    python python/bench_kv.py --device cuda:0 --transports cuda-ipc

Every size is verified once: blocks written, read back into a zeroed pool
through other indices, compared. Prints one table row per (transport, API,
op, block size): GB/s, its ratio to the limit, and the CPU time to issue
one batch (the submit call alone). --json appends the rows to a file.
A benchmark, not a test: on a shared machine the numbers are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
# The installed wheel, not the source tree beside this file.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != HERE]

import numpy as np  # noqa: E402

import ferry  # noqa: E402

BATCH = 256 << 20


def parse_size(text: str) -> int:
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(t[-1:], 1)
    return int(t[:-1] if t[-1:] in "KMG" else t) * mult


def human(n: int) -> str:
    for unit, size in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= size and n % size == 0:
            return f"{n // size}{unit}"
    return str(n)


class Pool:
    """``size`` bytes of host (numpy) or device (torch) memory."""

    def __init__(self, size: int, device: str | None, fill: int | None = None):
        self.device = device
        if device:
            import torch

            self.t = torch.empty(size, dtype=torch.uint8, device=device)
            if fill is None:
                self.t.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, device=device))
            else:
                self.t.fill_(fill)
            self.addr = self.t.data_ptr()
            self.obj = self.t
        else:
            self.a = np.zeros(size, dtype=np.uint8) if fill is not None else np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8)
            if fill:
                self.a[:] = fill
            self.addr = self.a.ctypes.data
            self.obj = self.a

    def sync(self):
        if self.device:
            import torch

            torch.cuda.synchronize()

    def zero(self):
        if self.device:
            self.t.zero_()
        else:
            self.a[:] = 0

    def block(self, i: int, size: int):
        return (self.t if self.device else self.a)[i * size : (i + 1) * size]

    def equal(self, other: "Pool") -> bool:
        if self.device:
            import torch

            return bool(torch.equal(self.t, other.t))
        return bool(np.array_equal(self.a, other.a))


def serve(args) -> None:
    """The target: a pool twice the batch, a layout per block size."""
    engine = ferry.Engine(transports=args.transport, listen="127.0.0.1:0")
    pool = Pool(2 * BATCH, args.device, fill=0)
    engine.register(pool.obj)
    layouts = {s: engine.register_layout(pool.obj, s).id for s in args.sizes}
    print(json.dumps({"segment": engine.segment_name, "addr": pool.addr, "layouts": layouts}), flush=True)
    sys.stdin.readline()  # until the initiator is done
    engine.close()


def limit_gbps(device: str | None, seconds: float) -> float:
    """A contiguous copy of one batch's bytes, this machine's own limit."""
    src, dst = Pool(BATCH, device), Pool(BATCH, device, fill=0)
    n, start = 0, time.perf_counter()
    while True:
        if device:
            dst.t.copy_(src.t)
        else:
            np.copyto(dst.a, src.a)
        n += 1
        if n % 4 == 0:
            src.sync()
            if time.perf_counter() - start >= seconds:
                break
    return n * BATCH / (time.perf_counter() - start) / 1e9


def run(args) -> None:
    env = dict(os.environ, FERRY_TRANSPORTS=args.transport)
    target = subprocess.Popen(
        [sys.executable, __file__, "--serve", "--transport", args.transport, "--sizes", ",".join(map(str, args.sizes)), *(["--device", args.device] if args.device else [])],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
    )
    try:
        hello = json.loads(target.stdout.readline())
        limit = limit_gbps(args.device, args.duration)
        te = ferry.TransferEngine()
        assert te.initialize("127.0.0.1", "P2PHANDSHAKE", args.transport, "") == 0, te.last_error
        engine = te.get_engine()
        local = Pool(2 * BATCH, args.device)
        back = Pool(2 * BATCH, args.device, fill=0)
        engine.register(local.obj)
        engine.register(back.obj)
        seg = engine.open(hello["segment"])
        rows = []
        for size in args.sizes:
            n = BATCH // size
            count = 2 * BATCH // size
            local_layout = engine.register_layout(local.obj, size)
            back_layout = engine.register_layout(back.obj, size)
            remote_layout = int(hello["layouts"][str(size)])
            rng = np.random.default_rng(size)
            lids = rng.permutation(count)[:n].astype(np.int64)
            rids = rng.permutation(count)[:n].astype(np.int64)
            # Verified once: write, read back by the same remote blocks into
            # other local blocks of a zeroed pool, compare block by block.
            seg.write_blocks(local_layout, lids, remote_layout, rids)
            back.zero()
            bids = rng.permutation(count)[:n].astype(np.int64)
            seg.read_blocks(back_layout, bids, remote_layout, rids)
            local.sync()
            for k in rng.choice(n, size=min(n, 64), replace=False):
                a, b = local.block(int(lids[k]), size), back.block(int(bids[k]), size)
                same = bool((a == b).all())
                if not same:
                    sys.exit(f"{human(size)} blocks: block {lids[k]} differs after the round trip")
            # Lists of ints, as the Mooncake API's callers hold them.
            laddr = (local.addr + lids * size).tolist()
            raddr = (hello["addr"] + rids * size).tolist()
            lens = [size] * n
            name = hello["segment"]
            for api in args.apis:
                for op in args.ops:
                    if api == "layout":
                        f = seg.write_blocks if op == "write" else seg.read_blocks
                        call = lambda: f(local_layout, lids, remote_layout, rids)  # noqa: E731
                        issue = seg.submit_write_blocks if op == "write" else seg.submit_read_blocks
                    else:
                        f = te.batch_transfer_sync_write if op == "write" else te.batch_transfer_sync_read
                        call = lambda: f(name, laddr, raddr, lens)  # noqa: E731
                        issue = te.batch_transfer_async_write if op == "write" else te.batch_transfer_async_read
                    call()  # untimed: routes, mappings
                    times = []
                    start = time.perf_counter()
                    while time.perf_counter() - start < args.duration or len(times) < 3:
                        t0 = time.perf_counter()
                        rc = call()
                        times.append(time.perf_counter() - t0)
                        if rc not in (None, 0):
                            sys.exit(f"{api} {op} {human(size)}: returned {rc}: {te.last_error}")
                    gbps = BATCH / (sorted(times)[len(times) // 2]) / 1e9
                    # CPU time to issue one batch: the submit call alone.
                    issued = []
                    for _ in range(3):
                        t0 = time.perf_counter()
                        if api == "layout":
                            tr = issue(local_layout, lids, remote_layout, rids)
                            issued.append(time.perf_counter() - t0)
                            tr.wait()
                        else:
                            b = issue(name, laddr, raddr, lens)
                            issued.append(time.perf_counter() - t0)
                            te.get_batch_transfer_status([b])
                    row = dict(
                        transport=args.transport, device=args.device or "host", api=api, op=op,
                        block=size, blocks=n, gb_per_s=round(gbps, 2), limit_gb_per_s=round(limit, 1),
                        ratio=round(gbps / limit, 3), issue_ms=round(min(issued) * 1e3, 3),
                        batch_p50_ms=round(sorted(times)[len(times) // 2] * 1e3, 3),
                    )
                    rows.append(row)
                    print(
                        f"{args.transport:9} {row['device']:7} {api:8} {op:5} {human(size):>5} x {n:6}: "
                        f"{gbps:8.1f} GB/s = {row['ratio']:.3f} x limit {limit:.0f} GB/s; "
                        f"issue {row['issue_ms']:.2f} ms, batch p50 {row['batch_p50_ms']:.2f} ms",
                        flush=True,
                    )
            engine.unregister_layout(local_layout)
            engine.unregister_layout(back_layout)
        if args.json:
            with open(args.json, "a") as out:
                for r in rows:
                    out.write(json.dumps(r) + "\n")
        te.close()
    finally:
        try:
            target.stdin.write("\n")
            target.stdin.flush()
        except OSError:
            pass
        target.wait(timeout=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--transports", default="tcp,shm", help="each one in turn (FERRY_TRANSPORTS of both sides)")
    ap.add_argument("--transport", help=argparse.SUPPRESS)
    ap.add_argument("--device", help="cuda:N: both pools in GPU memory (torch)")
    ap.add_argument("--sizes", default="4K,16K,64K,256K")
    ap.add_argument("--apis", default="layout,mooncake")
    ap.add_argument("--ops", default="write,read")
    ap.add_argument("--duration", type=float, default=1.0, help="seconds per row")
    ap.add_argument("--json", help="append the rows to this file")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.sizes = [parse_size(s) if not s.isdigit() else int(s) for s in args.sizes.split(",")]
    args.apis = args.apis.split(",")
    args.ops = args.ops.split(",")
    if args.serve:
        serve(args)
        return
    for t in args.transports.split(","):
        args.transport = t
        run(args)


if __name__ == "__main__":
    main()
