//! Two engines moving bytes through the real TCP plugin.

use ferry_core::{Engine, EngineConfig, ErrorCode, Op, Request};
use std::time::Duration;

fn engine() -> Engine {
    let mut config = EngineConfig::default();
    config.set("transports", "tcp").unwrap();
    Engine::new(config).expect("engine starts")
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

#[test]
fn writes_and_reads_of_many_sizes_arrive_intact() {
    let target = engine();
    let initiator = engine();
    assert_eq!(initiator.transports(), vec!["tcp"]);
    const LEN: usize = 40 << 20;
    let remote = vec![0u8; LEN];
    let local = pattern(LEN, 7);
    let mut back = vec![0u8; LEN];
    target
        .register_memory(remote.as_ptr() as u64, LEN as u64, None)
        .unwrap();
    initiator
        .register_memory(local.as_ptr() as u64, LEN as u64, None)
        .unwrap();
    initiator
        .register_memory(back.as_mut_ptr() as u64, LEN as u64, None)
        .unwrap();
    let seg = initiator.open_segment(target.segment_name()).unwrap();

    for size in [1usize, 4096, 65536, 1 << 20, 16 << 20] {
        let count = (LEN / size).min(64);
        let reqs: Vec<Request> = (0..count)
            .map(|i| {
                Request::new(
                    Op::Write,
                    local.as_ptr() as u64 + (i * size) as u64,
                    seg,
                    remote.as_ptr() as u64 + (i * size) as u64,
                    size as u64,
                )
            })
            .collect();
        initiator.transfer_sync(&reqs).unwrap();
        let n = count * size;
        assert!(remote[..n] == local[..n], "write of {count} x {size}");
        let reads: Vec<Request> = reqs
            .iter()
            .map(|r| Request {
                op: Op::Read,
                local_addr: back.as_ptr() as u64 + (r.local_addr - local.as_ptr() as u64),
                ..r.clone()
            })
            .collect();
        initiator.transfer_sync(&reads).unwrap();
        assert!(back[..n] == local[..n], "read of {count} x {size}");
        back.iter_mut().for_each(|b| *b = 0);
    }
}

#[test]
fn out_of_bounds_requests_are_refused_and_touch_nothing() {
    let target = engine();
    let initiator = engine();
    let mut remote = vec![0xAAu8; 3 * 4096];
    let local = vec![0x55u8; 8192];
    // Register the middle page of the target's memory, and the last page as
    // a second, adjacent buffer; the first page is not registered.
    let mid = remote.as_mut_ptr() as u64 + 4096;
    target.register_memory(mid, 4096, None).unwrap();
    target.register_memory(mid + 4096, 4096, None).unwrap();
    initiator
        .register_memory(local.as_ptr() as u64, 8192, None)
        .unwrap();
    let seg = initiator.open_segment(target.segment_name()).unwrap();
    let l = local.as_ptr() as u64;

    let cases = [
        (
            Request::new(Op::Write, l, seg, mid - 1, 16),
            ErrorCode::OutOfBounds,
        ),
        // Straddles the two adjacent registered buffers: inside neither.
        (
            Request::new(Op::Write, l, seg, mid + 4000, 200),
            ErrorCode::OutOfBounds,
        ),
        (
            Request::new(Op::Read, l, seg, mid + 4090, 12),
            ErrorCode::OutOfBounds,
        ),
        (
            Request::new(Op::Write, l, seg, mid + 8192, 1),
            ErrorCode::OutOfBounds,
        ),
        (
            Request::new(Op::Write, l + 8000, seg, mid, 500),
            ErrorCode::OutOfBounds,
        ),
        (
            Request::new(Op::Write, 0x10, seg, mid, 16),
            ErrorCode::OutOfBounds,
        ),
        (
            Request::new(Op::Write, l, seg + 100, mid, 16),
            ErrorCode::NotFound,
        ),
    ];
    for (req, code) in cases {
        let err = initiator
            .transfer_sync(std::slice::from_ref(&req))
            .unwrap_err();
        assert_eq!(err.code, code, "{req:?}: {err}");
    }
    assert!(
        remote.iter().all(|b| *b == 0xAA),
        "target memory was touched"
    );
    // In range is fine.
    initiator
        .transfer_sync(&[Request::new(Op::Write, l, seg, mid, 4096)])
        .unwrap();
    assert!(remote[..4096].iter().all(|b| *b == 0xAA));
    assert!(remote[4096..8192].iter().all(|b| *b == 0x55));
    assert!(remote[8192..].iter().all(|b| *b == 0xAA));
    // Two requests that coalesce across the buffer boundary are not merged
    // into one that straddles it: each lands in its own buffer.
    initiator
        .transfer_sync(&[
            Request::new(Op::Write, l, seg, mid + 4096 - 8, 8),
            Request::new(Op::Write, l + 8, seg, mid + 4096, 8),
        ])
        .unwrap();
    assert!(remote[8192..8200].iter().all(|b| *b == 0x55));
    assert!(remote[8200..].iter().all(|b| *b == 0xAA));
}

#[test]
fn a_peer_that_is_not_listening_is_a_clear_error() {
    let initiator = engine();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    let err = initiator.open_segment(&addr.to_string()).unwrap_err();
    assert_eq!(err.code, ErrorCode::Connection, "{err}");
    assert!(err.message.contains("is the peer running?"), "{err}");
    let err = initiator
        .open_segment("no-such-host.invalid:1")
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::NotFound, "{err}");
}

#[test]
fn batches_report_per_request_status_and_cannot_be_freed_in_flight() {
    let target = engine();
    let initiator = engine();
    let remote = vec![0u8; 1 << 20];
    let local = pattern(1 << 20, 3);
    target
        .register_memory(remote.as_ptr() as u64, 1 << 20, None)
        .unwrap();
    initiator
        .register_memory(local.as_ptr() as u64, 1 << 20, None)
        .unwrap();
    let seg = initiator.open_segment(target.segment_name()).unwrap();
    let batch = initiator.allocate_batch(4).unwrap();
    let reqs: Vec<Request> = (0..4u64)
        .map(|i| {
            Request::new(
                Op::Write,
                local.as_ptr() as u64 + i * 1000,
                seg,
                remote.as_ptr() as u64 + i * 1000,
                1000,
            )
        })
        .collect();
    initiator.submit(batch, &reqs).unwrap();
    let status = initiator.wait(batch, Duration::from_secs(10)).unwrap();
    assert!(status.succeeded(), "{status:?}");
    assert_eq!(status.total, 4);
    assert_eq!(
        initiator.request_status(batch, 3).unwrap(),
        ferry_core::RequestStatus::Completed
    );
    assert!(initiator.request_status(batch, 4).is_err());
    // Full batch.
    assert_eq!(
        initiator.submit(batch, &reqs[..1]).unwrap_err().code,
        ErrorCode::InvalidArgument
    );
    initiator.free_batch(batch).unwrap();
    assert_eq!(
        initiator.batch_status(batch).unwrap_err().code,
        ErrorCode::NotFound
    );
    assert!(remote[..4000] == local[..4000]);
}

#[test]
fn the_c_plugin_carries_a_real_transfer_between_engines_of_one_process() {
    let plugins = ferry_tests::memcpy_plugin_dir();
    let engine_with_c_plugin = || {
        let mut config = EngineConfig::default();
        config
            .set("plugin_path", plugins.path().to_str().unwrap())
            .unwrap();
        config.set("transports", "memcpy,tcp").unwrap();
        Engine::new(config).unwrap()
    };
    let target = engine_with_c_plugin();
    let initiator = engine_with_c_plugin();
    assert_eq!(initiator.transports(), vec!["memcpy", "tcp"]);
    let mut remote = vec![0u8; 1 << 20];
    let local = pattern(1 << 20, 9);
    let mut back = vec![0u8; 1 << 20];
    let guard_page = remote.len() - 4096;
    remote[guard_page..].fill(0xEE);
    target
        .register_memory(remote.as_mut_ptr() as u64, guard_page as u64, None)
        .unwrap();
    for b in [local.as_ptr() as u64, back.as_mut_ptr() as u64] {
        initiator.register_memory(b, 1 << 20, None).unwrap();
    }
    let seg = initiator.open_segment(target.segment_name()).unwrap();
    let r = remote.as_ptr() as u64;
    let route = initiator
        .route(seg, local.as_ptr() as u64, r, 4096)
        .unwrap();
    assert_eq!(route.transport, "memcpy", "{}", route.reason);
    assert_eq!(route.scope, ferry_core::Scope::SameProcess);
    assert!(
        route.reason.contains("copies within this process"),
        "{}",
        route.reason
    );

    let n = guard_page as u64;
    initiator
        .transfer_sync(&[Request::new(Op::Write, local.as_ptr() as u64, seg, r, n)])
        .unwrap();
    assert!(remote[..guard_page] == local[..guard_page]);
    initiator
        .transfer_sync(&[Request::new(Op::Read, back.as_mut_ptr() as u64, seg, r, n)])
        .unwrap();
    assert!(back[..guard_page] == local[..guard_page]);
    // Past the registered range: refused by the engine before the plugin...
    let err = initiator
        .transfer_sync(&[Request::new(
            Op::Write,
            local.as_ptr() as u64,
            seg,
            r + n - 8,
            16,
        )])
        .unwrap_err();
    assert_eq!(err.code, ErrorCode::OutOfBounds);
    assert!(remote[guard_page..].iter().all(|b| *b == 0xEE));
    // ...and a hint that names the C plugin still goes through it.
    let mut hinted = Request::new(Op::Write, local.as_ptr() as u64, seg, r, 64);
    hinted.transport = Some("memcpy".into());
    initiator.transfer_sync(&[hinted]).unwrap();
}

/// vLLM's sleep and wake-up over TCP: the target registers the same
/// addresses again and again with writes in flight; nothing submitted
/// after a re-registration fails.
#[test]
fn registering_the_same_memory_again_fails_nothing_after_it() {
    let target = engine();
    let initiator = std::sync::Arc::new(engine());
    let seen = ferry_tests::reregister::register_again_under_load(&target, &initiator, 12);
    assert_eq!(seen.swaps, 12);
}
