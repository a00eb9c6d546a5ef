"""A make_prepped_xfer of 16,384 blocks by index arrays: the blocks land,
the native module receives the index arrays (one call per pair of
layouts), and the Python work does not grow with the number of blocks
(counted with a profiler hook: the same number of Python calls for 16
blocks as for 16,384)."""

import sys
import time

import numpy as np
import pytest

import ferry.nixl as nixl
from ferry._engine import Segment

BLOCK = 64


@pytest.fixture(scope="module")
def pair():
    target = nixl.nixl_agent("blocks-target")
    initiator = nixl.nixl_agent("blocks-initiator")
    yield target, initiator
    initiator.close()
    target.close()


def _setup(target, initiator, count):
    dst = np.zeros(count * BLOCK, dtype=np.uint8)
    src = (np.arange(count * BLOCK) % 251).astype(np.uint8)
    target.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    initiator.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    rows = lambda base: np.stack([base + np.arange(count, dtype=np.uint64) * BLOCK,  # noqa: E731
                                  np.full(count, BLOCK, np.uint64), np.zeros(count, np.uint64)], axis=1)
    target.prep_xfer_dlist("NIXL_INIT_AGENT", rows(dst.ctypes.data), "DRAM")  # publishes its layout
    initiator.add_remote_agent(target.get_agent_metadata())
    local = initiator.prep_xfer_dlist("NIXL_INIT_AGENT", rows(src.ctypes.data), "DRAM")
    remote = initiator.prep_xfer_dlist("blocks-target", rows(dst.ctypes.data), "DRAM")
    return src, dst, local, remote


def _move(initiator, local, remote, count):
    li = np.arange(count, dtype=np.int64)
    ri = li[::-1].copy()
    h = initiator.make_prepped_xfer("WRITE", local, li, remote, ri, b"")
    state = initiator.transfer(h)
    while state == "PROC":
        time.sleep(0.001)
        state = initiator.check_xfer_state(h)
    initiator.release_xfer_handle(h)
    return state


def _python_calls(f):
    """Python function calls made while running f (C calls not counted),
    excluding the polling loop's sleeps, which depend on timing."""
    calls = []

    def hook(frame, event, arg):
        if event == "call" and frame.f_code.co_name not in ("check_xfer_state", "_update", "_xfer", "done", "status", "_from", "_finish"):
            calls.append(frame.f_code.co_name)

    sys.setprofile(hook)
    try:
        result = f()
    finally:
        sys.setprofile(None)
    return result, calls


def test_16384_blocks_by_index_arrays(pair, monkeypatch):
    target, initiator = pair
    count = 16384
    src, dst, local, remote = _setup(target, initiator, count)
    seen = []
    real = Segment.submit_write_blocks

    def spy(self, local_layout, local_ids, remote_layout, remote_ids, **kw):
        seen.append((type(local_ids), len(local_ids), type(remote_ids), len(remote_ids)))
        return real(self, local_layout, local_ids, remote_layout, remote_ids, **kw)

    monkeypatch.setattr(Segment, "submit_write_blocks", spy)
    assert _move(initiator, local, remote, count) == "DONE"
    assert seen == [(np.ndarray, count, np.ndarray, count)], "one native call, handed the arrays"
    assert np.array_equal(dst.reshape(count, BLOCK), src.reshape(count, BLOCK)[::-1])


def test_python_work_does_not_grow_with_blocks(pair):
    target, initiator = pair
    small = _setup(target, initiator, 16)
    large = _setup(target, initiator, 16384)
    _, calls_small = _python_calls(lambda: _move(initiator, small[2], small[3], 16))
    state, calls_large = _python_calls(lambda: _move(initiator, large[2], large[3], 16384))
    assert state == "DONE"
    assert sorted(calls_large) == sorted(calls_small), "Python calls must not depend on the block count"
    assert len(calls_large) < 200


def test_lists_that_are_not_layouts_move_as_addresses(pair):
    target, initiator = pair
    dst = np.zeros(4 * BLOCK, dtype=np.uint8)
    src = (np.arange(4 * BLOCK) % 13 + 1).astype(np.uint8)
    target.register_memory([(dst.ctypes.data, dst.nbytes, 0, "")], "DRAM")
    initiator.register_memory([(src.ctypes.data, src.nbytes, 0, "")], "DRAM")
    initiator.add_remote_agent(target.get_agent_metadata())
    # Scattered blocks of two sizes: no fixed stride, so addresses.
    ls = [(src.ctypes.data, BLOCK, 0), (src.ctypes.data + 3 * BLOCK, BLOCK, 0), (src.ctypes.data + BLOCK, 2 * BLOCK, 0)]
    rs = [(dst.ctypes.data + 2 * BLOCK, BLOCK, 0), (dst.ctypes.data, BLOCK, 0), (dst.ctypes.data + BLOCK, 2 * BLOCK, 0)]
    lh = initiator.prep_xfer_dlist("NIXL_INIT_AGENT", ls, "DRAM")
    rh = initiator.prep_xfer_dlist(b"blocks-target", rs, "DRAM")
    h = initiator.make_prepped_xfer("WRITE", lh, [0, 1], rh, [0, 1])
    assert initiator._xfers[h._handle].groups is None
    state = initiator.transfer(h)
    while state == "PROC":
        time.sleep(0.001)
        state = initiator.check_xfer_state(h)
    assert state == "DONE"
    assert bytes(dst[2 * BLOCK:3 * BLOCK]) == bytes(src[:BLOCK])
    assert bytes(dst[:BLOCK]) == bytes(src[3 * BLOCK:])
    with pytest.raises(nixl.nixlInvalidParamError):
        initiator.make_prepped_xfer("WRITE", lh, [2], rh, [0])  # lengths differ


def test_blocks_group_by_pair_of_layouts_in_order():
    """_group: one request a (local, remote) layout pair, in the pairs'
    order, each keeping its blocks' order; large layout ids do not collide."""
    big = 1 << 40
    llay = np.array([7, big, 7, 7, big, 3], dtype=np.int64)
    rlay = np.array([1, 1, 2, 1, 1, big], dtype=np.int64)
    lblk = np.arange(6, dtype=np.int64)
    rblk = lblk + 100
    got = [(a, list(b), c, list(d)) for a, b, c, d in nixl._group(llay, lblk, rlay, rblk)]
    assert got == [(3, [5], big, [105]), (7, [0, 3], 1, [100, 103]), (7, [2], 2, [102]), (big, [1, 4], 1, [101, 104])]
    one = nixl._group(np.full(4, 9, np.int64), lblk[:4], np.full(4, 8, np.int64), rblk[:4])
    assert [(a, list(b), c, list(d)) for a, b, c, d in one] == [(9, [0, 1, 2, 3], 8, [100, 101, 102, 103])]
    assert nixl._group(llay[:0], lblk[:0], rlay[:0], rblk[:0]) == []
