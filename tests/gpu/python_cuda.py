#!/usr/bin/env python3
"""Torch CUDA tensors between two Python processes through the installed
`ferry` wheel, verified with checksums computed on the GPU.

    python tests/gpu/python_cuda.py run [--transport tcp|shm] [--size 64M] [--device cuda:0]
        [--transports all] [--alloc default|expandable] [--expect cuda-ipc]

`run` starts a `server` process (Mooncake-compatible API, as SGLang calls it:
initialize with P2PHANDSHAKE, register_memory(tensor.data_ptr(), nbytes))
and a `client` process that writes a GPU tensor into the server's GPU tensor
in a batch of chunks, reads it back into another GPU tensor, then does the
same with Ferry's own API (ferry.Engine: register(tensor), seg.write(...)).
Both sides compute a position-weighted checksum on the GPU; `run` exits 0
only if they agree and every step succeeded.

`--transport` is the protocol both APIs prefer (as SGLang passes it);
`--transports` what the engines run (FERRY_TRANSPORTS; `all`: every plugin,
the default being the preferred one alone). `--alloc expandable` makes
PyTorch's caching allocator map VMM chunks (expandable_segments:True).
`--expect T`: the route of the GPU tensors must be T (route() says so, and
the preference gives way to it: the log says so).
"""

import argparse
import json
import os
import subprocess
import sys

import torch

import ferry


def checksum(t: torch.Tensor) -> int:
    """Position-weighted sum of the bytes, on the tensor's device."""
    flat = t.view(torch.uint8).reshape(-1)
    w = torch.arange(flat.numel(), device=flat.device, dtype=torch.int64) % 65521 + 1
    return int((flat.to(torch.int64) * w).sum().item())


def pattern(n: int, device: str, seed: int) -> torch.Tensor:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, device=device, generator=g)


def server(args):
    te = ferry.TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", args.transport, "") == 0, te.last_error
    buf = torch.zeros(args.size, dtype=torch.uint8, device=args.device)
    assert te.register_memory(buf.data_ptr(), buf.numel()) == 0, te.last_error
    session = f"127.0.0.1:{te.get_rpc_port()}"
    print(json.dumps({"session_id": session, "ptr": buf.data_ptr(), "len": buf.numel()}), flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "checksum":
            torch.cuda.synchronize()
            print(checksum(buf), flush=True)
        elif cmd == "quit":
            break
    assert te.unregister_memory(buf.data_ptr()) == 0, te.last_error


def client(args):
    session, ptr, size = args.session, args.ptr, args.size
    # 1. The Mooncake-compatible API with raw data_ptr()s.
    te = ferry.TransferEngine()
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", args.transport, "") == 0, te.last_error
    src = pattern(size, args.device, 7)
    back = torch.zeros_like(src)
    assert te.register_memory(src.data_ptr(), size) == 0, te.last_error
    assert te.register_memory(back.data_ptr(), size) == 0, te.last_error
    chunks = 16
    step = size // chunks
    local = [src.data_ptr() + i * step for i in range(chunks)]
    remote = [ptr + i * step for i in range(chunks)]
    torch.cuda.synchronize()
    assert te.batch_transfer_sync_write(session, local, remote, [step] * chunks) == 0, te.last_error
    assert te.batch_transfer_sync_read(session, [back.data_ptr() + i * step for i in range(chunks)],
                                       remote, [step] * chunks) == 0, te.last_error
    assert torch.equal(back, src), "read back differs from what was written (compatible API)"
    first = checksum(src)

    # 2. Ferry's own API with the tensors themselves (location from tensor.device).
    with ferry.Engine(prefer=args.transport) as engine:
        src2 = pattern(size, args.device, 8)
        back2 = torch.zeros_like(src2)
        with engine.register(src2) as r, engine.register(back2), engine.open(session) as seg:
            assert r.location == str(torch.device(args.device)), r.location
            if args.expect:
                transport, reason = seg.route(src2, ptr)
                print(f"route: {transport} ({reason})", file=sys.stderr)
                assert transport == args.expect, f"route is {transport}, not {args.expect}: {reason}"
            seg.write(src2, ptr)
            seg.read(back2, ptr)
        assert torch.equal(back2, src2), "read back differs from what was written (ferry.Engine)"
    te.close()
    print(json.dumps({"first": first, "second": checksum(src2)}), flush=True)


def run(args):
    env = dict(os.environ)
    transports = args.transports or args.transport
    if transports == "all":
        env.pop("FERRY_TRANSPORTS", None)
    else:
        env["FERRY_TRANSPORTS"] = transports
    if args.alloc == "expandable":
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"
    if args.expect:
        env.setdefault("FERRY_LOG", "info")
    me = [sys.executable, os.path.abspath(__file__)]
    common = ["--transport", args.transport, "--size", str(args.size), "--device", args.device]
    if args.expect:
        common += ["--expect", args.expect]
    srv = subprocess.Popen(me + ["server"] + common, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        info = json.loads(srv.stdout.readline())
        out = subprocess.run(me + ["client", "--session", info["session_id"], "--ptr", str(info["ptr"])] + common,
                             capture_output=True, text=True, env=env, timeout=600)
        sys.stderr.write(out.stderr)
        if out.returncode != 0:
            print(f"FAIL client exited {out.returncode}")
            return 1
        sums = json.loads(out.stdout.strip().splitlines()[-1])
        # The engine logs its choice once per segment: "using cuda-ipc (...)".
        if args.expect and f"using {args.expect} (" not in out.stderr:
            print(f"FAIL with protocol {args.transport} preferred, the engine did not choose {args.expect}")
            return 1
        srv.stdin.write("checksum\n")
        srv.stdin.flush()
        at_server = int(srv.stdout.readline())
        ok = at_server == sums["second"]
        print(f"{args.transport} ({transports}, {args.alloc} allocator): {args.size >> 20} MiB GPU->GPU, client checksum {sums['second']}, "
              f"server checksum {at_server}: {'match' if ok else 'MISMATCH'}")
        srv.stdin.write("quit\n")
        srv.stdin.flush()
        srv.wait(timeout=60)
        return 0 if ok and srv.returncode == 0 else 1
    finally:
        if srv.poll() is None:
            srv.kill()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("role", choices=["run", "server", "client"])
    ap.add_argument("--transport", default="tcp")
    ap.add_argument("--size", type=lambda s: int(s[:-1]) << 20 if s.endswith("M") else int(s), default=64 << 20)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--transports")
    ap.add_argument("--alloc", choices=["default", "expandable"], default="default")
    ap.add_argument("--expect")
    ap.add_argument("--session")
    ap.add_argument("--ptr", type=int)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("SKIP: torch sees no CUDA device")
        return 0
    return {"run": run, "server": server, "client": client}[args.role](args) or 0


if __name__ == "__main__":
    sys.exit(main())
