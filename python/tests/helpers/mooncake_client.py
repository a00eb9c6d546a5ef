"""The sender of Mooncake's Transfer Engine quick start and its batch
example, on Ferry: register, batch write, read back, verify.

    python mooncake_client.py SESSION_ID PTR LEN [METADATA_SERVER] [PROTOCOL] [LOCAL_HOSTNAME]

Prints the sha256 of what it wrote; exits non-zero on any failure.
"""

import hashlib
import sys

import numpy as np

from ferry import TransferEngine


def main():
    server_session_id, server_ptr, server_len = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    METADATA_SERVER = sys.argv[4] if len(sys.argv) > 4 else "P2PHANDSHAKE"
    PROTOCOL = sys.argv[5] if len(sys.argv) > 5 else "tcp"
    HOSTNAME = sys.argv[6] if len(sys.argv) > 6 else "localhost"
    DEVICE_NAME = ""

    client_engine = TransferEngine()
    ret = client_engine.initialize(HOSTNAME, METADATA_SERVER, PROTOCOL, DEVICE_NAME)
    assert ret == 0, client_engine.last_error

    # Four chunks of 256 KiB, each with its own bytes.
    num_chunks = 4
    chunk_size = server_len // num_chunks
    rng = np.random.default_rng(11)
    local_buffers = [rng.integers(0, 256, chunk_size, dtype=np.uint8) for _ in range(num_chunks)]
    local_addrs = [buf.ctypes.data for buf in local_buffers]
    lengths = [chunk_size] * num_chunks
    ret = client_engine.batch_register_memory(local_addrs, lengths)
    assert ret == 0, client_engine.last_error

    remote_addrs = [server_ptr + i * chunk_size for i in range(num_chunks)]
    ret = client_engine.batch_transfer_sync_write(server_session_id, local_addrs, remote_addrs, lengths)
    assert ret == 0, f"batch write failed: {ret} ({client_engine.last_error})"

    # Read it back into fresh buffers and compare.
    back = [np.zeros(chunk_size, dtype=np.uint8) for _ in range(num_chunks)]
    back_addrs = [b.ctypes.data for b in back]
    assert client_engine.batch_register_memory(back_addrs, lengths) == 0, client_engine.last_error
    ret = client_engine.batch_transfer_sync_read(server_session_id, back_addrs, remote_addrs, lengths)
    assert ret == 0, f"batch read failed: {ret} ({client_engine.last_error})"
    for i in range(num_chunks):
        assert np.array_equal(back[i], local_buffers[i]), f"chunk {i} differs after reading back"

    # The same again, asynchronously: write the chunks reversed, wait, read one back.
    batch_id = client_engine.batch_transfer_async_write(
        server_session_id, local_addrs[::-1], remote_addrs, lengths
    )
    assert batch_id != 0, client_engine.last_error
    assert client_engine.get_batch_transfer_status([batch_id]) == 0, client_engine.last_error
    assert client_engine.transfer_sync_read(server_session_id, back_addrs[0], remote_addrs[0], chunk_size) == 0
    assert np.array_equal(back[0], local_buffers[-1]), "async write did not land"
    # Restore the forward order for the server's digest.
    assert client_engine.batch_transfer_sync_write(server_session_id, local_addrs, remote_addrs, lengths) == 0

    assert client_engine.batch_unregister_memory(local_addrs + back_addrs) == 0
    print(hashlib.sha256(b"".join(b.tobytes() for b in local_buffers)).hexdigest(), flush=True)


if __name__ == "__main__":
    main()
