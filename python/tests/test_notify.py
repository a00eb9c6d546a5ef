"""Notifications (Mooncake's ``TransferNotify`` / ``get_notifies``), zero
length requests, unregistered local memory and ``get_first_buffer_address``,
through the Mooncake-compatible ``TransferEngine`` and ``ferry.Engine``."""

import numpy as np

import ferry
from ferry import TransferEngine, TransferNotify, TransferOpcode

CODES = {name: code for code, name in ferry.error_codes().items()}
MiB = 1 << 20


def engines():
    target, initiator = TransferEngine(), TransferEngine()
    assert target.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, target.last_error
    assert initiator.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, initiator.last_error
    return target, initiator, f"127.0.0.1:{target.get_rpc_port()}"


def test_a_notification_arrives_with_its_data_and_get_notifies_drains():
    target, te, name = engines()
    try:
        remote = np.zeros(64 * MiB, dtype=np.uint8)
        assert target.register_memory(remote.ctypes.data, remote.nbytes) == 0
        local = np.random.default_rng(1).integers(0, 256, 64 * MiB, dtype=np.uint8)
        for k in range(16):
            off = k * 4 * MiB
            bufs = [local.ctypes.data + off + j * MiB for j in range(4)]
            peers = [remote.ctypes.data + off + j * MiB for j in range(4)]
            rc = te.batch_transfer_sync(name, bufs, peers, [MiB] * 4, TransferOpcode.WRITE,
                                        TransferNotify("kv", f"blocks {k}"))
            assert rc == 0, te.last_error
            # The sync call returns once the target has the message; the
            # data it announces is there.
            got = target.get_notifies()
            assert got == [TransferNotify("kv", f"blocks {k}")]
            assert np.array_equal(remote[off:off + 4 * MiB], local[off:off + 4 * MiB])
        assert target.get_notifies() == []
        # transfer_sync with a notification, and a zero-length one.
        assert te.transfer_sync(name, local.ctypes.data, remote.ctypes.data, 16, TransferOpcode.WRITE,
                                TransferNotify("one", "x")) == 0
        assert te.transfer_sync(name, local.ctypes.data, remote.ctypes.data, 0, TransferOpcode.WRITE,
                                TransferNotify("zero", "")) == 0
        assert [n.name for n in target.get_notifies()] == ["one", "zero"]
        assert target.notifies_dropped() == 0
    finally:
        te.close()
        target.close()


def test_zero_length_is_a_no_op_success_and_a_batch_writes_the_others():
    target, te, name = engines()
    try:
        remote = np.zeros(8192, dtype=np.uint8)
        assert target.register_memory(remote.ctypes.data, remote.nbytes) == 0
        local = np.full(8192, 5, dtype=np.uint8)
        assert te.transfer_sync_write(name, local.ctypes.data, remote.ctypes.data, 0) == 0
        assert te.transfer_sync_read(name, local.ctypes.data, remote.ctypes.data, 0) == 0
        assert (remote == 0).all()
        rc = te.batch_transfer_sync_write(name, [local.ctypes.data] * 3,
                                          [remote.ctypes.data, remote.ctypes.data, remote.ctypes.data + 4096],
                                          [4096, 0, 4096])
        assert rc == 0, te.last_error
        assert (remote == 5).all()
    finally:
        te.close()
        target.close()


def test_first_buffer_address_is_the_first_registered():
    target, te, name = engines()
    try:
        a = np.zeros(4096, dtype=np.uint8)
        b = np.zeros(4096, dtype=np.uint8)
        low, high = sorted([a.ctypes.data, b.ctypes.data])
        assert target.register_memory(high, 4096) == 0
        assert target.register_memory(low, 4096) == 0
        assert te.get_first_buffer_address(name) == high
    finally:
        te.close()
        target.close()


def test_ferry_engine_notifications():
    with ferry.Engine(transports="tcp") as target, ferry.Engine(transports="tcp") as initiator:
        remote = target.allocate(MiB)
        seg = initiator.open(target.segment_name)
        src = np.full(MiB, 3, dtype=np.uint8)
        seg.write_batch([(src, remote.addr)], notify=("ready", b"\x00\x01"))
        seg.notify("alone", "text")
        got = target.take_notifies()
        assert [(n, m) for _, n, m in got] == [("ready", b"\x00\x01"), ("alone", b"text")]
        assert all(p == initiator.segment_name for p, _, _ in got)
        assert (np.frombuffer(remote.view(), dtype=np.uint8) == 3).all()
        assert target.notifies_dropped == 0
        try:
            seg.notify("n" * 300, "")
        except ferry.FerryError as e:
            assert "at most 256 bytes" in str(e)
        else:
            raise AssertionError("an oversized name was accepted")
