//! Batches: a set of requests submitted together, their statuses, and the
//! table that routes plugin completions back to them.
//!
//! A completion token is `batch id << 24 | group index`: a group is one
//! request handed to a transport, which may stand for several adjacent user
//! requests the engine coalesced.

use crate::error::{Error, ErrorCode, Result};
use crate::memory::LocalBuffer;
use crate::metrics::Tally;
use crate::transport::CompletionSink;
use parking_lot::{Condvar, Mutex, RwLock};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Identifies a batch within one engine.
pub type BatchId = u64;

const GROUP_BITS: u32 = 24;
/// Most requests one batch may hold.
pub const MAX_BATCH_REQUESTS: usize = (1 << GROUP_BITS) - 1;

pub fn token(batch: BatchId, group: usize) -> u64 {
    (batch << GROUP_BITS) | group as u64
}

/// The group index inside a token.
pub(crate) fn group_of(token: u64) -> usize {
    split_token(token).1
}

fn split_token(token: u64) -> (BatchId, usize) {
    (
        token >> GROUP_BITS,
        (token & ((1 << GROUP_BITS) - 1)) as usize,
    )
}

/// The state of one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RequestStatus {
    Pending,
    Completed,
    Failed(Error),
}

/// A summary of a batch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BatchStatus {
    /// Requests submitted so far.
    pub total: usize,
    pub completed: usize,
    pub failed: usize,
    pub pending: usize,
    /// The first request that failed, by index, and why.
    pub first_error: Option<(usize, Error)>,
}

impl BatchStatus {
    pub fn is_done(&self) -> bool {
        self.pending == 0
    }

    pub fn succeeded(&self) -> bool {
        self.pending == 0 && self.failed == 0
    }
}

/// Told when a completion group finishes (the engine's measurements).
pub(crate) trait GroupObserver: Send + Sync {
    fn finished(&self, ok: bool);
}

struct Group {
    start: usize,
    count: usize,
    local: Arc<LocalBuffer>,
    done: bool,
    observer: Option<Arc<dyn GroupObserver>>,
    /// Where its completion counts (none with metrics off).
    tally: Option<Tally>,
}

#[derive(Default)]
struct BatchState {
    statuses: Vec<RequestStatus>,
    groups: Vec<Group>,
    completed: usize,
    failed: usize,
    first_error: Option<(usize, Error)>,
}

pub struct Batch {
    pub id: BatchId,
    capacity: usize,
    state: Mutex<BatchState>,
    pending: AtomicUsize,
    done: Condvar,
}

impl Batch {
    /// Reserves `count` request slots; returns the index of the first.
    pub(crate) fn reserve(&self, count: usize) -> Result<usize> {
        let mut st = self.state.lock();
        let start = st.statuses.len();
        if start + count > self.capacity {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                format!(
                    "batch {} holds {} requests; {start} are used and {count} more do not fit",
                    self.id, self.capacity
                ),
            ));
        }
        st.statuses
            .extend(std::iter::repeat_n(RequestStatus::Pending, count));
        self.pending.fetch_add(count, Ordering::SeqCst);
        Ok(start)
    }

    /// Adds a group of `count` requests starting at `start`; returns its token.
    pub(crate) fn add_group(
        &self,
        start: usize,
        count: usize,
        local: Arc<LocalBuffer>,
        tally: Option<Tally>,
    ) -> u64 {
        local.inflight.fetch_add(count, Ordering::SeqCst);
        let mut st = self.state.lock();
        st.groups.push(Group {
            start,
            count,
            local,
            done: false,
            observer: None,
            tally,
        });
        token(self.id, st.groups.len() - 1)
    }

    /// Has `observer` told when group `group` finishes; set before the
    /// group is handed to a transport.
    pub(crate) fn observe(&self, group: usize, observer: Arc<dyn GroupObserver>) {
        if let Some(g) = self.state.lock().groups.get_mut(group) {
            g.observer = Some(observer);
        }
    }

    /// Finishes a group (from a plugin, or the engine when submit failed).
    pub(crate) fn complete_group(&self, group: usize, result: std::result::Result<(), Error>) {
        let mut st = self.state.lock();
        let Some(g) = st.groups.get_mut(group) else {
            log::warn!(
                "completion for unknown request group {group} of batch {}",
                self.id
            );
            return;
        };
        if g.done {
            log::warn!(
                "a transport completed request group {group} of batch {} twice; ignored",
                self.id
            );
            return;
        }
        g.done = true;
        let (start, count) = (g.start, g.count);
        let local = g.local.clone();
        let observer = g.observer.take();
        let ok = result.is_ok();
        if let Some(t) = g.tally.take() {
            t.finish(count, result.as_ref().err().map(|e| e.code));
        }
        match result {
            Ok(()) => {
                for s in &mut st.statuses[start..start + count] {
                    *s = RequestStatus::Completed;
                }
                st.completed += count;
            }
            Err(e) => {
                if st.first_error.is_none() {
                    st.first_error = Some((start, e.clone()));
                }
                for s in &mut st.statuses[start..start + count] {
                    *s = RequestStatus::Failed(e.clone());
                }
                st.failed += count;
            }
        }
        local.inflight.fetch_sub(count, Ordering::SeqCst);
        drop(st);
        // Measured before waiters wake: what a finished batch showed counts
        // for the next one.
        if let Some(o) = observer {
            o.finished(ok);
        }
        let before = self.pending.fetch_sub(count, Ordering::SeqCst);
        if before == count {
            self.done.notify_all();
        }
    }

    pub fn status(&self) -> BatchStatus {
        let st = self.state.lock();
        BatchStatus {
            total: st.statuses.len(),
            completed: st.completed,
            failed: st.failed,
            pending: st.statuses.len() - st.completed - st.failed,
            first_error: st.first_error.clone(),
        }
    }

    pub fn request_status(&self, index: usize) -> Result<RequestStatus> {
        let st = self.state.lock();
        st.statuses.get(index).cloned().ok_or_else(|| {
            Error::new(
                ErrorCode::InvalidArgument,
                format!(
                    "batch {} has {} requests; there is no request {index}",
                    self.id,
                    st.statuses.len()
                ),
            )
        })
    }

    /// Waits until every submitted request finished or `timeout` passed, and
    /// returns the status either way. For up to `spin` it polls, calling
    /// `progress` so that this thread picks up completions itself: a small
    /// transfer completes within microseconds, much sooner than a sleeping
    /// thread wakes up (a wake-up costs tens of microseconds on a VM).
    pub fn wait(
        &self,
        timeout: Duration,
        spin: Duration,
        mut progress: impl FnMut(),
    ) -> BatchStatus {
        let started = Instant::now();
        let spin = spin.min(timeout);
        while self.pending.load(Ordering::SeqCst) != 0 && started.elapsed() < spin {
            progress();
            std::hint::spin_loop();
        }
        if self.pending.load(Ordering::SeqCst) != 0 {
            let deadline = started + timeout;
            let mut st = self.state.lock();
            while self.pending.load(Ordering::SeqCst) != 0 {
                if self.done.wait_until(&mut st, deadline).timed_out() {
                    break;
                }
            }
        }
        self.status()
    }

    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::SeqCst)
    }
}

/// Every batch of an engine, by id; also where plugins' completions land.
#[derive(Default)]
pub struct BatchTable {
    batches: RwLock<HashMap<BatchId, Arc<Batch>>>,
    next: AtomicU64,
}

impl BatchTable {
    pub fn allocate(&self, capacity: usize) -> Result<Arc<Batch>> {
        if capacity == 0 || capacity > MAX_BATCH_REQUESTS {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                format!("a batch holds 1 to {MAX_BATCH_REQUESTS} requests, not {capacity}"),
            ));
        }
        let id = self.next.fetch_add(1, Ordering::SeqCst) + 1;
        let batch = Arc::new(Batch {
            id,
            capacity,
            state: Mutex::new(BatchState::default()),
            pending: AtomicUsize::new(0),
            done: Condvar::new(),
        });
        self.batches.write().insert(id, batch.clone());
        Ok(batch)
    }

    pub fn get(&self, id: BatchId) -> Result<Arc<Batch>> {
        self.batches.read().get(&id).cloned().ok_or_else(|| {
            Error::new(
                ErrorCode::NotFound,
                format!("no batch {id} (never allocated, or already freed)"),
            )
        })
    }

    /// Frees a batch whose requests have all finished.
    pub fn free(&self, id: BatchId) -> Result<()> {
        let mut map = self.batches.write();
        let batch = map.get(&id).ok_or_else(|| {
            Error::new(
                ErrorCode::NotFound,
                format!("no batch {id} (never allocated, or already freed)"),
            )
        })?;
        let pending = batch.pending();
        if pending != 0 {
            return Err(Error::new(
                ErrorCode::Busy,
                format!("batch {id} still has {pending} requests in flight; wait for them first"),
            ));
        }
        map.remove(&id);
        Ok(())
    }
}

impl CompletionSink for BatchTable {
    fn complete(&self, token: u64, result: std::result::Result<(), Error>) {
        let (id, group) = split_token(token);
        let batch = self.batches.read().get(&id).cloned();
        match batch {
            Some(b) => b.complete_group(group, result),
            None => log::warn!("completion for unknown batch {id}; ignored"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_round_trip() {
        assert_eq!(split_token(token(12345, 678)), (12345, 678));
    }
}
