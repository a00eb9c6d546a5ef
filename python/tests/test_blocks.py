"""Transfers by block layout from Python: a pool registered once, blocks
named by index with numpy arrays (no Python loop per block), checked byte
for byte; out-of-range indices refused with nothing moved."""

import time

import numpy as np
import pytest

import ferry

BLOCK = 4096
BLOCKS = 256


@pytest.fixture(params=["tcp", "shm"])
def pools(request):
    target = ferry.Engine(transports=request.param)
    initiator = ferry.Engine(transports=request.param)
    remote = np.zeros(BLOCK * BLOCKS * 2, dtype=np.uint8)
    local = np.random.default_rng(5).integers(0, 256, BLOCK * BLOCKS, dtype=np.uint8)
    with target, initiator, target.register(remote), initiator.register(local):
        # The target's blocks every two blocks: nothing coalesces there.
        remote_layout = target.register_layout(remote, BLOCK, BLOCKS, stride=2 * BLOCK)
        local_layout = initiator.register_layout(local, BLOCK)
        assert local_layout.count == BLOCKS
        with initiator.open(target.segment_name) as seg:
            yield seg, local, remote, local_layout, remote_layout


def remote_block(remote, i):
    return remote[i * 2 * BLOCK : i * 2 * BLOCK + BLOCK]


def test_shuffled_blocks_by_numpy_indices_arrive_and_read_back(pools):
    seg, local, remote, local_layout, remote_layout = pools
    [published] = seg.layouts
    assert (published.id, published.block_size, published.stride, published.count) == (
        remote_layout.id, BLOCK, 2 * BLOCK, BLOCKS,
    )
    rng = np.random.default_rng(7)
    local_ids = rng.permutation(BLOCKS).astype(np.int64)
    remote_ids = rng.permutation(BLOCKS).astype(np.uint64)
    seg.write_blocks(local_layout, local_ids, published, remote_ids)
    for lid, rid in zip(local_ids, remote_ids):
        assert np.array_equal(remote_block(remote, int(rid)), local[lid * BLOCK : (lid + 1) * BLOCK])
    expected = local.copy()
    local[:] = 0
    with seg.submit_read_blocks(local_layout, local_ids, published, list(map(int, remote_ids))) as t:
        pass
    assert t.status().completed == BLOCKS
    assert np.array_equal(local, expected)


def test_an_index_out_of_range_moves_nothing(pools):
    seg, local, remote, local_layout, remote_layout = pools
    ids = np.arange(8, dtype=np.int64)
    bad = ids.copy()
    bad[5] = BLOCKS
    with pytest.raises(ferry.FerryError) as e:
        seg.write_blocks(local_layout, ids, remote_layout, bad)
    assert e.value.name == "OUT_OF_BOUNDS" and "block 5" in str(e.value)
    assert not remote.any()
    with pytest.raises(ferry.FerryError):
        seg.write_blocks(local_layout, ids, remote_layout, ids[:4])
    with pytest.raises(TypeError):
        seg.write_blocks(local_layout, ids.astype(np.float64), remote_layout, ids)


def test_issuing_a_large_batch_costs_no_python_per_block(pools):
    # Not a timed assertion: prints what issuing costs, for the record.
    seg, local, remote, local_layout, remote_layout = pools
    n = 16384
    ids = np.random.default_rng(1).integers(0, BLOCKS, n, dtype=np.int64)
    start = time.perf_counter()
    t = seg.submit_write_blocks(local_layout, ids, remote_layout, ids)
    issued = time.perf_counter() - start
    t.wait()
    print(f"issuing {n} blocks from numpy arrays: {issued * 1e3:.2f} ms")
