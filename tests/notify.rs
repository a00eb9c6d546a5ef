//! Notifications, zero-length requests, unregistered local memory and the
//! first registered buffer, through the real plugins.
//!
//! The ordering check (tests/src/ordering.rs) runs here over tcp, shm by
//! cross-memory attach, shm through mapped memory, and staging into a fake
//! GPU's memory; tests/rdma.rs runs it over the rdma plugin and the verbs
//! emulator.

use ferry_core::notify::{MAX_NOTIFY_MSG, NOTIFY_QUEUE_DEPTH};
use ferry_core::{Engine, EngineConfig, ErrorCode, Location, Notify, NotifyStatus, Op, Request};
use ferry_tests::ordering::{notifications_follow_their_data, Shape};
use std::time::Duration;

fn engine(transports: &str) -> Engine {
    let mut c = EngineConfig::default();
    c.set("transports", transports).unwrap();
    c.set("timeout_ms", "10000").unwrap();
    Engine::new(c).unwrap()
}

/// Reads target host memory as its application would.
fn read_host(addr: u64, len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    // SAFETY: the caller passes a range of a live Vec (or engine-allocated
    // memory) that the test keeps alive; the bytes are only copied.
    unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), len) };
    out
}

const SHAPE: Shape = Shape {
    batches: 64,
    per_batch: 4,
    size: 192 << 10,
    register_source: true,
};

#[test]
fn notifications_arrive_after_their_data_over_tcp_and_shm() {
    for (transports, register_source) in
        [("tcp", true), ("tcp", false), ("shm", true), ("shm", false)]
    {
        let target = engine(transports);
        let initiator = engine(transports);
        let shape = Shape {
            register_source,
            ..SHAPE
        };
        // Application memory: shm reaches it by cross-memory attach.
        let remote = vec![0u8; shape.bytes() as usize];
        let raddr = remote.as_ptr() as u64;
        target.register_memory(raddr, shape.bytes(), None).unwrap();
        let n = notifications_follow_their_data(&target, &initiator, raddr, &read_host, shape);
        assert_eq!(n, shape.batches, "{transports}");
        assert_eq!(target.notifies_dropped(), 0);
        drop(remote);
    }
}

#[test]
fn notifications_arrive_after_their_data_in_mapped_shared_memory() {
    let target = engine("shm");
    let initiator = engine("shm");
    // Memory the engine allocated: shm maps it into the initiator.
    let raddr = target.allocate_memory(SHAPE.bytes(), None).unwrap();
    let n = notifications_follow_their_data(&target, &initiator, raddr, &read_host, SHAPE);
    assert_eq!(n, SHAPE.batches);
    target.free_memory(raddr).unwrap();
}

#[test]
fn notifications_arrive_after_staged_data_in_device_memory() {
    let plugins = ferry_tests::fake_gpu_dir();
    let mk = |t: &str| {
        let mut c = EngineConfig::default();
        c.set("plugin_path", plugins.path().to_str().unwrap())
            .unwrap();
        c.set("transports", t).unwrap();
        Engine::new(c).unwrap()
    };
    for transports in ["tcp", "shm"] {
        let target = mk(transports);
        let initiator = mk(transports);
        let shape = Shape {
            batches: 24,
            ..SHAPE
        };
        let raddr = target
            .allocate_device(Location::Cuda(0), shape.bytes())
            .unwrap();
        let zeros = vec![0u8; shape.bytes() as usize];
        // SAFETY: zeros is a live Vec of that length; raddr device memory.
        unsafe { target.copy_memory(raddr, zeros.as_ptr() as u64, shape.bytes()) }.unwrap();
        target.register_memory(raddr, shape.bytes(), None).unwrap();
        // The CPU cannot touch the fake GPU's memory: read it by a copy.
        let read = |addr: u64, len: usize| {
            let mut out = vec![0u8; len];
            // SAFETY: out is a live Vec of len bytes; addr is inside the
            // registered device buffer.
            unsafe { target.copy_memory(out.as_mut_ptr() as u64, addr, len as u64) }.unwrap();
            out
        };
        let n = notifications_follow_their_data(&target, &initiator, raddr, &read, shape);
        assert_eq!(n, shape.batches, "{transports}");
    }
}

#[test]
fn a_failed_request_sends_no_notification_and_the_batch_says_why() {
    let target = engine("tcp");
    let initiator = engine("tcp");
    let remote = vec![0u8; 8192];
    target
        .register_memory(remote.as_ptr() as u64, 8192, None)
        .unwrap();
    let local = vec![1u8; 8192];
    let seg = initiator.open_segment(target.segment_name()).unwrap();
    // The target unregisters its memory after the initiator read its
    // descriptor: the write is refused at the target.
    target.unregister_memory(remote.as_ptr() as u64).unwrap();
    let b = initiator.allocate_batch(1).unwrap();
    let r = Request::new(
        Op::Write,
        local.as_ptr() as u64,
        seg,
        remote.as_ptr() as u64,
        8192,
    );
    initiator
        .submit_with_notify(b, &[r], Notify::new("n", "m").unwrap())
        .unwrap();
    let st = initiator.wait(b, Duration::from_secs(30)).unwrap();
    assert!(st.is_done() && st.failed == 1, "{st:?}");
    match st.notify {
        Some(NotifyStatus::Failed(e)) => {
            assert!(e.message.contains("not sent: request 0 failed"), "{e}")
        }
        other => panic!("{other:?}"),
    }
    assert!(target.take_notifies().is_empty());
}

#[test]
fn notify_misuse_is_refused_with_reasons() {
    let target = engine("tcp");
    let other = engine("tcp");
    let initiator = engine("tcp");
    let remote = vec![0u8; 4096];
    for e in [&target, &other] {
        e.register_memory(remote.as_ptr() as u64, 4096, None)
            .unwrap();
    }
    let local = vec![1u8; 4096];
    let a = initiator.open_segment(target.segment_name()).unwrap();
    let b = initiator.open_segment(other.segment_name()).unwrap();
    let w = |seg| {
        Request::new(
            Op::Write,
            local.as_ptr() as u64,
            seg,
            remote.as_ptr() as u64,
            4096,
        )
    };
    let n = || Notify::new("n", "m").unwrap();
    let batch = initiator.allocate_batch(4).unwrap();
    let e = initiator
        .submit_with_notify(batch, &[w(a), w(b)], n())
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::InvalidArgument);
    assert!(e.message.contains("one peer"), "{e}");
    let e = initiator.submit_with_notify(batch, &[], n()).unwrap_err();
    assert!(e.message.contains("send_notify"), "{e}");
    // Oversized messages say the limit.
    let e = Notify::new("n", vec![0u8; MAX_NOTIFY_MSG + 1]).unwrap_err();
    assert!(e.message.contains("at most 4096 bytes"), "{e}");
    // One notification per batch; then no more requests.
    initiator.submit_with_notify(batch, &[w(a)], n()).unwrap();
    let e = initiator.submit(batch, &[w(a)]).unwrap_err();
    assert!(e.message.contains("carries a notification"), "{e}");
    let st = initiator.wait(batch, Duration::from_secs(30)).unwrap();
    assert!(st.succeeded(), "{st:?}");
    initiator.free_batch(batch).unwrap();
    // Sent alone, and a zero-length transfer with a message.
    initiator
        .send_notify(b, Notify::new("alone", "x").unwrap())
        .unwrap();
    let zero = Request::new(Op::Write, 0, a, 0, 0);
    initiator
        .transfer_sync_with_notify(&[zero], Notify::new("zero", "").unwrap())
        .unwrap();
    let got: Vec<String> = other.take_notifies().into_iter().map(|n| n.name).collect();
    assert_eq!(got, ["alone"]);
    let got: Vec<String> = target.take_notifies().into_iter().map(|n| n.name).collect();
    assert_eq!(got, ["n", "zero"]);
}

#[test]
fn a_full_queue_refuses_the_newest_counts_it_and_tells_the_sender() {
    let target = engine("tcp");
    let initiator = engine("tcp");
    let seg = initiator.open_segment(target.segment_name()).unwrap();
    for i in 0..NOTIFY_QUEUE_DEPTH {
        initiator
            .send_notify(seg, Notify::new("q", i.to_string()).unwrap())
            .unwrap();
    }
    let e = initiator
        .send_notify(seg, Notify::new("q", "over").unwrap())
        .unwrap_err();
    assert_eq!(e.code, ErrorCode::Busy, "{e}");
    assert!(e.message.contains("queue is full"), "{e}");
    assert_eq!(target.notifies_dropped(), 1);
    let got = target.take_notifies();
    assert_eq!(got.len(), NOTIFY_QUEUE_DEPTH);
    // The oldest are kept, in order.
    assert_eq!(got[0].msg, b"0");
    assert_eq!(
        got[NOTIFY_QUEUE_DEPTH - 1].msg,
        (NOTIFY_QUEUE_DEPTH - 1).to_string().into_bytes()
    );
    initiator
        .send_notify(seg, Notify::new("q", "again").unwrap())
        .unwrap();
}

#[test]
fn zero_length_requests_succeed_and_the_others_are_written() {
    let target = engine("tcp");
    let initiator = engine("tcp");
    let remote = vec![0u8; 8192];
    target
        .register_memory(remote.as_ptr() as u64, 8192, None)
        .unwrap();
    let local = vec![9u8; 8192];
    initiator
        .register_memory(local.as_ptr() as u64, 8192, None)
        .unwrap();
    let seg = initiator.open_segment(target.segment_name()).unwrap();
    let (l, r) = (local.as_ptr() as u64, remote.as_ptr() as u64);
    // Alone, at any address.
    initiator
        .transfer_sync(&[Request::new(Op::Write, 0, seg, 0, 0)])
        .unwrap();
    initiator
        .transfer_sync(&[Request::new(Op::Read, 1, seg, u64::MAX, 0)])
        .unwrap();
    // In a batch: the others are written, every request completes.
    let b = initiator.allocate_batch(3).unwrap();
    initiator
        .submit(
            b,
            &[
                Request::new(Op::Write, l, seg, r, 4096),
                Request::new(Op::Write, l, seg, r, 0),
                Request::new(Op::Write, l + 4096, seg, r + 4096, 4096),
            ],
        )
        .unwrap();
    let st = initiator.wait(b, Duration::from_secs(30)).unwrap();
    assert!(st.succeeded() && st.completed == 3, "{st:?}");
    assert!(remote == local);
}

#[test]
fn unregistered_local_memory_moves_over_tcp_and_shm_and_rdma_would_say_register() {
    for transports in ["tcp", "shm"] {
        let target = engine(transports);
        let initiator = engine(transports);
        let remote = vec![0u8; 1 << 20];
        target
            .register_memory(remote.as_ptr() as u64, 1 << 20, None)
            .unwrap();
        let seg = initiator.open_segment(target.segment_name()).unwrap();
        let src: Vec<u8> = (0..1 << 20).map(|i| (i % 251) as u8).collect();
        let mut back = vec![0u8; 1 << 20];
        let r = remote.as_ptr() as u64;
        initiator
            .transfer_sync(&[Request::new(
                Op::Write,
                src.as_ptr() as u64,
                seg,
                r,
                1 << 20,
            )])
            .unwrap();
        assert!(
            remote == src,
            "{transports}: written from unregistered memory"
        );
        initiator
            .transfer_sync(&[Request::new(
                Op::Read,
                back.as_mut_ptr() as u64,
                seg,
                r,
                1 << 20,
            )])
            .unwrap();
        assert!(back == src, "{transports}: read into unregistered memory");
        // Memory that is not this process's is refused before any transport
        // sees it.
        let e = initiator
            .transfer_sync(&[Request::new(Op::Write, 0x10, seg, r, 16)])
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::OutOfBounds, "{e}");
        assert!(e.message.contains("not mapped memory"), "{e}");
        // The target still serves only what it registered.
        let e = initiator
            .transfer_sync(&[Request::new(
                Op::Write,
                src.as_ptr() as u64,
                seg,
                back.as_ptr() as u64,
                4096,
            )])
            .unwrap_err();
        assert_eq!(e.code, ErrorCode::OutOfBounds, "{e}");
        // Straddling the end of a registered local buffer is refused.
        initiator
            .register_memory(src.as_ptr() as u64, 4096, None)
            .unwrap();
        let e = initiator
            .transfer_sync(&[Request::new(Op::Write, src.as_ptr() as u64, seg, r, 8192)])
            .unwrap_err();
        assert!(e.message.contains("runs past its end"), "{e}");
    }
}

#[test]
fn the_first_buffer_is_the_first_registered_not_the_lowest() {
    let target = engine("tcp");
    let initiator = engine("tcp");
    let low = vec![0u8; 4096];
    let high = vec![0u8; 4096];
    let (lo, hi) = {
        let (a, b) = (low.as_ptr() as u64, high.as_ptr() as u64);
        (a.min(b), a.max(b))
    };
    target.register_memory(hi, 4096, None).unwrap();
    target.register_memory(lo, 4096, None).unwrap();
    let seg = initiator.open_segment(target.segment_name()).unwrap();
    assert_eq!(initiator.first_buffer(seg).unwrap(), Some((hi, 4096)));
    // Unregistered: the next oldest.
    target.unregister_memory(hi).unwrap();
    initiator.refresh_segment(seg).unwrap();
    assert_eq!(initiator.first_buffer(seg).unwrap(), Some((lo, 4096)));
}
