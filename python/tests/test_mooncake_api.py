"""The Mooncake-compatible TransferEngine in one process: return
conventions (0 / negative codes, batch ids never 0, 0 for a failed
allocation), the messages behind them, and every method serving stacks call."""

import logging

import numpy as np
import pytest

import ferry
from ferry import TransferEngine, TransferNotify, TransferOpcode

CODES = {name: code for code, name in ferry.error_codes().items()}
MiB = 1 << 20


@pytest.fixture
def pair():
    target, initiator = TransferEngine(), TransferEngine()
    assert target.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, target.last_error
    assert initiator.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, initiator.last_error
    remote = np.zeros(4 * MiB, dtype=np.uint8)
    assert target.register_memory(remote.ctypes.data, remote.nbytes) == 0
    name = f"127.0.0.1:{target.get_rpc_port()}"
    yield target, initiator, remote, name
    initiator.close()
    target.close()


def test_rpc_port_names_the_segment(pair):
    target, _, _, name = pair
    port = target.get_rpc_port()
    assert isinstance(port, int) and 0 < port < 65536
    assert target.get_session_id() == name


def test_sync_write_and_read(pair):
    _, te, remote, name = pair
    local = np.arange(MiB, dtype=np.uint32).view(np.uint8)[:MiB].copy()
    back = np.zeros(MiB, dtype=np.uint8)
    assert te.register_memory(local.ctypes.data, local.nbytes) == 0
    assert te.register_memory(back.ctypes.data, back.nbytes) == 0
    assert te.transfer_sync_write(name, local.ctypes.data, remote.ctypes.data + MiB, MiB) == 0
    assert np.array_equal(remote[MiB:2 * MiB], local)
    assert te.transfer_sync_read(name, back.ctypes.data, remote.ctypes.data + MiB, MiB) == 0
    assert np.array_equal(back, local)
    # The opcode form, and the hint pinning a transport.
    back[:] = 0
    assert te.transfer_sync(name, back.ctypes.data, remote.ctypes.data + MiB, MiB, TransferOpcode.READ) == 0
    assert np.array_equal(back, local)
    assert te.batch_transfer_sync(name, [back.ctypes.data], [remote.ctypes.data], [MiB], TransferOpcode.WRITE,
                                  transport_hint="tcp") == 0
    assert np.array_equal(remote[:MiB], local)
    # Ferry's extension: the engine's metrics count exactly what moved.
    moved = {op: sum(f["bytes"] for f in te.metrics()["flows"] if f["op"] == op) for op in ("read", "write")}
    assert moved == {"read": 2 * MiB, "write": 2 * MiB}


def test_async_batches(pair):
    _, te, remote, name = pair
    local = np.full(2 * MiB, 7, dtype=np.uint8)
    assert te.register_memory(local.ctypes.data, local.nbytes) == 0
    ids = [
        te.batch_transfer_async_write(name, [local.ctypes.data], [remote.ctypes.data], [MiB]),
        te.batch_transfer_async(name, [local.ctypes.data + MiB], [remote.ctypes.data + MiB], [MiB],
                                TransferOpcode.WRITE),
    ]
    assert all(i > 0 for i in ids)
    assert te.get_batch_transfer_status(ids) == 0
    assert (remote[:2 * MiB] == 7).all()
    # Single submission polled to completion: 1 done (0 while in flight).
    local[:] = 9
    b = te.transfer_submit_write(name, local.ctypes.data, remote.ctypes.data, MiB)
    assert b > 0
    status = 0
    for _ in range(100000):
        status = te.transfer_check_status(b)
        if status != 0:
            break
    assert status == 1
    assert (remote[:MiB] == 9).all()
    back = np.zeros(MiB, dtype=np.uint8)
    assert te.register_memory(back.ctypes.data, MiB) == 0
    r = te.batch_transfer_async_read(name, [back.ctypes.data], [remote.ctypes.data], [MiB])
    assert r > 0 and te.get_batch_transfer_status([r]) == 0
    assert (back == 9).all()


def test_failures_return_negative_codes_with_ferry_messages(pair, caplog):
    _, te, remote, name = pair
    # Unregistered local memory is fine over tcp (as in Mooncake); the
    # peer's memory must be registered.
    unregistered = np.ones(4096, dtype=np.uint8)
    assert te.transfer_sync_write(name, unregistered.ctypes.data, remote.ctypes.data, 4096) == 0
    assert (remote[:4096] == 1).all()
    with caplog.at_level(logging.ERROR, logger="ferry"):
        rc = te.transfer_sync_write(name, unregistered.ctypes.data, unregistered.ctypes.data, 4096)
    assert rc < 0 and rc in ferry.error_codes()
    assert "registered by segment" in te.last_error, te.last_error
    assert te.last_error in caplog.text
    # Outside what the peer registered: refused, nothing written.
    local = np.ones(4096, dtype=np.uint8)
    assert te.register_memory(local.ctypes.data, 4096) == 0
    rc = te.transfer_sync_write(name, local.ctypes.data, remote.ctypes.data + remote.nbytes, 4096)
    assert rc == CODES["OUT_OF_BOUNDS"], te.last_error
    # A segment nobody serves.
    assert te.transfer_sync_write("127.0.0.1:1", local.ctypes.data, 0, 4096) < 0
    # An asynchronous batch that fails before anything moves is a batch id
    # whose status reads -1, as Mooncake's (it checks in flight); 0 only
    # where Mooncake returns 0: the lists' lengths differ, or the peer
    # cannot be opened.
    bid = te.batch_transfer_async_write(name, [local.ctypes.data], [1], [4096])
    assert bid > 0 and "OUT_OF_BOUNDS" in te.last_error
    assert te.transfer_check_status(bid) == -1
    assert te.transfer_check_status(bid) == -1  # freed: unknown now, still -1
    bid = te.transfer_submit_write(name, local.ctypes.data, 1, 4096)
    assert bid > 0 and te.get_batch_transfer_status([bid]) == -1
    assert te.batch_transfer_async_write(name, [local.ctypes.data], [1, 2], [4096]) == 0
    assert "one of each per request" in te.last_error
    assert te.batch_transfer_async_read("127.0.0.1:1", [local.ctypes.data], [1], [4096]) == 0
    assert te.transfer_submit_write("127.0.0.1:1", local.ctypes.data, 1, 4096) == 0
    # Mismatched lists.
    assert te.batch_transfer_sync_write(name, [local.ctypes.data], [], [4096]) == CODES["INVALID_ARGUMENT"]
    # An oversized notification says the limit (test_notify.py has the rest).
    rc = te.transfer_sync(name, local.ctypes.data, remote.ctypes.data, 16, TransferOpcode.WRITE,
                          TransferNotify("n", "m" * 5000))
    assert rc == CODES["INVALID_ARGUMENT"] and "at most 4096 bytes" in te.last_error
    assert te.get_notifies() == []
    # Unknown batch.
    assert te.get_batch_transfer_status([123456]) == -1
    assert te.unregister_memory(12345) < 0


def test_initialize_errors():
    te = TransferEngine()
    assert te.get_rpc_port() == CODES["INVALID_ARGUMENT"]
    assert te.register_memory(4096, 4096) == CODES["INVALID_ARGUMENT"]
    assert "initialize" in te.last_error
    assert te.initialize("127.0.0.1", "http://127.0.0.1:8080/metadata", "tcp", "") == CODES["UNSUPPORTED"]
    assert "P2PHANDSHAKE" in te.last_error
    assert te.initialize("127.0.0.1:notaport", "P2PHANDSHAKE", "tcp", "") == CODES["INVALID_ARGUMENT"]
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == CODES["INVALID_ARGUMENT"]
    te.close()
    # An unreachable etcd does not stop initialize (the engine registers in
    # the background); looking a peer up names the member and the cause.
    te = TransferEngine()
    assert te.initialize("127.0.0.1", "127.0.0.1:1", "tcp", "") == 0, te.last_error
    assert te.get_first_buffer_address("peer") == 0
    assert "127.0.0.1:1 unreachable" in te.last_error
    te.close()


def test_fixed_port_and_device_filter():
    from conftest import free_port

    port = free_port()
    te = TransferEngine()
    # device_name filters NICs (an unknown one leaves none for RDMA; TCP
    # still works, as it goes where the kernel routes).
    assert te.initialize(f"127.0.0.1:{port}", "P2PHANDSHAKE", "tcp", "mlx5_0,mlx5_1") == 0, te.last_error
    assert te.get_rpc_port() == port
    other = TransferEngine()
    assert other.initialize(f"127.0.0.1:{port}", "P2PHANDSHAKE", "tcp", "") < 0  # port taken
    te.close()


def test_managed_buffers_and_bytes(pair):
    target, te, _, _ = pair
    addr = target.allocate_managed_buffer(MiB)
    assert addr != 0
    assert target.write_bytes_to_buffer(addr, b"hello ferry", 11) == 0
    assert target.read_bytes_from_buffer(addr, 11) == b"hello ferry"
    name = target.get_session_id()
    # A managed buffer is registered: a peer can read it at once.
    local = np.zeros(11, dtype=np.uint8)
    assert te.register_memory(local.ctypes.data, 11) == 0
    assert te.transfer_sync_read(name, local.ctypes.data, addr, 11) == 0
    assert local.tobytes() == b"hello ferry"
    assert te.get_first_buffer_address(name) != 0
    assert te.send_probe(name) == 0
    assert te.send_probe("127.0.0.1:1") != 0
    assert target.free_managed_buffer(addr, MiB) == 0
    assert target.free_managed_buffer(addr, MiB) == CODES["NOT_FOUND"]
    assert TransferEngine().allocate_managed_buffer(MiB) == 0


def test_objects_are_accepted_where_addresses_are(pair):
    # An extension: the buffer arguments also take arrays (resolved as by ferry.Engine).
    _, te, remote, name = pair
    local = np.full(MiB, 5, dtype=np.uint8)
    assert te.register_memory(local, local.nbytes) == 0
    assert te.transfer_sync_write(name, local, remote.ctypes.data, MiB) == 0
    assert (remote[:MiB] == 5).all()
    # Lists of addresses and lists mixing objects go the same way, in one
    # batch or in two.
    half = MiB // 2
    assert te.batch_transfer_sync_write(name, [local.ctypes.data, local.ctypes.data + half],
                                        [remote.ctypes.data + MiB, remote.ctypes.data + MiB + half],
                                        [half, half]) == 0
    assert (remote[MiB:2 * MiB] == 5).all()
    assert te.batch_transfer_sync_write(name, [local, local.ctypes.data], [remote.ctypes.data, 0],
                                        [16, 0]) == 0
    assert te.unregister_memory(local) == 0
    # Integers of any kind (numpy scalars, 0-d arrays) are addresses, never
    # memory: test_integer_addresses.py.


def test_a_listener_other_hosts_reach_needs_the_cluster_token(monkeypatch):
    # A host name listens on every interface: without FERRY_AUTH_TOKEN the
    # engine refuses to start, and says why. (Only binds; nothing is sent.)
    monkeypatch.delenv("FERRY_AUTH_TOKEN", raising=False)
    monkeypatch.delenv("FERRY_AUTH_TOKEN_FILE", raising=False)
    monkeypatch.delenv("FERRY_AUTH", raising=False)
    te = TransferEngine()
    assert te.initialize("ferry-node-a", "P2PHANDSHAKE", "tcp", "") < 0
    assert "token" in te.last_error.lower(), te.last_error
    monkeypatch.setenv("FERRY_AUTH_TOKEN", "a shared secret")
    te = TransferEngine()
    assert te.initialize("ferry-node-a", "P2PHANDSHAKE", "tcp", "") == 0, te.last_error
    assert te.get_session_id() == f"ferry-node-a:{te.get_rpc_port()}"
    te.close()
