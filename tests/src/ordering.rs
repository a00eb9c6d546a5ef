//! The check that a batch's notification never reaches its peer before the
//! batch's data: the initiator submits many batches at once, each writing
//! its own region of the target's memory and carrying a notification that
//! names the region; the target, as each notification arrives, reads the
//! region and compares every byte with what was sent. Shared by the tests
//! of every transport (tests/notify.rs, tests/rdma.rs).

use ferry_core::{BatchStatus, Engine, Notify, NotifyStatus, Op, Request, SegmentId};
use std::time::{Duration, Instant};

/// How much the check moves.
#[derive(Clone, Copy, Debug)]
pub struct Shape {
    /// Batches, each with its notification.
    pub batches: usize,
    /// Requests per batch, each `size` bytes.
    pub per_batch: usize,
    pub size: u64,
    /// Register the initiator's source memory (false: the transport moves
    /// unregistered local memory).
    pub register_source: bool,
}

impl Shape {
    /// Bytes of target memory the check needs, from `remote`.
    pub fn bytes(&self) -> u64 {
        self.batches as u64 * self.per_batch as u64 * self.size
    }
}

fn pattern(len: usize, seed: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(29) ^ (seed as u8) ^ ((i >> 10) as u8))
        .collect()
}

/// Runs the check: `remote` is `shape.bytes()` of the target's registered
/// memory, zeroed; `read(addr, len)` reads target memory as the target's
/// application sees it (device memory through a copy). Panics with what
/// went wrong; returns how many notifications were checked.
pub fn notifications_follow_their_data(
    target: &Engine,
    initiator: &Engine,
    remote: u64,
    read: &(dyn Fn(u64, usize) -> Vec<u8> + Sync),
    shape: Shape,
) -> usize {
    let batch_bytes = shape.per_batch * shape.size as usize;
    let src = pattern(shape.bytes() as usize, shape.batches as u64);
    let base = src.as_ptr() as u64;
    if shape.register_source {
        initiator
            .register_memory(base, shape.bytes(), None)
            .unwrap();
    }
    let seg: SegmentId = initiator.open_segment(target.segment_name()).unwrap();
    // Leftovers from an earlier check on the same engines.
    target.take_notifies();
    let me = initiator.segment_name().to_string();
    let checked = std::thread::scope(|s| {
        let checker = s.spawn(|| {
            let mut seen = vec![false; shape.batches];
            let mut early = Vec::new();
            let deadline = Instant::now() + Duration::from_secs(120);
            let mut got = 0;
            while got < shape.batches {
                assert!(
                    Instant::now() < deadline,
                    "only {got} of {} notifications arrived",
                    shape.batches
                );
                let batch = target.take_notifies();
                if batch.is_empty() {
                    std::thread::sleep(Duration::from_micros(50));
                    continue;
                }
                for n in batch {
                    assert_eq!(
                        (n.peer.as_str(), n.name.as_str()),
                        (me.as_str(), "ordering")
                    );
                    let k: usize = std::str::from_utf8(&n.msg).unwrap().parse().unwrap();
                    assert!(!seen[k], "notification {k} arrived twice");
                    seen[k] = true;
                    got += 1;
                    let off = k * batch_bytes;
                    let now = read(remote + off as u64, batch_bytes);
                    if now[..] != src[off..off + batch_bytes] {
                        let first = (0..batch_bytes).find(|&i| now[i] != src[off + i]);
                        early.push((k, first));
                    }
                }
            }
            assert!(
                early.is_empty(),
                "{} of {} notifications arrived before their batch's data (batch, first \
                 byte not yet written): {:?}",
                early.len(),
                shape.batches,
                &early[..early.len().min(8)]
            );
            got
        });
        // Every batch submitted before any is waited for, so many are in
        // flight together and each one's data competes with the others'.
        let mut batches = Vec::new();
        for k in 0..shape.batches {
            let b = initiator.allocate_batch(shape.per_batch).unwrap();
            let reqs: Vec<Request> = (0..shape.per_batch)
                .map(|j| {
                    let off = (k * batch_bytes) as u64 + j as u64 * shape.size;
                    Request::new(Op::Write, base + off, seg, remote + off, shape.size)
                })
                .collect();
            let notify = Notify::new("ordering", k.to_string()).unwrap();
            initiator.submit_with_notify(b, &reqs, notify).unwrap();
            batches.push(b);
        }
        for b in batches {
            let st: BatchStatus = initiator.wait(b, Duration::from_secs(60)).unwrap();
            assert!(st.succeeded(), "{st:?}");
            assert_eq!(st.notify, Some(NotifyStatus::Delivered));
            initiator.free_batch(b).unwrap();
        }
        checker.join().unwrap()
    });
    if shape.register_source {
        initiator.unregister_memory(base).unwrap();
    }
    checked
}
