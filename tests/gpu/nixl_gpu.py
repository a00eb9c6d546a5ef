#!/usr/bin/env python3
"""NIXL's agent API with torch cuda:0 tensors in two processes: ferry.nixl
(and, with --impl nixl, a real NIXL beside it, the same script), KV-shaped
transfers by prepared lists and index arrays, verified, with throughput.

    python tests/gpu/nixl_gpu.py run [--impl ferry|nixl] [--sizes 16K:16384,256K:1024]
        [--seconds 1] [--label NAME]

For each block size S with N blocks (default 16 KiB x 16,384 and 256 KiB x
1,024: 256 MiB a posting) both sides register a pool of N blocks of S
bytes on cuda:0 (VRAM) and prepare it as N descriptors, as vLLM's
NixlConnector prepares a layer; the target prints its metadata and pool
address, the initiator adds it and prepares the target's blocks.

Verified first: a WRITE of every local block, shuffled, to shuffled remote
blocks with a notification, and a READ of them back into a zeroed pool
(shuffled again) with a notification; both pools compared on the GPU; the
target must have the two notifications.

Then timed, each posting as vLLM's worker posts a read (make_prepped_xfer
with all N shuffled indices on both sides, transfer, check_xfer_state until
DONE, release_xfer_handle), READ and WRITE, for --seconds each. One line a
(size, op): GB/s of the median posting and where a posting's time goes
(make_prepped_xfer, transfer(), polling to DONE, in microseconds, medians),
and a second GB/s for one handle re-posted (transfer only). With ferry.nixl
also the route of the first block and the bytes each transport carried
(the engine's metrics): a posting that went another way shows there.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np
import torch


def parse_size(text: str) -> int:
    t = text.strip().upper()
    mult = {"K": 1 << 10, "M": 1 << 20}.get(t[-1:], 1)
    return int(t[:-1] if t[-1:] in "KM" else t) * mult


def sizes(text: str):
    out = []
    for part in text.split(","):
        s, n = part.split(":")
        out.append((parse_size(s), int(n)))
    return out


def agent_module(impl: str):
    if impl == "nixl":
        from nixl._api import nixl_agent, nixl_agent_config  # the real one, from PYTHONPATH
    else:
        from ferry.nixl import nixl_agent, nixl_agent_config
    return nixl_agent, nixl_agent_config


def make_agent(impl: str, name: str):
    nixl_agent, nixl_agent_config = agent_module(impl)
    return nixl_agent(name, nixl_agent_config(backends=["UCX"], capture_telemetry=False))


def block_rows(base: int, size: int, count: int):
    return [(base + i * size, size, 0) for i in range(count)]


def wait_done(agent, h, deadline_s=60.0):
    end = time.monotonic() + deadline_s
    while True:
        s = agent.check_xfer_state(h)
        if s == "DONE":
            return
        if s == "ERR":
            raise RuntimeError("transfer state ERR")
        if time.monotonic() > end:
            raise RuntimeError("transfer still PROC after 60 s")


def target(args):
    agent = make_agent(args.impl, "target")
    pools = {}
    for size, count in sizes(args.sizes):
        t = torch.zeros(size * count, dtype=torch.uint8, device="cuda:0")
        agent.register_memory(agent.get_reg_descs([(t.data_ptr(), t.numel(), 0, "")], "VRAM"))
        # As vLLM's P side: its own blocks prepared (Ferry publishes them as a layout).
        agent.prep_xfer_dlist("NIXL_INIT_AGENT", block_rows(t.data_ptr(), size, count), "VRAM")
        pools[size] = t
    print(json.dumps({"md": agent.get_agent_metadata().hex(),
                      "pools": {str(s): t.data_ptr() for s, t in pools.items()}}), flush=True)
    got = []
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "notifs":
            deadline = time.monotonic() + 30
            want = int(os.environ.get("NIXL_GPU_WANT_NOTIFS", "0"))
            while time.monotonic() < deadline:
                for _agent, msgs in agent.get_new_notifs().items():
                    got.extend(m.decode() for m in msgs)
                if len(got) >= want:
                    break
            print(json.dumps(sorted(got)), flush=True)
        elif cmd == "quit":
            break


def engine_bytes(agent):
    """Bytes per transport so far (ferry.nixl only)."""
    get = getattr(agent, "get_engine", None)
    if get is None:
        return None
    out = {}
    for f in get().metrics().get("flows", []):
        labels = f.get("labels", f)
        key = f"{labels.get('transport', '?')}/{labels.get('op', '?')}/{labels.get('memory', '?')}"
        out[key] = out.get(key, 0) + int(f.get("bytes", 0))
    return out


def initiator(args, info, ask):
    agent = make_agent(args.impl, "initiator")
    remote = agent.add_remote_agent(bytes.fromhex(info["md"]))
    rng = np.random.default_rng(7)
    ok = True
    rows = []
    for size, count in sizes(args.sizes):
        src = torch.randint(0, 256, (size * count,), dtype=torch.uint8, device="cuda:0")
        back = torch.zeros_like(src)
        for t in (src, back):
            agent.register_memory(agent.get_reg_descs([(t.data_ptr(), t.numel(), 0, "")], "VRAM"))
        lsrc = agent.prep_xfer_dlist("NIXL_INIT_AGENT", block_rows(src.data_ptr(), size, count), "VRAM")
        lback = agent.prep_xfer_dlist("NIXL_INIT_AGENT", block_rows(back.data_ptr(), size, count), "VRAM")
        rp = agent.prep_xfer_dlist(remote, block_rows(info["pools"][str(size)], size, count), "VRAM")
        lids, rids, bids = rng.permutation(count), rng.permutation(count), rng.permutation(count)
        torch.cuda.synchronize()
        # Verified: src[lids] -> remote[rids] -> back[bids]. These first
        # postings of each op and size pay what later ones reuse (the peer's
        # memory opened, the copy kernel loaded): timed apart, not counted.
        first = {}
        for op, local, ids, tag in (("WRITE", lsrc, lids, "w"), ("READ", lback, bids, "r")):
            t0 = time.perf_counter_ns()
            h = agent.make_prepped_xfer(op, local, ids, rp, rids, f"{tag}{size}".encode())
            agent.transfer(h)
            wait_done(agent, h)
            first[op] = round((time.perf_counter_ns() - t0) / 1e6, 2)
            agent.release_xfer_handle(h)
        torch.cuda.synchronize()
        same = torch.equal(src.view(count, size)[torch.as_tensor(lids, device="cuda:0")],
                           back.view(count, size)[torch.as_tensor(bids, device="cuda:0")])
        print(f"{args.label} {size >> 10} KiB x {count}: write then read back shuffled: "
              f"{'identical' if same else 'DIFFERENT'} (first postings: WRITE {first['WRITE']} ms, "
              f"READ {first['READ']} ms)", flush=True)
        ok &= bool(same)
        before = engine_bytes(agent)
        for op, local in (("READ", lback), ("WRITE", lsrc)):
            make, post, poll, total = [], [], [], []
            end = time.monotonic() + args.seconds
            while time.monotonic() < end or len(total) < 3:
                li, ri = rng.permutation(count), rng.permutation(count)
                t0 = time.perf_counter_ns()
                h = agent.make_prepped_xfer(op, local, li, rp, ri)
                t1 = time.perf_counter_ns()
                agent.transfer(h)
                t2 = time.perf_counter_ns()
                wait_done(agent, h)
                t3 = time.perf_counter_ns()
                agent.release_xfer_handle(h)
                make.append(t1 - t0)
                post.append(t2 - t1)
                poll.append(t3 - t2)
                total.append(t3 - t0)
            # One handle re-posted (what a caller that keeps its handle pays).
            h = agent.make_prepped_xfer(op, local, rng.permutation(count), rp, rng.permutation(count))
            again = []
            end = time.monotonic() + args.seconds / 2
            while time.monotonic() < end or len(again) < 3:
                t0 = time.perf_counter_ns()
                agent.transfer(h)
                wait_done(agent, h)
                again.append(time.perf_counter_ns() - t0)
            agent.release_xfer_handle(h)
            nbytes = size * count
            med = statistics.median(total)
            row = {"impl": args.label, "op": op, "block": size, "blocks": count, "postings": len(total),
                   "gbps": round(nbytes / med, 2), "gbps_reposted": round(nbytes / statistics.median(again), 2),
                   "make_us": round(statistics.median(make) / 1e3, 1), "transfer_us": round(statistics.median(post) / 1e3, 1),
                   "poll_us": round(statistics.median(poll) / 1e3, 1), "worst_ms": round(max(total) / 1e6, 2)}
            rows.append(row)
            print(f"{args.label} {op:5} {size >> 10:4} KiB x {count:5}: {row['gbps']:8.2f} GB/s a posting "
                  f"(make {row['make_us']} us, transfer() {row['transfer_us']} us, poll {row['poll_us']} us; "
                  f"worst {row['worst_ms']} ms; {len(total)} postings), re-posted handle {row['gbps_reposted']:8.2f} GB/s",
                  flush=True)
        after = engine_bytes(agent)
        if after is not None:
            moved = {k: v - (before or {}).get(k, 0) for k, v in after.items() if v != (before or {}).get(k, 0)}
            seg = agent.get_engine()
            route = None
            try:
                s = agent._remotes[remote.decode()]  # ferry.nixl's open segment (diagnostics only)
                route = s.route(src.data_ptr(), info["pools"][str(size)], size)
            except Exception as e:  # noqa: BLE001 (a diagnostic line)
                route = f"? ({e})"
            print(f"{args.label} {size >> 10} KiB: route of one block {route}; bytes by transport {moved}", flush=True)
            del seg
    got = ask("notifs")
    want = sorted(f"{p}{s}" for s, _ in sizes(args.sizes) for p in "wr")
    print(f"{args.label} notifications at the target: {got} (want {want})", flush=True)
    ok &= got == want
    print(json.dumps({"rows": rows, "ok": ok}), flush=True)
    return 0 if ok else 1


def json_reply(stream):
    """The next JSON line a peer wrote, passing on the lines before it:
    the real NIXL logs to stdout ("2026-12-05 ... NIXL INFO ...")."""
    while True:
        line = stream.readline()
        if not line:
            return line
        try:
            json.loads(line)
            return line
        except ValueError:
            sys.stderr.write(f"(peer) {line}")


def run(args):
    me = [sys.executable, os.path.abspath(__file__)]
    common = ["--impl", args.impl, "--sizes", args.sizes, "--seconds", str(args.seconds), "--label", args.label]
    env = dict(os.environ, NIXL_GPU_WANT_NOTIFS=str(2 * len(sizes(args.sizes))))
    tgt = subprocess.Popen(me + ["target"] + common, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        line = json_reply(tgt.stdout)
        if not line:
            print(f"FAIL {args.label}: the target did not start")
            return 1
        info = json.loads(line)

        def ask(cmd):
            tgt.stdin.write(cmd + "\n")
            tgt.stdin.flush()
            return json.loads(json_reply(tgt.stdout))

        rc = initiator(args, info, ask)
        tgt.stdin.write("quit\n")
        tgt.stdin.flush()
        tgt.wait(timeout=60)
        return rc
    finally:
        if tgt.poll() is None:
            tgt.kill()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("role", choices=["run", "target"])
    ap.add_argument("--impl", choices=["ferry", "nixl"], default="ferry")
    ap.add_argument("--sizes", default="16K:16384,256K:1024")
    ap.add_argument("--seconds", type=float, default=1.0)
    ap.add_argument("--label", default=None)
    args = ap.parse_args()
    args.label = args.label or args.impl
    if not torch.cuda.is_available():
        print("SKIP: torch sees no CUDA device")
        return 0
    return run(args) if args.role == "run" else target(args)


if __name__ == "__main__":
    sys.exit(main())
