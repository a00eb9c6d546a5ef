"""The receiver of Mooncake's Transfer Engine quick start, on Ferry: only the
import differs (and the buffer info goes to stdout instead of a ZMQ socket).

    python mooncake_server.py [METADATA_SERVER] [PROTOCOL] [LOCAL_HOSTNAME]

Prints {"session_id", "ptr", "len"} as one JSON line, then answers commands
on stdin: "sha256" prints the digest of its buffer, "quit" cleans up.
"""

import hashlib
import json
import sys

import numpy as np

from ferry import TransferEngine


def main():
    METADATA_SERVER = sys.argv[1] if len(sys.argv) > 1 else "P2PHANDSHAKE"
    PROTOCOL = sys.argv[2] if len(sys.argv) > 2 else "tcp"
    HOSTNAME = sys.argv[3] if len(sys.argv) > 3 else "localhost"
    DEVICE_NAME = ""  # auto discovery if empty

    server_engine = TransferEngine()
    ret = server_engine.initialize(HOSTNAME, METADATA_SERVER, PROTOCOL, DEVICE_NAME)
    if ret != 0:
        raise RuntimeError(f"initialize failed: {ret} ({server_engine.last_error})")
    if METADATA_SERVER == "P2PHANDSHAKE":
        session_id = f"{HOSTNAME}:{server_engine.get_rpc_port()}"
    else:
        session_id = HOSTNAME  # with a metadata server, peers use local_hostname

    server_buffer = np.zeros(1024 * 1024, dtype=np.uint8)
    server_ptr = server_buffer.ctypes.data
    server_len = server_buffer.nbytes

    ret_value = server_engine.register_memory(server_ptr, server_len)
    if ret_value != 0:
        raise RuntimeError("Mooncake memory registration failed.")

    print(json.dumps({"session_id": session_id, "ptr": server_ptr, "len": server_len}), flush=True)

    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "sha256":
            print(hashlib.sha256(server_buffer.tobytes()).hexdigest(), flush=True)
        elif cmd == "quit":
            break

    ret_value = server_engine.unregister_memory(server_ptr)
    if ret_value != 0:
        raise RuntimeError("Mooncake memory deregistration failed.")


if __name__ == "__main__":
    main()
