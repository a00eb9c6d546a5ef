"""Integers are addresses, whatever their type: ``int``, numpy integer
scalars (which also export an 8-byte buffer), 0-d integer arrays, and numpy
integer arrays as the address and length lists. Each kind writes to a peer
and the bytes that landed are checked, above all the old silent corruption:
an ``np.int64`` address with a length of 8 or less wrote the integer's own
8 bytes instead of the memory at the address."""

import ctypes

import numpy as np
import pytest

from ferry import TransferEngine
from ferry.lib import _ferry

KiB = 1 << 10

SCALARS = {
    "int": int,
    "np.int64": np.int64,
    "np.uint64": np.uint64,
    "0-d int64 array": lambda a: np.array(a, dtype=np.int64),
    "0-d uint64 array": lambda a: np.array(a, dtype=np.uint64),
}


@pytest.fixture(scope="module")
def pair():
    target, te = TransferEngine(), TransferEngine()
    assert target.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, target.last_error
    assert te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0, te.last_error
    remote = np.zeros(64 * KiB, dtype=np.uint8)
    local = (np.arange(64 * KiB, dtype=np.uint32) * 7 + 3).astype(np.uint8)
    assert target.register_memory(remote.ctypes.data, remote.nbytes) == 0, target.last_error
    assert te.register_memory(local.ctypes.data, local.nbytes) == 0, te.last_error
    yield te, target.get_session_id(), local, remote
    te.close()
    target.close()


@pytest.mark.parametrize("kind", list(SCALARS))
@pytest.mark.parametrize("length", [1, 8, 4096])
def test_a_scalar_of_each_kind_is_an_address(pair, kind, length):
    te, name, local, remote = pair
    remote[:] = 0
    wrap = SCALARS[kind]
    src, dst = local.ctypes.data + 100, remote.ctypes.data + 200
    assert te.transfer_sync_write(name, wrap(src), wrap(dst), wrap(length)) == 0, te.last_error
    assert remote[200:200 + length].tobytes() == local[100:100 + length].tobytes()
    assert not remote[:200].any() and not remote[200 + length:].any()
    # And back, into another place of local memory.
    back = np.zeros(length, dtype=np.uint8)
    assert te.register_memory(wrap(back.ctypes.data), wrap(back.nbytes)) == 0, te.last_error
    assert te.transfer_sync_read(name, wrap(back.ctypes.data), wrap(dst), length) == 0, te.last_error
    assert back.tobytes() == local[100:100 + length].tobytes()
    assert te.unregister_memory(wrap(back.ctypes.data)) == 0, te.last_error


def test_the_old_silent_corruption_is_gone(pair):
    # An np.int64 address and a length of 8: the 8 bytes at the address
    # land, not the 8 bytes of the integer.
    te, name, local, remote = pair
    remote[:] = 0
    src = np.int64(local.ctypes.data + 8)
    assert te.batch_transfer_sync_write(name, [src], [np.int64(remote.ctypes.data)], [np.int64(8)]) == 0
    assert remote[:8].tobytes() == local[8:16].tobytes()
    assert remote[:8].tobytes() != np.int64(src).tobytes()


@pytest.mark.parametrize("dtype", [np.int64, np.uint64])
@pytest.mark.parametrize("call", ["sync", "async"])
def test_numpy_arrays_as_the_lists(pair, dtype, call):
    te, name, local, remote = pair
    remote[:] = 0
    n, size = 16, 1000  # not a multiple of anything: each request lands apart
    srcs = np.arange(n, dtype=dtype) * 2048 + dtype(local.ctypes.data)
    dsts = np.arange(n, dtype=dtype)[::-1].copy() * 2048 + dtype(remote.ctypes.data)
    lengths = np.full(n, size, dtype=dtype)
    lengths[3] = 0  # zero length: succeeds, touches nothing (Mooncake's rule)
    if call == "sync":
        assert te.batch_transfer_sync_write(name, srcs, dsts, lengths) == 0, te.last_error
    else:
        bid = te.batch_transfer_async_write(name, srcs, dsts, lengths)
        assert bid > 0, te.last_error
        assert te.get_batch_transfer_status([bid]) == 0, te.last_error
    for i in range(n):
        s, d = i * 2048, (n - 1 - i) * 2048
        want = local[s:s + size].tobytes() if i != 3 else bytes(size)
        assert remote[d:d + size].tobytes() == want, f"request {i}"
        assert not remote[d + size:d + 2048].any()


def test_lists_after_a_longer_one_carry_their_own_requests_only(pair):
    # A call's lists go back to per-thread memory that the next call's
    # lists are read into: a shorter list there holds its own items only.
    te, name, local, remote = pair
    n = 16
    srcs = [local.ctypes.data + i * KiB for i in range(n)]
    dsts = [remote.ctypes.data + i * KiB for i in range(n)]
    assert te.batch_transfer_sync_write(name, srcs, dsts, [KiB] * n) == 0, te.last_error
    remote[:] = 0
    assert te.batch_transfer_sync_write(name, srcs[5:7], dsts[:2], [KiB, KiB]) == 0, te.last_error
    assert remote[:2 * KiB].tobytes() == local[5 * KiB:7 * KiB].tobytes()
    assert not remote[2 * KiB:].any()


def test_a_list_mixing_ints_numpy_scalars_and_buffer_objects(pair):
    te, name, local, remote = pair
    remote[:] = 0
    obj = np.full(64, 9, dtype=np.uint8)  # memory: resolved as a buffer
    srcs = [local.ctypes.data, np.uint64(local.ctypes.data + 64), obj]
    dsts = np.array([remote.ctypes.data, remote.ctypes.data + 64, remote.ctypes.data + 128], dtype=np.uint64)
    assert te.batch_transfer_sync_write(name, srcs, dsts, [64, 64, 64]) == 0, te.last_error
    assert remote[:128].tobytes() == local[:128].tobytes()
    assert (remote[128:192] == 9).all()


def test_what_is_not_an_integer_list_is_refused_with_the_reason(pair):
    te, name, local, remote = pair
    remote[:] = 0
    addr = local.ctypes.data
    cases = [
        (np.array([float(addr)]), "not a list of integers"),                 # floats are never rounded
        (np.array([1, 2], dtype=np.int32), "not a list of integers"),  # 4-byte items
        (np.array([[addr]], dtype=np.int64), "dimensions"),
        (np.array([addr] * 4, dtype=np.int64)[::2], "not a list of integers"),  # strided
    ]
    for srcs, words in cases:
        rc = te.batch_transfer_sync_write(name, srcs, [remote.ctypes.data] * len(srcs), [8] * len(srcs))
        assert rc < 0, srcs
        assert words in te.last_error, te.last_error
    assert te.batch_transfer_sync_write(name, [addr], [remote.ctypes.data], np.array([-1])) < 0
    assert "negative" in te.last_error, te.last_error
    assert te.batch_transfer_sync_write(name, [addr], [remote.ctypes.data], [2.0]) < 0
    assert not remote.any()


def test_int_list_is_the_one_rule():
    assert _ferry.int_list([1, np.int64(2), np.array(3, dtype=np.uint64)]) == [1, 2, 3]
    assert _ferry.int_list((4, 5)) == [4, 5]
    assert _ferry.int_list(np.array([6, 7], dtype=np.int64)) == [6, 7]
    assert _ferry.int_list(np.array([2**64 - 1], dtype=np.uint64)) == [2**64 - 1]
    assert _ferry.int_list(np.array([], dtype=np.int64)) == []
    import array

    assert _ferry.int_list(array.array("q", [8, 9])) == [8, 9]
    with pytest.raises(TypeError, match="item 1 is a float"):
        _ferry.int_list([1, 2.5])
    with pytest.raises(OverflowError, match="item 0"):
        _ferry.int_list([-1])
    with pytest.raises(OverflowError, match=r"item 2 \(-3\) is negative"):
        _ferry.int_list(np.array([1, 2, -3, 4], dtype=np.int64))
    # Lists read after a refused one, into the memory it held, hold their own items only.
    assert _ferry.int_list(np.array([7], dtype=np.int64)) == [7]
    assert _ferry.int_list(np.arange(3000, dtype=np.uint64)) == list(range(3000))
    with pytest.raises(TypeError, match="0-d array is one number"):
        _ferry.int_list(np.array(5, dtype=np.int64))
    with pytest.raises(TypeError, match="not a list"):
        _ferry.int_list("12")


def test_lists_of_plain_ints_read_in_one_pass_keep_the_rule():
    # The one-pass read of plain ints (addrs.rs) gives what the checked
    # path gives, at both ends of the range and for repeated objects, and
    # hands whatever is not a plain int in range to the checked path.
    big = [0x7F00_0000_0000 + 4096 * i for i in range(5000)]
    assert _ferry.int_list(big) == big
    assert _ferry.int_list(tuple(big)) == big
    assert _ferry.int_list([4096] * 7) == [4096] * 7
    assert _ferry.int_list([0, 2**64 - 1, 2**64 - 1, 1]) == [0, 2**64 - 1, 2**64 - 1, 1]
    assert _ferry.int_list([True, 3]) == [1, 3]

    class Sub(int):
        pass

    assert _ferry.int_list([Sub(5), 6]) == [5, 6]
    with pytest.raises(OverflowError, match="item 4999"):
        _ferry.int_list(big[:-1] + [2**64])
    with pytest.raises(OverflowError, match="item 3"):
        _ferry.int_list([1, 2, 3, -4096])
    with pytest.raises(TypeError, match="item 2 is a str"):
        _ferry.int_list([1, 2, "3"])
    assert _ferry.int_list([1, np.int64(2), 3]) == [1, 2, 3]


def test_a_cpu_tensor_of_addresses_if_torch_is_here():
    torch = pytest.importorskip("torch")
    if not hasattr(torch, "tensor") or getattr(torch, "__ferry_stub__", False):
        pytest.skip("torch is a stub here")
    assert _ferry.int_list(torch.tensor([1, 2], dtype=torch.int64)) == [1, 2]


def test_register_memory_takes_integer_kinds_and_buffers_stay_buffers(pair):
    te, name, local, remote = pair
    buf = (ctypes.c_uint8 * 32)()
    addr = ctypes.addressof(buf)
    for wrap in SCALARS.values():
        assert te.register_memory(wrap(addr), 32) == 0, te.last_error
        assert te.unregister_memory(wrap(addr)) == 0, te.last_error
    # A buffer object that is not an integer is memory.
    mem = np.zeros(32, dtype=np.uint8)
    assert te.register_memory(mem, 32) == 0, te.last_error
    assert te.unregister_memory(mem) == 0, te.last_error
