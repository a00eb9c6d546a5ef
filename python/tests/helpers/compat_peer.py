"""One side of the Mooncake compatibility script, written against Mooncake's
own Python API and run unchanged on either engine:

    python compat_peer.py ENGINE server
    python compat_peer.py ENGINE client SESSION_ID SERVER_INFO_JSON

ENGINE is "mooncake" (``from mooncake.engine import ...``) or "ferry"
(``from ferry import ...``). The server registers two 1 MiB buffers (the one
at the higher address first), prints {"session_id", "first", "second",
"len"} as one JSON line, then answers commands on stdin, one JSON line each:
"digest OFF LEN" (sha256 of bytes of its first buffer), "notifies" (what
get_notifies() returned, as [name, msg] pairs), "quit".

The client makes the calls serving stacks make, one row each, and prints
every row as one JSON line: {"row", "calls": {call: outcome}, "regions":
[[off, len, sha256 expected]...], "note", "error" (Ferry's last_error)}. Outcomes are normalised so that
the engines can be compared: 0, "<0" (a failure: Mooncake's and Ferry's
codes differ on purpose), "id" (a batch id > 0), or a value (True/False
for a check made in this process). The server's bytes for each region are
checked by the test, through the server.
"""

import ctypes
import hashlib
import json
import sys
import time

import numpy as np

ENGINE = sys.argv[1]
if ENGINE == "mooncake":
    import mooncake.engine as module
    from mooncake.engine import TransferEngine, TransferNotify
elif ENGINE == "ferry":
    import ferry.mooncake as module
    from ferry import TransferEngine, TransferNotify
else:
    raise SystemExit(f"unknown engine {ENGINE!r}: mooncake or ferry")

KiB, MiB = 1 << 10, 1 << 20
HOST = "127.0.0.1"


def start_engine():
    engine = TransferEngine()
    rc = engine.initialize(HOST, "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise SystemExit(f"initialize failed: {rc}")
    return engine


def server():
    engine = start_engine()
    a = np.zeros(MiB, dtype=np.uint8)
    b = np.zeros(MiB, dtype=np.uint8)
    # The higher address first: get_first_buffer_address must return it
    # (registration order), not the lowest address.
    first, second = (a, b) if a.ctypes.data > b.ctypes.data else (b, a)
    for buf in (first, second):
        if engine.register_memory(buf.ctypes.data, buf.nbytes) != 0:
            raise SystemExit("register_memory failed")
    print(json.dumps({
        "session_id": f"{HOST}:{engine.get_rpc_port()}",
        "first": first.ctypes.data, "second": second.ctypes.data, "len": MiB,
    }), flush=True)
    for line in sys.stdin:
        cmd = line.split()
        if not cmd:
            continue
        if cmd[0] == "digest":
            off, n = int(cmd[1]), int(cmd[2])
            print(json.dumps(hashlib.sha256(first[off:off + n].tobytes()).hexdigest()), flush=True)
        elif cmd[0] == "notifies":
            # Notifications arrive after the data; give a late one a moment.
            got = []
            for _ in range(50):
                got = [[n.name, n.msg] for n in engine.get_notifies()]
                if got:
                    break
                time.sleep(0.1)
            print(json.dumps(got), flush=True)
        elif cmd[0] == "quit":
            break
    engine.unregister_memory(second.ctypes.data)
    engine.unregister_memory(first.ctypes.data)


def outcome(rc):
    if rc == 0:
        return 0
    return "<0" if rc < 0 else "id"


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def client(session, info):
    remote, remote_len = info["first"], info["len"]
    engine = start_engine()
    Opcode = TransferEngine.TransferOpcode
    rng = np.random.default_rng(7)
    rows = []

    def row(name, calls, regions=(), note=""):
        # Ferry's message of the row's last failure (Mooncake has none).
        error = getattr(engine, "last_error", None)
        if error is not None:
            engine.last_error = None
        rows.append({"row": name, "calls": calls, "regions": [list(r) for r in regions], "note": note,
                     "error": error})
        print(json.dumps(rows[-1]), flush=True)

    def local(n, fill=None):
        buf = rng.integers(0, 256, n, dtype=np.uint8) if fill is None else np.full(n, fill, dtype=np.uint8)
        return buf, buf.ctypes.data

    # Registration, with and without Mooncake's `location` argument.
    src, src_addr = local(256 * KiB)
    back, back_addr = local(256 * KiB, 0)
    extra, extra_addr = local(64 * KiB)
    extra2, extra2_addr = local(64 * KiB)
    row("register_memory", {
        "register_memory(addr, len)": outcome(engine.register_memory(src_addr, src.nbytes)),
        "register_memory(addr, len, 'cpu:0')": outcome(engine.register_memory(back_addr, back.nbytes, "cpu:0")),
        "batch_register_memory(addrs, lens, '*')": outcome(
            engine.batch_register_memory([extra_addr, extra2_addr], [extra.nbytes, extra2.nbytes], "*")),
    })
    row("get_rpc_port", {"get_rpc_port() > 0": engine.get_rpc_port() > 0})

    # Plain sync writes and reads.
    off = 0
    rc_w = engine.transfer_sync_write(session, src_addr, remote + off, 64 * KiB)
    rc_r = engine.transfer_sync_read(session, back_addr, remote + off, 64 * KiB)
    row("transfer_sync_write/_read", {
        "transfer_sync_write": outcome(rc_w), "transfer_sync_read": outcome(rc_r),
        "read back equals": bool(np.array_equal(back[:64 * KiB], src[:64 * KiB])),
    }, [(off, 64 * KiB, sha(src[:64 * KiB].tobytes()))])

    # Zero length: a no-op success.
    row("zero length", {
        "transfer_sync_write(len 0)": outcome(engine.transfer_sync_write(session, src_addr, remote, 0)),
        "transfer_sync_read(len 0)": outcome(engine.transfer_sync_read(session, back_addr, remote, 0)),
    })

    # A batch with one zero-length entry: the others are written.
    off = 64 * KiB
    rc = engine.batch_transfer_sync_write(
        session, [src_addr, src_addr + 4 * KiB, src_addr + 8 * KiB],
        [remote + off, remote + off + 4 * KiB, remote + off + 8 * KiB], [4 * KiB, 0, 4 * KiB])
    row("batch with a zero-length entry", {"batch_transfer_sync_write": outcome(rc)}, [
        (off, 4 * KiB, sha(src[:4 * KiB].tobytes())),
        (off + 4 * KiB, 4 * KiB, sha(bytes(4 * KiB))),
        (off + 8 * KiB, 4 * KiB, sha(src[8 * KiB:12 * KiB].tobytes())),
    ])

    # The opcode forms: the class's enum and the module's names.
    off = 128 * KiB
    rc_w = engine.transfer_sync(session, src_addr + 16 * KiB, remote + off, 16 * KiB, Opcode.Write)
    back[:] = 0
    rc_r = engine.batch_transfer_sync(session, [back_addr], [remote + off], [16 * KiB], module.Read)
    row("opcodes", {
        "TransferEngine.TransferOpcode.Write": int(Opcode.Write),
        "TransferEngine.TransferOpcode.Read": int(Opcode.Read),
        "module Write is the class's": module.Write == Opcode.Write,
        "transfer_sync(.., Write)": outcome(rc_w),
        "batch_transfer_sync(.., Read)": outcome(rc_r),
        "read back equals": bool(np.array_equal(back[:16 * KiB], src[16 * KiB:32 * KiB])),
    }, [(off, 16 * KiB, sha(src[16 * KiB:32 * KiB].tobytes()))])

    # Async batches.
    off = 192 * KiB
    bid = engine.batch_transfer_async_write(session, [src_addr + 32 * KiB, src_addr + 40 * KiB],
                                            [remote + off, remote + off + 8 * KiB], [8 * KiB, 8 * KiB])
    status = engine.get_batch_transfer_status([bid]) if bid > 0 else None
    back[:] = 0
    rid = engine.batch_transfer_async(session, [back_addr], [remote + off], [16 * KiB], Opcode.Read)
    rstatus = engine.get_batch_transfer_status([rid]) if rid > 0 else None
    zid = engine.batch_transfer_async_write(session, [src_addr, src_addr], [remote + off, remote + off],
                                            [0, 0])
    zstatus = engine.get_batch_transfer_status([zid]) if zid > 0 else None
    row("async batches", {
        "batch_transfer_async_write": outcome(bid), "get_batch_transfer_status(write)": status,
        "batch_transfer_async(.., Read)": outcome(rid), "get_batch_transfer_status(read)": rstatus,
        "read back equals": bool(np.array_equal(back[:16 * KiB], src[32 * KiB:48 * KiB])),
        "batch_transfer_async_write(all len 0)": outcome(zid), "get_batch_transfer_status(len 0)": zstatus,
    }, [(off, 16 * KiB, sha(src[32 * KiB:48 * KiB].tobytes()))])

    # One submission polled to completion.
    off = 256 * KiB
    sid = engine.transfer_submit_write(session, src_addr + 48 * KiB, remote + off, 8 * KiB)
    final = None
    deadline = time.monotonic() + 30
    while sid > 0 and time.monotonic() < deadline:
        final = engine.transfer_check_status(sid)
        if final != 0:
            break
        time.sleep(0.001)
    row("transfer_submit_write/check_status", {
        "transfer_submit_write": outcome(sid), "transfer_check_status (final)": final,
    }, [(off, 8 * KiB, sha(src[48 * KiB:56 * KiB].tobytes()))])

    # Bytes in and out of local memory, a str as Mooncake's binding takes it.
    text = "hello, ferry and mooncake"
    rc_s = engine.write_bytes_to_buffer(extra_addr, text, len(text))
    got_s = engine.read_bytes_from_buffer(extra_addr, len(text))
    rc_b = engine.write_bytes_to_buffer(extra_addr + 64, b"raw bytes", 9)
    got_b = engine.read_bytes_from_buffer(extra_addr + 64, 9)
    row("write_bytes_to_buffer", {
        "write_bytes_to_buffer(str)": outcome(rc_s), "read back (str)": got_s == text.encode(),
        "write_bytes_to_buffer(bytes)": outcome(rc_b), "read back (bytes)": got_b == b"raw bytes",
    })

    # Managed buffers.
    maddr = engine.allocate_managed_buffer(64 * KiB)
    row("managed buffers", {
        "allocate_managed_buffer != 0": maddr != 0,
        "free_managed_buffer": outcome(engine.free_managed_buffer(maddr, 64 * KiB)) if maddr else None,
    })

    row("get_first_buffer_address", {
        "is the first registered": engine.get_first_buffer_address(session) == info["first"],
        "is the lowest address": engine.get_first_buffer_address(session) == min(info["first"], info["second"]),
    })

    # Local memory never registered, over tcp.
    off = 320 * KiB
    loose = rng.integers(0, 256, 8 * KiB, dtype=np.uint8)
    rc = engine.transfer_sync_write(session, loose.ctypes.data, remote + off, 8 * KiB)
    row("unregistered local memory over tcp", {"transfer_sync_write": outcome(rc)},
        [(off, 8 * KiB, sha(loose.tobytes()))] if rc == 0 else [(off, 8 * KiB, sha(bytes(8 * KiB)))])

    # Refusals: outside what the peer registered, a peer nobody serves.
    row("refusals", {
        "write past the peer's buffer": outcome(
            engine.transfer_sync_write(session, src_addr, remote + remote_len - 4 * KiB, 8 * KiB)),
        "write to unregistered peer memory": outcome(
            engine.transfer_sync_write(session, src_addr, 4096, 4 * KiB)),
    })
    row("send_probe", {"send_probe(peer)": outcome(engine.send_probe(session))})

    # A notification sent with a transfer reaches the target's get_notifies().
    off = 384 * KiB
    rc = engine.transfer_sync(session, src_addr + 64 * KiB, remote + off, 4 * KiB, Opcode.Write,
                              TransferNotify("kv-ready", "request 42"))
    row("notify", {"transfer_sync(.., notify)": outcome(rc)},
        [(off, 4 * KiB, sha(src[64 * KiB:68 * KiB].tobytes()))] if rc == 0 else [],
        note="expect-notify" if rc == 0 else "")

    # Asynchronous failures: 0 only where nothing could be submitted (the
    # list lengths differ, the peer cannot be opened); an address outside
    # the peer's memory gives a batch id whose status reads -1.
    def final_status(bid):
        if bid == 0 or bid >= 1 << 63:
            return None
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            st = engine.transfer_check_status(bid)
            if st != 0:
                return st
            time.sleep(0.001)
        return "pending"

    far = remote + remote_len + MiB
    oid = engine.batch_transfer_async_write(session, [src_addr], [far], [4 * KiB])
    gid = engine.batch_transfer_async_read(session, [back_addr], [far], [4 * KiB])
    sid = engine.transfer_submit_write(session, src_addr, far, 4 * KiB)
    row("asynchronous failures", {
        "batch_transfer_async_write(out of range)": outcome(oid),
        "transfer_check_status (out of range)": final_status(oid),
        "batch_transfer_async_read(out of range)": outcome(gid),
        "get_batch_transfer_status (out of range)": engine.get_batch_transfer_status([gid]) if gid else None,
        "transfer_submit_write(out of range)": outcome(sid),
        "transfer_check_status (submit, out of range)": final_status(sid),
        "batch_transfer_async_write(lengths differ)": outcome(
            engine.batch_transfer_async_write(session, [src_addr], [remote, remote], [8])),
        "batch_transfer_async_write(unknown peer)": outcome(
            engine.batch_transfer_async_write("127.0.0.1:1", [src_addr], [remote], [8])),
        "transfer_submit_write(unknown peer)": outcome(
            engine.transfer_submit_write("127.0.0.1:1", src_addr, remote, 8)),
    })

    # numpy integers as addresses and lengths (scalars and arrays).
    off = 448 * KiB
    rc_s = engine.transfer_sync_write(session, np.int64(src_addr + 80 * KiB), np.uint64(remote + off),
                                      np.int64(8))
    srcs = np.array([src_addr + 96 * KiB, src_addr + 100 * KiB], dtype=np.uint64)
    dsts = np.array([remote + off + 4 * KiB, remote + off + 8 * KiB], dtype=np.int64)
    rc_a = engine.batch_transfer_sync_write(session, srcs, dsts, np.array([4 * KiB, 4 * KiB], dtype=np.int64))
    row("numpy integers as addresses", {
        "transfer_sync_write(np.int64, np.uint64, np.int64(8))": outcome(rc_s),
        "batch_transfer_sync_write(numpy arrays)": outcome(rc_a),
    }, [(off, 8, sha(src[80 * KiB:80 * KiB + 8].tobytes())),
        (off + 4 * KiB, 4 * KiB, sha(src[96 * KiB:100 * KiB].tobytes())),
        (off + 8 * KiB, 4 * KiB, sha(src[100 * KiB:104 * KiB].tobytes()))])

    row("unregister", {
        "batch_unregister_memory": outcome(engine.batch_unregister_memory([extra_addr, extra2_addr])),
        "unregister_memory": outcome(engine.unregister_memory(src_addr)),
    })
    # Keep the buffers alive until every row ran.
    del src, back, extra, extra2, loose
    print(json.dumps({"done": True}), flush=True)


if __name__ == "__main__":
    if sys.argv[2] == "server":
        server()
    else:
        client(sys.argv[3], json.loads(sys.argv[4]))
