//! Transfers by block layout (KV-cache pools named by block index) and
//! block lists: through the example C plugin, which takes block lists
//! (ABI 1.4), and through tcp and shm, which take single requests.

use ferry_core::{BlockLayout, BlockTransfer, Engine, EngineConfig, ErrorCode, Op, Request};

const BLOCK: u64 = 4096;
const BLOCKS: u64 = 64;

fn engine(transports: &str, plugins: Option<&tempfile::TempDir>) -> Engine {
    let mut config = EngineConfig::default();
    if let Some(p) = plugins {
        config
            .set("plugin_path", p.path().to_str().unwrap())
            .unwrap();
    }
    config.set("transports", transports).unwrap();
    Engine::new(config).expect("engine starts")
}

struct Pools {
    target: Engine,
    initiator: Engine,
    remote: Vec<u8>,
    local: Vec<u8>,
    seg: u64,
    local_layout: u32,
    remote_layout: u32,
}

/// Two engines, a pool of BLOCKS blocks on each (strided by two blocks on
/// the target, so nothing coalesces there), layouts registered.
fn pools(transports: &str, plugins: Option<&tempfile::TempDir>) -> Pools {
    let target = engine(transports, plugins);
    let initiator = engine(transports, plugins);
    let remote = vec![0u8; (2 * BLOCK * BLOCKS) as usize];
    let local = ferry_tests::pattern((BLOCK * BLOCKS) as usize, 5);
    target
        .register_memory(remote.as_ptr() as u64, remote.len() as u64, None)
        .unwrap();
    initiator
        .register_memory(local.as_ptr() as u64, local.len() as u64, None)
        .unwrap();
    let remote_layout = target
        .register_layout(BlockLayout {
            base: remote.as_ptr() as u64,
            block_size: BLOCK,
            stride: 2 * BLOCK,
            count: BLOCKS,
        })
        .unwrap();
    let local_layout = initiator
        .register_layout(BlockLayout::contiguous(
            local.as_ptr() as u64,
            BLOCK,
            BLOCKS,
        ))
        .unwrap();
    let seg = initiator.open_segment(target.segment_name()).unwrap();
    Pools {
        target,
        initiator,
        remote,
        local,
        seg,
        local_layout,
        remote_layout,
    }
}

fn remote_block(p: &Pools, id: u64) -> &[u8] {
    let at = (id * 2 * BLOCK) as usize;
    &p.remote[at..at + BLOCK as usize]
}

fn local_block(p: &Pools, id: u64) -> &[u8] {
    let at = (id * BLOCK) as usize;
    &p.local[at..at + BLOCK as usize]
}

/// Writes every block to a shuffled place, checks each, reads them back
/// into a zeroed local pool by other indices, checks again.
fn shuffled_round_trip(p: &mut Pools) {
    let local_ids = ferry_tests::shuffled(BLOCKS, 3);
    let remote_ids = ferry_tests::shuffled(BLOCKS, 11);
    p.initiator
        .transfer_blocks(&BlockTransfer {
            op: Op::Write,
            segment: p.seg,
            local: p.local_layout,
            local_ids: &local_ids,
            remote: p.remote_layout,
            remote_ids: &remote_ids,
            transport: None,
        })
        .unwrap();
    for (l, r) in local_ids.iter().zip(&remote_ids) {
        assert!(
            remote_block(p, *r) == local_block(p, *l),
            "block {l} -> {r}"
        );
    }
    let expected = p.local.clone();
    p.local.fill(0);
    p.initiator
        .transfer_blocks(&BlockTransfer {
            op: Op::Read,
            segment: p.seg,
            local: p.local_layout,
            local_ids: &local_ids,
            remote: p.remote_layout,
            remote_ids: &remote_ids,
            transport: None,
        })
        .unwrap();
    assert!(p.local == expected, "blocks read back differ");
}

#[test]
fn shuffled_blocks_move_intact_through_a_plugin_that_takes_block_lists() {
    let plugins = ferry_tests::memcpy_plugin_dir();
    let mut p = pools("memcpy", Some(&plugins));
    shuffled_round_trip(&mut p);
}

#[test]
fn shuffled_blocks_move_intact_over_tcp_and_shm_as_single_requests() {
    for transport in ["tcp", "shm"] {
        let mut p = pools(transport, None);
        shuffled_round_trip(&mut p);
    }
}

#[test]
fn an_index_out_of_range_is_refused_and_nothing_moves() {
    let plugins = ferry_tests::memcpy_plugin_dir();
    let p = pools("memcpy", Some(&plugins));
    for (local_ids, remote_ids, side) in [
        (vec![0, 1, BLOCKS], vec![0, 1, 2], "local index"),
        (vec![0, 1, 2], vec![0, BLOCKS + 7, 2], "remote index"),
    ] {
        let e = p
            .initiator
            .transfer_blocks(&BlockTransfer {
                op: Op::Write,
                segment: p.seg,
                local: p.local_layout,
                local_ids: &local_ids,
                remote: p.remote_layout,
                remote_ids: &remote_ids,
                transport: None,
            })
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::OutOfBounds, "{e}");
        assert!(e.message.contains(side), "{e}");
    }
    assert!(p.remote.iter().all(|b| *b == 0), "a refused transfer wrote");
    // Unknown layouts and mismatched lengths say so.
    let e = p
        .initiator
        .transfer_blocks(&BlockTransfer {
            op: Op::Write,
            segment: p.seg,
            local: p.local_layout,
            local_ids: &[0],
            remote: 999,
            remote_ids: &[0],
            transport: None,
        })
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::NotFound, "{e}");
    let e = p
        .initiator
        .transfer_blocks(&BlockTransfer {
            op: Op::Write,
            segment: p.seg,
            local: p.local_layout,
            local_ids: &[0, 1],
            remote: p.remote_layout,
            remote_ids: &[0],
            transport: None,
        })
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidArgument, "{e}");
}

#[test]
fn a_layout_outside_registered_memory_is_refused_and_a_removed_one_is_gone() {
    let plugins = ferry_tests::memcpy_plugin_dir();
    let p = pools("memcpy", Some(&plugins));
    let e = p
        .target
        .register_layout(BlockLayout::contiguous(
            p.remote.as_ptr() as u64,
            BLOCK,
            2 * BLOCKS + 1,
        ))
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::OutOfBounds, "{e}");
    p.target.unregister_layout(p.remote_layout).unwrap();
    p.initiator.refresh_segment(p.seg).unwrap();
    let e = p
        .initiator
        .transfer_blocks(&BlockTransfer {
            op: Op::Write,
            segment: p.seg,
            local: p.local_layout,
            local_ids: &[0],
            remote: p.remote_layout,
            remote_ids: &[0],
            transport: None,
        })
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::NotFound, "{e}");
}

#[test]
fn scattered_requests_go_as_block_lists_and_each_keeps_its_status() {
    let plugins = ferry_tests::memcpy_plugin_dir();
    let p = pools("memcpy,tcp", Some(&plugins));
    // A second target, reached over tcp by hint, in the same batch.
    let other = engine("memcpy,tcp", Some(&plugins));
    let other_mem = vec![0u8; (BLOCK * 4) as usize];
    other
        .register_memory(other_mem.as_ptr() as u64, other_mem.len() as u64, None)
        .unwrap();
    let other_seg = p.initiator.open_segment(other.segment_name()).unwrap();
    let ids = ferry_tests::shuffled(BLOCKS, 7);
    let base_l = p.local.as_ptr() as u64;
    let base_r = p.remote.as_ptr() as u64;
    let mut reqs: Vec<Request> = ids
        .iter()
        .enumerate()
        .map(|(i, &r)| {
            Request::new(
                Op::Write,
                base_l + i as u64 * BLOCK,
                p.seg,
                base_r + r * 2 * BLOCK,
                BLOCK,
            )
        })
        .collect();
    let mut tcp = Request::new(
        Op::Write,
        base_l,
        other_seg,
        other_mem.as_ptr() as u64,
        BLOCK,
    );
    tcp.transport = Some("tcp".into());
    reqs.insert(10, tcp);
    let batch = p.initiator.allocate_batch(reqs.len()).unwrap();
    p.initiator.submit(batch, &reqs).unwrap();
    let status = p
        .initiator
        .wait(batch, std::time::Duration::from_secs(30))
        .unwrap();
    assert!(status.is_done() && status.succeeded(), "{status:?}");
    for i in 0..reqs.len() {
        assert_eq!(
            p.initiator.request_status(batch, i).unwrap(),
            ferry_core::RequestStatus::Completed,
            "request {i}"
        );
    }
    p.initiator.free_batch(batch).unwrap();
    for (i, &r) in ids.iter().enumerate() {
        assert!(
            remote_block(&p, r) == local_block(&p, i as u64),
            "request to block {r}"
        );
    }
    assert!(other_mem[..BLOCK as usize] == p.local[..BLOCK as usize]);
}
