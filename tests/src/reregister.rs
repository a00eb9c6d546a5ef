//! Registering the same addresses again under load (vLLM's sleep and
//! wake-up, a weight update): the target unregisters a buffer of its
//! application memory and registers the same addresses again, over and
//! over, while initiator threads keep batches of writes in flight to it.
//! The peer's transports refuse the old registration's key for good; the
//! engine must read the peer's descriptor again and retry, so that nothing
//! submitted after a re-registration fails. Shared by the tests of every
//! transport (tests/shm.rs, tests/data_path.rs, tests/rdma.rs).
//!
//! Nothing is timed: a batch counts as clean when no re-registration began
//! between just before its submission and its completion (counters read on
//! both sides), and every clean batch must succeed; one that overlapped a
//! re-registration may fail, with FERRY_ERR_OUT_OF_BOUNDS only.

use ferry_core::{Engine, ErrorCode, Op, Request};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// The target's buffer.
const LEN: u64 = 4 << 20;
/// Requests per batch: small and large by turns, each in its own region.
const PER_BATCH: u64 = 8;
const REGION: u64 = LEN / PER_BATCH;
/// No batch should take this long; one that does is reported, not waited
/// for forever.
const STUCK: Duration = Duration::from_secs(60);

/// What the scenario saw.
#[derive(Debug, Default)]
pub struct Outcome {
    /// Re-registrations done.
    pub swaps: usize,
    /// Batches no re-registration overlapped: every one succeeded.
    pub clean: usize,
    /// Batches that overlapped one, and of those, how many failed.
    pub overlapped: usize,
    pub overlapped_failed: usize,
    /// What the first of those said.
    pub first_failure: Option<String>,
}

/// Re-registrations begun and completed, as the writers read them.
#[derive(Default)]
struct Swaps {
    begun: AtomicU64,
    done: AtomicU64,
}

/// Runs the scenario: `target` and `initiator` are engines of this process
/// that reach each other by the transport under test only. Panics with
/// what went wrong.
pub fn register_again_under_load(
    target: &Engine,
    initiator: &Arc<Engine>,
    swaps: usize,
) -> Outcome {
    let remote = vec![0u8; LEN as usize];
    let raddr = remote.as_ptr() as u64;
    target.register_memory(raddr, LEN, None).unwrap();
    let local = crate::pattern(LEN as usize, 31);
    initiator
        .register_memory(local.as_ptr() as u64, LEN, None)
        .unwrap();
    let seg = initiator.open_segment(target.segment_name()).unwrap();
    let laddr = local.as_ptr() as u64;
    let reqs: Vec<Request> = (0..PER_BATCH)
        .map(|k| {
            let len = if k % 2 == 0 { 4 << 10 } else { 256 << 10 };
            Request::new(Op::Write, laddr + k * REGION, seg, raddr + k * REGION, len)
        })
        .collect();
    initiator.transfer_sync(&reqs).unwrap();

    let state = Arc::new(Swaps::default());
    let stop = Arc::new(AtomicBool::new(false));
    let batches = Arc::new(AtomicU64::new(0));
    let writers: Vec<_> = (0..2)
        .map(|_| {
            let (e, state, stop, batches) = (
                initiator.clone(),
                state.clone(),
                stop.clone(),
                batches.clone(),
            );
            let reqs = reqs.clone();
            std::thread::spawn(move || write_until(&e, &reqs, &state, &stop, &batches))
        })
        .collect();

    let mut outcome = Outcome::default();
    for swap in 0..swaps {
        // Let a few batches start first, so that some are in flight.
        let seen = batches.load(Ordering::SeqCst);
        while batches.load(Ordering::SeqCst) < seen + 2 {
            assert!(
                writers.iter().all(|w| !w.is_finished()),
                "a writer stopped early"
            );
            std::thread::sleep(Duration::from_millis(1));
        }
        state.begun.fetch_add(1, Ordering::SeqCst);
        target.unregister_memory(raddr).unwrap();
        target.register_memory(raddr, LEN, None).unwrap();
        state.done.fetch_add(1, Ordering::SeqCst);
        // The first write after the re-registration succeeds.
        let first = Request::new(Op::Write, laddr, seg, raddr, 4096);
        if let Err(e) = initiator.transfer_sync(&[first]) {
            panic!("the first write after re-registration {swap} failed: {e}");
        }
        outcome.swaps += 1;
    }
    stop.store(true, Ordering::SeqCst);
    for w in writers {
        let (clean, overlapped, failed, first) = w.join().expect("a writer panicked");
        outcome.clean += clean;
        outcome.overlapped += overlapped;
        outcome.overlapped_failed += failed;
        outcome.first_failure = outcome.first_failure.or(first);
    }
    // Everything written landed where it was meant to.
    initiator.transfer_sync(&reqs).unwrap();
    for r in &reqs {
        let at = (r.remote_addr - raddr) as usize;
        let n = r.length as usize;
        assert!(remote[at..at + n] == local[at..at + n], "bytes at {at:#x}");
    }
    target.unregister_memory(raddr).unwrap();
    eprintln!("register again under load: {outcome:?}");
    outcome
}

/// Submits two batches of `reqs` at a time until `stop`; returns how many
/// were clean, how many overlapped a re-registration, how many of those
/// failed and the first failure. Panics when a clean batch fails.
fn write_until(
    e: &Engine,
    reqs: &[Request],
    state: &Swaps,
    stop: &AtomicBool,
    batches: &AtomicU64,
) -> (usize, usize, usize, Option<String>) {
    let (mut clean, mut overlapped, mut failed) = (0, 0, 0);
    let mut first = None;
    while !stop.load(Ordering::SeqCst) {
        let done = state.done.load(Ordering::SeqCst);
        let begun = state.begun.load(Ordering::SeqCst);
        let results: Vec<Result<(), ferry_core::Error>> = [0, 1]
            .map(|_| {
                let b = e.allocate_batch(reqs.len()).unwrap();
                let submitted = e.submit(b, reqs);
                (b, submitted)
            })
            .into_iter()
            .map(|(b, submitted)| finish(e, b, submitted))
            .collect();
        batches.fetch_add(2, Ordering::SeqCst);
        let calm = begun == done && state.begun.load(Ordering::SeqCst) == begun;
        for r in results {
            match (r, calm) {
                (Ok(()), true) => clean += 1,
                (Ok(()), false) => overlapped += 1,
                (Err(e), true) => panic!(
                    "a batch submitted after re-registration {done} completed, and finished \
                     before the next began, failed: {e}"
                ),
                (Err(e), false) => {
                    assert_eq!(e.code, ErrorCode::OutOfBounds, "{e}");
                    assert!(!e.message.is_empty());
                    overlapped += 1;
                    failed += 1;
                    first.get_or_insert(e.to_string());
                }
            }
        }
    }
    (clean, overlapped, failed, first)
}

/// Waits for a submitted batch and frees it: its first error, if any.
fn finish(e: &Engine, b: u64, submitted: ferry_core::Result<()>) -> Result<(), ferry_core::Error> {
    let status = e.wait(b, STUCK).unwrap();
    assert!(
        status.is_done(),
        "a batch is stuck after {STUCK:?}: {status:?}"
    );
    e.free_batch(b).unwrap();
    submitted?;
    match status.first_error {
        Some((_, err)) => Err(err),
        None => Ok(()),
    }
}
