//! A staging job's host legs, dispatched on a thread of their own.
//!
//! A transport may move a request inside its submit call: shm copies on
//! the calling thread and its copy pool, and returns when the bytes have
//! landed. Dispatched on the job's own thread, each 8 MiB leg held up the
//! job's other work for its whole copy, so a batch took the sum of the
//! copies and everything else the job does: admitting, packing and queuing
//! the device copies of the next chunks, asking the peer for its copies,
//! completing requests (an H100, staged shm: 5 of a 1 MiB batch's 7.8 ms
//! were its copies; a 16 KiB batch's extra 2-3 ms of per-block work came
//! on top). Here the legs run one after another, in the order they were
//! started, while the job thread goes on.
//!
//! Reaches in Shared: `batches`, `config`.

use crate::batch::{Batch, BatchId, BatchStatus};
use crate::engine::plan::Plan;
use crate::engine::shared::Shared;
use crate::error::{Error, ErrorCode, Result};
use parking_lot::{Condvar, Mutex};
use std::collections::HashMap;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::Arc;
use std::time::Instant;

/// A chunk's host leg, planned, waiting for its dispatch.
struct HostLeg {
    id: BatchId,
    batch: Arc<Batch>,
    plan: Plan,
}

/// What became of a leg handed to the mover.
enum Sent {
    /// Queued as leg number n.
    Queued(u64),
    /// Not taken: the caller dispatches it.
    Back(HostLeg),
}

/// The end the mover's thread reads legs from.
pub(super) struct Legs(Receiver<HostLeg>);

/// Where legs go: the thread's queue (None once closed: the thread then
/// ends after the legs queued) and how many were queued, numbered from 1
/// in the queue's order.
struct Queue {
    to_thread: Option<Sender<HostLeg>>,
    sent: u64,
}

pub(super) struct Mover {
    queue: Mutex<Queue>,
    /// Legs whose dispatch has returned, in order: leg n has been
    /// dispatched when this is n or more. Until then its batch holds no
    /// request and looks finished. `returned` wakes who waits for it.
    dispatched: Mutex<u64>,
    returned: Condvar,
    /// Legs whose dispatch failed outright (nothing in their batch says
    /// so), by batch.
    failed: Mutex<HashMap<BatchId, Error>>,
}

impl Mover {
    /// The mover, and the end its thread reads legs from.
    pub(super) fn new() -> (Mover, Legs) {
        let (tx, rx) = channel();
        let rx = Legs(rx);
        let mover = Mover {
            queue: Mutex::new(Queue {
                to_thread: Some(tx),
                sent: 0,
            }),
            dispatched: Mutex::new(0),
            returned: Condvar::new(),
            failed: Mutex::new(HashMap::new()),
        };
        (mover, rx)
    }

    /// Queues `leg`: its number, for [`Mover::dispatched`]. Gives it back
    /// when no thread takes legs (it never started, or the mover is
    /// closed), for the caller to dispatch.
    fn send(&self, leg: HostLeg) -> Sent {
        let mut queue = self.queue.lock();
        let Some(tx) = queue.to_thread.as_ref() else {
            return Sent::Back(leg);
        };
        match tx.send(leg) {
            Ok(()) => {
                queue.sent += 1;
                Sent::Queued(queue.sent)
            }
            Err(e) => Sent::Back(e.0),
        }
    }

    /// Whether leg `n`'s dispatch has returned: its batch now holds its
    /// request (or the leg failed, or was skipped).
    fn dispatched(&self, n: u64) -> bool {
        *self.dispatched.lock() >= n
    }

    /// Waits until leg `n` has been dispatched, or `deadline`: whether it
    /// has.
    fn wait_dispatched(&self, n: u64, deadline: Instant) -> bool {
        let mut dispatched = self.dispatched.lock();
        while *dispatched < n {
            if self
                .returned
                .wait_until(&mut dispatched, deadline)
                .timed_out()
            {
                return *dispatched >= n;
            }
        }
        true
    }

    /// No more legs: the thread ends once the queued ones are dispatched.
    pub(super) fn close(&self) {
        self.queue.lock().to_thread.take();
    }

    /// Why the leg of batch `id` could not be dispatched, once.
    fn failure(&self, id: BatchId) -> Option<Error> {
        let mut failed = self.failed.lock();
        match failed.is_empty() {
            true => None,
            false => failed.remove(&id),
        }
    }

    /// The thread: dispatches legs in order until the mover is closed.
    pub(super) fn run(&self, shared: &Arc<Shared>, legs: Legs) {
        // Still the batch the leg was planned in (ids are reused once
        // freed)?
        let current = |id: BatchId, batch: &Arc<Batch>| {
            shared.batches.get(id).is_ok_and(|b| Arc::ptr_eq(&b, batch))
        };
        for HostLeg { id, batch, plan } in legs.0 {
            // A chunk that gave up on its leg (timed out) freed its batch
            // and its slots, which another chunk may hold now: its leg
            // must not start late.
            let failed = match current(id, &batch) {
                true => shared
                    .dispatch(&batch, plan)
                    .err()
                    .filter(|_| current(id, &batch)),
                false => None,
            };
            self.leg_returned(id, failed);
        }
    }

    /// The next leg's dispatch has returned, for batch `id`, with `failed`
    /// when it failed outright.
    fn leg_returned(&self, id: BatchId, failed: Option<Error>) {
        if let Some(e) = failed {
            self.failed.lock().insert(id, e);
        }
        *self.dispatched.lock() += 1;
        self.returned.notify_all();
    }
}

/// Hands `plan`, the host leg planned in `batch`, to `mover`, or
/// dispatches it here: its number on the mover (0: dispatched here).
pub(super) fn start(
    shared: &Arc<Shared>,
    mover: Option<&Mover>,
    batch: &Arc<Batch>,
    plan: Plan,
) -> Result<u64> {
    let leg = HostLeg {
        id: batch.id,
        batch: batch.clone(),
        plan,
    };
    let sent = match mover {
        Some(m) => m.send(leg),
        None => Sent::Back(leg),
    };
    match sent {
        Sent::Queued(n) => Ok(n),
        Sent::Back(leg) => shared.dispatch(batch, leg.plan).map(|_| 0),
    }
}

/// Where leg `n` (0: dispatched on the job's thread) of `batch` stands:
/// its status once finished; None while it runs, unless `block`, which
/// waits up to twice the engine's timeout. Err when its dispatch failed,
/// or it did not start or finish in time. Until its dispatch returns, a
/// leg's batch holds no request and looks finished.
pub(super) fn leg_status(
    shared: &Shared,
    mover: Option<&Mover>,
    batch: &Batch,
    n: u64,
    block: bool,
) -> Result<Option<BatchStatus>> {
    let deadline = Instant::now() + shared.config.timeout * 2;
    if let Some(m) = mover {
        let dispatched = match block {
            true => m.wait_dispatched(n, deadline),
            false => m.dispatched(n),
        };
        match (dispatched, block) {
            (true, _) => {}
            (false, false) => return Ok(None),
            (false, true) => {
                return Err(Error::new(
                    ErrorCode::Timeout,
                    "a staged chunk's host leg did not start in time",
                ))
            }
        }
    }
    if let Some(e) = mover.and_then(|m| m.failure(batch.id)) {
        return Err(e);
    }
    let status = match block {
        true => shared.wait(batch, deadline.saturating_duration_since(Instant::now())),
        false => batch.status(),
    };
    match (status.is_done(), block) {
        (true, _) => Ok(Some(status)),
        (false, false) => Ok(None),
        (false, true) => Err(Error::new(
            ErrorCode::Timeout,
            "a staged chunk did not finish in time",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::BatchTable;
    use smallvec::SmallVec;
    use std::time::Duration;

    fn leg(table: &BatchTable) -> HostLeg {
        let batch = table.allocate(1).unwrap();
        HostLeg {
            id: batch.id,
            batch,
            plan: Plan {
                requests: 1,
                empty: Vec::new(),
                routed: SmallVec::new(),
                staged: Vec::new(),
                retry: false,
            },
        }
    }

    #[test]
    fn legs_are_numbered_in_order_and_count_only_once_dispatched() {
        let table = BatchTable::default();
        let (mover, legs) = Mover::new();
        let mut ids = Vec::new();
        for want in 1..=3 {
            let l = leg(&table);
            ids.push(l.id);
            assert!(matches!(mover.send(l), Sent::Queued(n) if n == want));
        }
        // The thread reads them in the order they were numbered.
        let read: Vec<BatchId> = legs.0.try_iter().map(|l| l.id).collect();
        assert_eq!(read, ids);
        // An undispatched leg's batch holds no request and looks finished:
        // only the mover's count says whether it has started.
        assert!(table.get(ids[0]).unwrap().status().is_done());
        assert!(mover.dispatched(0) && !mover.dispatched(1));
        let soon = Instant::now() + Duration::from_millis(20);
        assert!(!mover.wait_dispatched(1, soon), "waits out its deadline");
        mover.leg_returned(ids[0], None);
        let e = Error::new(ErrorCode::Unavailable, "no route");
        mover.leg_returned(ids[1], Some(e));
        assert!(mover.dispatched(2) && !mover.dispatched(3));
        assert!(mover.failure(ids[0]).is_none());
        assert_eq!(mover.failure(ids[1]).unwrap().code, ErrorCode::Unavailable);
        assert!(mover.failure(ids[1]).is_none(), "said once");
        // A waiter wakes when the leg's dispatch returns on another thread.
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(Duration::from_millis(10));
                mover.leg_returned(ids[2], None);
            });
            let later = Instant::now() + Duration::from_secs(10);
            assert!(mover.wait_dispatched(3, later));
        });
        // Closed: a leg comes back to be dispatched by the caller.
        mover.close();
        assert!(matches!(mover.send(leg(&table)), Sent::Back(_)));
    }

    #[test]
    fn a_mover_whose_thread_is_gone_gives_legs_back() {
        let table = BatchTable::default();
        let (mover, legs) = Mover::new();
        drop(legs);
        assert!(matches!(mover.send(leg(&table)), Sent::Back(_)));
    }
}
