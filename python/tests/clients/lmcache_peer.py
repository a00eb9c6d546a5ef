"""One side of LMCache 0.5.6's real ``mooncake_te`` transfer channel
(lmcache.v1.distributed.transfer_channel.impl.mooncake_te_impl), unedited,
with ``mooncake.engine`` resolving to Ferry (the venv's ferry-as-mooncake
.pth):

    python lmcache_peer.py server HOST PORT   # prints {"url"}; serves until stdin closes
    python lmcache_peer.py client HOST PORT SERVER_URL   # prints one JSON line of results
    python lmcache_peer.py init HOST PORT     # initialize only: {"ok"} or {"raised"}

Each side's L1 arena is a numpy buffer; the server's holds a known
pattern, which the client reads through LMCache's client and checks.
Listening on HOST (LMCache's ``listen_url``, e.g. 0.0.0.0), advertising
this host's routable address, as a deployment across hosts does.
"""

import json
import socket
import sys
import time

import numpy as np

import mooncake.engine
from lmcache.v1.distributed.internal_api import L1MemoryDesc
from lmcache.v1.distributed.transfer_channel.api import TransferChannelAddress
from lmcache.v1.distributed.transfer_channel.impl.mooncake_te_impl import (
    create_mooncake_te_transfer_channel_context,
)

SIZE = 1 << 20


def pattern():
    return (np.arange(SIZE, dtype=np.uint32) * 2654435761 >> 13).astype(np.uint8)


def advertised_ip():
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def context(arena, host, port):
    desc = L1MemoryDesc(ptr=arena.ctypes.data, size=arena.nbytes, align_bytes=4096)
    return create_mooncake_te_transfer_channel_context(
        desc, listen_url=f"{host}:{port}", advertise_url=f"{advertised_ip()}:{port}")


def wait(client, task):
    # Polled as LMCache's P2P adapter polls; bounded by the engine's own
    # timeouts (a batch always ends), not by a clock here.
    while True:
        result = client.query_read_status(task)
        if result.is_finished():
            return result.succeeded_mask
        time.sleep(0.001)


def main():
    role, host, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
    assert mooncake.engine.__name__ == "ferry.mooncake", mooncake.engine
    if role == "init":
        arena = np.zeros(SIZE, dtype=np.uint8)
        try:
            context(arena, host, port)
            print(json.dumps({"ok": True}), flush=True)
        except Exception as e:  # noqa: BLE001 - what LMCache raises is the result
            print(json.dumps({"raised": f"{type(e).__name__}: {e}"}), flush=True)
        return
    if role == "server":
        arena = pattern()
        ctx = context(arena, host, port)
        print(json.dumps({"url": ctx.advertise_url, "session": ctx.mooncake_te_engine.get_session_id()}),
              flush=True)
        sys.stdin.read()  # until the test closes stdin
        ctx.close()
        return
    server_url = sys.argv[4]
    arena = np.zeros(SIZE, dtype=np.uint8)
    ctx = context(arena, host, port)
    client = ctx.get_transfer_channel_client(server_url)
    # Objects of LMCache's sizes at scattered offsets, into other offsets.
    objs = [(0, 4096), (8192, 65536), (200000, 12345), (SIZE - 4096, 4096)]
    local = ctx.get_transfer_channel_address([(o + 0 if o < SIZE // 2 else o - 100000, n) for o, n in objs])
    remote = [TransferChannelAddress(offset=o, size=n) for o, n in objs]
    mask = wait(client, client.submit_read(local, remote))
    want = pattern()
    landed = all(
        np.array_equal(arena[la.offset:la.offset + la.size], want[o:o + n])
        for la, (o, n) in zip(local, objs)
    )
    # Out of the peer's arena: LMCache's failed result (Mooncake: a batch id
    # whose status reads -1), not an exception from submit_read.
    far = [TransferChannelAddress(offset=SIZE + 4096, size=4096)]
    try:
        bad_mask = wait(client, client.submit_read(ctx.get_transfer_channel_address([(0, 4096)]), far))
        bad = {"mask": bad_mask}
    except Exception as e:  # noqa: BLE001
        bad = {"raised": f"{type(e).__name__}: {e}"}
    print(json.dumps({"mask": mask, "landed": landed, "out_of_range": bad,
                      "session": ctx.mooncake_te_engine.get_session_id()}), flush=True)
    ctx.close()


if __name__ == "__main__":
    main()
