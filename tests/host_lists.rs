//! Block lists over the host transports (issue 30): shm (mapped memory and
//! cross-memory attach) and tcp take a KV block list in one call; shuffled
//! 4 KiB blocks are written and read back byte for byte, and a list that
//! reaches memory the peer no longer has registered is refused by the
//! transport (and, over tcp, by the target) with nothing touched; one
//! refused for a key the peer replaced is retried once and lands, and one
//! the peer now registers only part of lands there, its other requests
//! failing each on its own.

use ferry_core::{BlockLayout, BlockTransfer, Engine, EngineConfig, Op};

const BLOCK: u64 = 4096;
const BLOCKS: u64 = 256;

fn engine(transports: &str) -> Engine {
    let mut c = EngineConfig::default();
    c.set("transports", transports).unwrap();
    c.set("timeout_ms", "5000").unwrap();
    Engine::new(c).expect("engine starts")
}

/// The target's pool: engine-allocated memory (shm maps it) or a vector
/// (cross-memory attach, tcp).
enum Pool {
    Allocated(u64),
    Vector(Vec<u8>),
}

impl Pool {
    fn addr(&self) -> u64 {
        match self {
            Pool::Allocated(a) => *a,
            Pool::Vector(v) => v.as_ptr() as u64,
        }
    }

    fn bytes(&self) -> &[u8] {
        match self {
            // SAFETY: the target engine's own allocation of 2 * BLOCK *
            // BLOCKS bytes, alive while the engine (dropped after the pool's
            // last use) is.
            Pool::Allocated(a) => unsafe {
                std::slice::from_raw_parts(*a as *const u8, (2 * BLOCK * BLOCKS) as usize)
            },
            Pool::Vector(v) => v,
        }
    }
}

struct Pair {
    target: Engine,
    initiator: Engine,
    pool: Pool,
    local: Vec<u8>,
    seg: u64,
    local_layout: u32,
    remote_layout: u32,
}

/// Two engines; the target's pool strided by two blocks (nothing
/// coalesces), the initiator's contiguous; layouts registered.
fn pair(transport: &str, allocate: bool) -> Pair {
    let target = engine(transport);
    let initiator = engine(transport);
    let len = 2 * BLOCK * BLOCKS;
    let pool = if allocate {
        Pool::Allocated(target.allocate_memory(len, None).unwrap())
    } else {
        let v = vec![0u8; len as usize];
        target
            .register_memory(v.as_ptr() as u64, len, None)
            .unwrap();
        Pool::Vector(v)
    };
    let local = ferry_tests::pattern((BLOCK * BLOCKS) as usize, 17);
    initiator
        .register_memory(local.as_ptr() as u64, local.len() as u64, None)
        .unwrap();
    let remote_layout = target
        .register_layout(BlockLayout {
            base: pool.addr(),
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
    Pair {
        target,
        initiator,
        pool,
        local,
        seg,
        local_layout,
        remote_layout,
    }
}

fn transfer(
    p: &Pair,
    op: Op,
    transport: &str,
    local: &[u64],
    remote: &[u64],
) -> ferry_core::Result<()> {
    p.initiator.transfer_blocks(&BlockTransfer {
        op,
        segment: p.seg,
        local: p.local_layout,
        local_ids: local,
        remote: p.remote_layout,
        remote_ids: remote,
        transport: Some(transport),
    })
}

fn remote_block(p: &Pair, id: u64) -> &[u8] {
    let at = (id * 2 * BLOCK) as usize;
    &p.pool.bytes()[at..at + BLOCK as usize]
}

#[test]
fn shuffled_4k_blocks_round_trip_as_lists_over_shm_and_tcp() {
    for (transport, allocate, key) in [
        ("shm", true, "map "),
        ("shm", false, "cma "),
        ("tcp", false, ""),
    ] {
        let mut p = pair(transport, allocate);
        let d = p.initiator.descriptor_of(p.seg).unwrap();
        let k = d.buffers[0].key(transport).unwrap();
        assert!(k.starts_with(key.as_bytes()), "{transport}: {k:?}");
        let (local_ids, remote_ids) = (
            ferry_tests::shuffled(BLOCKS, 3),
            ferry_tests::shuffled(BLOCKS, 11),
        );
        transfer(&p, Op::Write, transport, &local_ids, &remote_ids).unwrap();
        for (l, r) in local_ids.iter().zip(&remote_ids) {
            let at = (*l * BLOCK) as usize;
            assert!(
                remote_block(&p, *r) == &p.local[at..at + BLOCK as usize],
                "{transport} (allocate={allocate}): block {l} -> {r}"
            );
        }
        let expected = p.local.clone();
        p.local.fill(0);
        transfer(&p, Op::Read, transport, &local_ids, &remote_ids).unwrap();
        assert!(
            p.local == expected,
            "{transport} (allocate={allocate}): blocks read back differ"
        );
    }
}

#[test]
fn a_list_outside_the_peers_registration_is_refused_and_nothing_moves() {
    // The target unregisters its pool after the initiator read its
    // descriptor: the engine's view is stale, so the list reaches the
    // transport, whose own check (shm: the revoked registration; tcp: the
    // target's check of every block) must refuse it.
    for transport in ["shm", "tcp"] {
        let p = pair(transport, false);
        // Connected first (a read touches nothing there): shm tells
        // connected peers of an unregistration.
        transfer(&p, Op::Read, transport, &[0], &[0]).unwrap();
        p.target.unregister_memory(p.pool.addr()).unwrap();
        write_to_the_unregistered_pool_is_refused(&p, transport);
    }
}

#[test]
fn a_peer_that_connects_after_an_unregistration_still_cannot_write_there() {
    // As above, but the target unregisters before the initiator's first
    // transfer opens its connection: no revocation ever reaches that
    // connection, and the initiator's view of the segment is stale.
    for transport in ["shm", "tcp"] {
        let p = pair(transport, false);
        p.target.unregister_memory(p.pool.addr()).unwrap();
        write_to_the_unregistered_pool_is_refused(&p, transport);
    }
}

#[test]
fn a_list_refused_for_a_stale_key_is_retried_once_and_lands() {
    // vLLM's sleep and wake-up with lists: the target registers its pool
    // again at the same addresses after the initiator read its key. The
    // list (by layouts, then as a run of requests) is refused for the old
    // key, read again and submitted once more whole, and lands.
    for transport in ["shm", "tcp"] {
        let p = pair(transport, false);
        let len = 2 * BLOCK * BLOCKS;
        transfer(&p, Op::Read, transport, &[0], &[0]).unwrap();
        let again = || {
            p.target.unregister_memory(p.pool.addr()).unwrap();
            p.target.register_memory(p.pool.addr(), len, None).unwrap();
        };
        again();
        let (local_ids, remote_ids) = (
            ferry_tests::shuffled(BLOCKS, 5),
            ferry_tests::shuffled(BLOCKS, 7),
        );
        transfer(&p, Op::Write, transport, &local_ids, &remote_ids)
            .unwrap_or_else(|e| panic!("{transport}: the layouts' list was not retried: {e}"));
        for (l, r) in local_ids.iter().zip(&remote_ids) {
            let at = (*l * BLOCK) as usize;
            assert!(
                remote_block(&p, *r) == &p.local[at..at + BLOCK as usize],
                "{transport}: block {l} -> {r}"
            );
        }
        again();
        let requests: Vec<ferry_core::Request> = (0..BLOCKS)
            .map(|k| {
                ferry_core::Request::new(
                    Op::Read,
                    p.local.as_ptr() as u64 + k * BLOCK,
                    p.seg,
                    p.pool.addr() + remote_ids[k as usize] * 2 * BLOCK,
                    BLOCK,
                )
            })
            .collect();
        p.initiator
            .transfer_sync(&requests)
            .unwrap_or_else(|e| panic!("{transport}: the requests' list was not retried: {e}"));
        for (k, r) in remote_ids.iter().enumerate() {
            let at = k * BLOCK as usize;
            assert!(
                p.local[at..at + BLOCK as usize] == *remote_block(&p, *r),
                "{transport}: block {r} read into {k}"
            );
        }
    }
}

#[test]
fn a_list_the_peer_now_registers_in_part_fails_only_the_requests_outside() {
    // The target registers only the first half of its pool again. A list
    // of requests written to both halves is refused for the old key, and
    // the retry serves the blocks inside the new registration and fails
    // the others' requests, each with its own status. Requests go in
    // pairs adjacent on both sides (coalesced into one 8 KiB block of two
    // requests), as a run (submit_run) and, with one request from another
    // local buffer after them, the general way (plan, dispatch).
    for transport in ["shm", "tcp"] {
        for general in [false, true] {
            let p = pair(transport, false);
            let len = 2 * BLOCK * BLOCKS;
            transfer(&p, Op::Read, transport, &[0], &[0]).unwrap();
            p.target.unregister_memory(p.pool.addr()).unwrap();
            p.target
                .register_memory(p.pool.addr(), len / 2, None)
                .unwrap();
            let pairs = ferry_tests::shuffled(BLOCKS, 13);
            // Request k's 4 KiB slot in the pool, of 2 * BLOCKS.
            let slot = |k: u64| 2 * pairs[(k / 2) as usize] + k % 2;
            let mut requests: Vec<ferry_core::Request> = (0..BLOCKS)
                .map(|k| {
                    ferry_core::Request::new(
                        Op::Write,
                        p.local.as_ptr() as u64 + k * BLOCK,
                        p.seg,
                        p.pool.addr() + slot(k) * BLOCK,
                        BLOCK,
                    )
                })
                .collect();
            // The general way's extra request goes to the first half's
            // first pair of slots that no pair of requests takes.
            let free = (0..BLOCKS / 2)
                .find(|q| !pairs[..(BLOCKS / 2) as usize].contains(q))
                .unwrap();
            let other = ferry_tests::pattern(BLOCK as usize, 29);
            if general {
                p.initiator
                    .register_memory(other.as_ptr() as u64, BLOCK, None)
                    .unwrap();
                requests.push(ferry_core::Request::new(
                    Op::Write,
                    other.as_ptr() as u64,
                    p.seg,
                    p.pool.addr() + 2 * free * BLOCK,
                    BLOCK,
                ));
            }
            let what = format!("{transport} ({})", if general { "general" } else { "run" });
            let batch = p.initiator.allocate_batch(requests.len()).unwrap();
            p.initiator.submit(batch, &requests).unwrap();
            let st = p
                .initiator
                .wait(batch, std::time::Duration::from_secs(10))
                .unwrap();
            assert_eq!(st.pending, 0, "{what}: {st:?}");
            let inside = |k: u64| slot(k) < BLOCKS;
            let expected_failed = (0..BLOCKS).filter(|&k| !inside(k)).count();
            assert!(expected_failed > 0 && expected_failed < BLOCKS as usize);
            assert_eq!(st.failed, expected_failed, "{what}: {st:?}");
            for k in 0..BLOCKS {
                let status = p.initiator.request_status(batch, k as usize).unwrap();
                let at = (slot(k) * BLOCK) as usize;
                let landed = &p.pool.bytes()[at..at + BLOCK as usize];
                if inside(k) {
                    assert_eq!(status, ferry_core::RequestStatus::Completed, "{what}: {k}");
                    let from = (k * BLOCK) as usize;
                    assert!(
                        landed == &p.local[from..from + BLOCK as usize],
                        "{what}: request {k}'s block did not land"
                    );
                } else {
                    let ferry_core::RequestStatus::Failed(e) = status else {
                        panic!("{what}: request {k}, outside, is {status:?}");
                    };
                    assert_eq!(e.code, ferry_core::ErrorCode::OutOfBounds, "{what}: {e}");
                    assert!(e.message.contains("no longer registers"), "{what}: {e}");
                    assert!(landed.iter().all(|b| *b == 0), "{what}: {k} wrote");
                }
            }
            if general {
                let status = p.initiator.request_status(batch, BLOCKS as usize);
                assert_eq!(
                    status.unwrap(),
                    ferry_core::RequestStatus::Completed,
                    "{what}"
                );
                let at = (2 * free * BLOCK) as usize;
                assert!(
                    p.pool.bytes()[at..at + BLOCK as usize] == other[..],
                    "{what}"
                );
            }
            p.initiator.free_batch(batch).unwrap();
        }
    }
}

/// A write of every block into the (unregistered) pool fails as out of
/// bounds, and no byte of the pool changed.
fn write_to_the_unregistered_pool_is_refused(p: &Pair, transport: &str) {
    let ids: Vec<u64> = (0..BLOCKS).collect();
    let Err(e) = transfer(p, Op::Write, transport, &ids, &ids) else {
        panic!("{transport}: a list to an unregistered buffer completed");
    };
    assert_eq!(
        e.code,
        ferry_core::ErrorCode::OutOfBounds,
        "{transport}: {e}"
    );
    assert!(
        p.pool.bytes().iter().all(|b| *b == 0),
        "{transport}: a refused list wrote"
    );
}
