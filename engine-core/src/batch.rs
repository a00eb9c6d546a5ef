//! Batches: a set of requests submitted together, their statuses, and the
//! table that routes plugin completions back to them.
//!
//! A completion token is `batch id << 24 | group index`: a group is one
//! request handed to a transport, which may stand for several adjacent user
//! requests the engine coalesced.

pub use crate::batch_status::{BatchStatus, NotifyStatus, RequestStatus};
use crate::error::{Error, ErrorCode, Result};
use crate::id_map::IdMap;
use crate::memory::LocalBuffer;
use crate::metrics::{BatchTally, GroupTally, Tally};
use crate::transport::CompletionSink;
use parking_lot::{Condvar, Mutex, RwLock};
use smallvec::SmallVec;
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

/// Told when a completion group finishes (the engine's measurements).
pub(crate) trait GroupObserver: Send + Sync {
    fn finished(&self, ok: bool);
}

/// Takes over a group the peer refused as outside its registered memory
/// ([`refused_by_peer`]): the registration its key names may have been
/// revoked or replaced since the key was read. Called at most once per
/// group, outside the batch's lock, from whatever thread completed it; it
/// must not block, and must complete the group (by its token) exactly once
/// later. The group stays pending and keeps its local buffer in flight
/// meanwhile.
pub(crate) trait Retry: Send + Sync {
    /// Group `token`, the hand-over's request `index`, failed with `error`.
    fn retry(self: Arc<Self>, token: u64, index: usize, error: Error);
}

/// Whether a failure may come from a stale key: every transport reports a
/// remote range its peer does not serve (never registered, unregistered,
/// or a revoked registration) as FERRY_ERR_OUT_OF_BOUNDS (plugin.h).
pub(crate) fn refused_by_peer(e: &Error) -> bool {
    e.code == ErrorCode::OutOfBounds
}

/// A request's state in [`BatchState::states`].
const PENDING: u8 = 0;
const COMPLETED: u8 = 1;
const FAILED: u8 = 2;

/// Runs once every request submitted so far has finished, with the first
/// failure if any; must not block (it runs on a completion thread).
pub(crate) type DoneHook = Box<dyn FnOnce(Option<(usize, Error)>) + Send>;

struct Group {
    start: usize,
    count: usize,
    /// Completions still expected: 1, or one per request sharing its token.
    parts: usize,
    /// The first failure of a part, reported with the last part.
    failed_part: Option<Error>,
    /// Requests of it that failed while the rest went on (fail_within):
    /// (start, count, bytes, why), finished failed with the group.
    failed_within: Vec<(usize, usize, u64, Error)>,
    local: Arc<LocalBuffer>,
    done: bool,
    observer: Option<Arc<dyn GroupObserver>>,
    /// Who retries it once if the peer refuses its key, and its index.
    retry: Option<(Arc<dyn Retry>, usize)>,
    /// Where its completion counts (none with metrics off).
    tally: Option<GroupTally>,
}

#[derive(Default)]
struct BatchState {
    /// A byte per request (not 2 MiB of statuses for 65,536 blocks).
    states: SmallVec<[u8; 8]>,
    /// Why requests failed: each failed range (start, count) and its error.
    failures: Vec<(usize, usize, Error)>,
    groups: SmallVec<[Group; 1]>,
    completed: usize,
    failed: usize,
    first_error: Option<(usize, Error)>,
    notify: Option<NotifyStatus>,
    /// Set with the notification; taken when the requests are done.
    on_done: Option<DoneHook>,
    /// Finished requests' counts, on their way to the metrics.
    tally: BatchTally,
}

impl BatchState {
    fn requests_pending(&self) -> usize {
        self.states.len() - self.completed - self.failed
    }

    /// The hook to run now that no request is pending, if one waits.
    fn hook_if_done(&mut self) -> Option<(DoneHook, Option<(usize, Error)>)> {
        if self.requests_pending() != 0 {
            return None;
        }
        let hook = self.on_done.take()?;
        Some((hook, self.first_error.clone()))
    }
}

pub struct Batch {
    pub id: BatchId,
    capacity: usize,
    state: Mutex<BatchState>,
    pending: AtomicUsize,
    done: Condvar,
    /// How long its last hand-over should take, in ns (0: unknown).
    expected_ns: AtomicU64,
}

impl Batch {
    pub(crate) fn expect(&self, d: Duration) {
        let ns = d.as_nanos().min(u64::MAX as u128) as u64;
        self.expected_ns.store(ns, Ordering::Relaxed);
    }

    pub(crate) fn expected(&self) -> Duration {
        Duration::from_nanos(self.expected_ns.load(Ordering::Relaxed))
    }

    /// Reserves `count` request slots; returns the index of the first.
    pub(crate) fn reserve(&self, count: usize) -> Result<usize> {
        let mut st = self.state.lock();
        if st.notify.is_some() {
            return Err(self.carries_notify());
        }
        let start = st.states.len();
        if start + count > self.capacity {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                format!(
                    "batch {} holds {} requests; {start} are used and {count} more do not fit",
                    self.id, self.capacity
                ),
            ));
        }
        st.states.resize(start + count, PENDING);
        self.pending.fetch_add(count, Ordering::SeqCst);
        Ok(start)
    }

    /// Room for `n` more groups: a submission that knows how many it adds
    /// (16,384 staged requests are as many groups) grows the table once.
    pub(crate) fn reserve_groups(&self, n: usize) {
        self.state.lock().groups.reserve(n);
    }

    /// Adds a group of `count` requests starting at `start`; returns its token.
    pub(crate) fn add_group(
        &self,
        start: usize,
        count: usize,
        local: Arc<LocalBuffer>,
        tally: Option<Tally<'_>>,
    ) -> u64 {
        self.add_group_of_parts(start, count, 1, local, tally)
    }

    /// Adds a group that its transport completes in `parts` completions of
    /// one token; it finishes with the last, failed if any part failed.
    pub(crate) fn add_group_of_parts(
        &self,
        start: usize,
        count: usize,
        parts: usize,
        local: Arc<LocalBuffer>,
        tally: Option<Tally<'_>>,
    ) -> u64 {
        local.inflight.fetch_add(count, Ordering::SeqCst);
        let mut st = self.state.lock();
        let tally = tally.map(|t| st.tally.add(t));
        st.groups.push(Group {
            start,
            count,
            parts: parts.max(1),
            failed_part: None,
            failed_within: Vec::new(),
            local,
            done: false,
            observer: None,
            retry: None,
            tally,
        });
        token(self.id, st.groups.len() - 1)
    }

    /// Has `observer` told when each of `groups` finishes, and `retry` (with
    /// each group's index) retry a refused one; set before the hand-over.
    pub(crate) fn observe(
        &self,
        groups: impl IntoIterator<Item = (usize, usize)>,
        observer: &Arc<dyn GroupObserver>,
        retry: Option<&Arc<dyn Retry>>,
    ) {
        let mut st = self.state.lock();
        for (group, index) in groups {
            if let Some(g) = st.groups.get_mut(group) {
                g.observer = Some(observer.clone());
                g.retry = retry.map(|r| (r.clone(), index));
            }
        }
    }

    /// Fails requests [start, start + count) of `group`, `bytes` of it,
    /// while the rest of the group goes on: they finish failed, with `e`,
    /// when the group completes. A staged list of requests is one group
    /// (a group per block cost a millisecond a batch to make and finish),
    /// and a block that fails fails its own requests only. Ignored for a
    /// range outside the group or a group already done.
    pub(crate) fn fail_within(
        &self,
        group: usize,
        start: usize,
        count: usize,
        bytes: u64,
        e: Error,
    ) {
        let mut st = self.state.lock();
        let Some(g) = st.groups.get_mut(group) else {
            return;
        };
        let inside = start >= g.start
            && start
                .checked_add(count)
                .is_some_and(|end| end <= g.start + g.count);
        if !g.done && count > 0 && inside {
            g.failed_within.push((start, count, bytes, e));
        }
    }

    /// Has a pending group finish after `parts` completions from now, its
    /// requests `failed` ((first, count) from the group's first request,
    /// bytes, why) failing while the rest go on: a refused list that a
    /// retry serves in part, as sub-lists. False, changing nothing, when
    /// the group is unknown or done, or a range lies outside it.
    pub(crate) fn split_group(
        &self,
        group: usize,
        parts: usize,
        failed: Vec<(usize, usize, u64, Error)>,
    ) -> bool {
        let mut st = self.state.lock();
        let Some(g) = st.groups.get_mut(group) else {
            return false;
        };
        let inside = |&(at, n, ..): &(usize, usize, u64, Error)| {
            n > 0 && at.checked_add(n).is_some_and(|end| end <= g.count)
        };
        if g.done || parts == 0 || !failed.iter().all(inside) {
            return false;
        }
        g.parts = parts;
        let start = g.start;
        g.failed_within.extend(
            failed
                .into_iter()
                .map(|(at, n, b, e)| (start + at, n, b, e)),
        );
        true
    }

    /// Fails a whole group, whatever parts it expects (none was accepted);
    /// false when it stays pending (a [`Retry`] took it).
    pub(crate) fn abort_group(&self, group: usize, e: Error) -> bool {
        if let Some(g) = self.state.lock().groups.get_mut(group) {
            g.parts = 1;
        }
        self.complete_group(group, Err(e))
    }

    /// Finishes a group (from a plugin, or the engine when submit failed);
    /// false while it is still pending (a [`Retry`] took it, or parts left).
    pub(crate) fn complete_group(
        &self,
        group: usize,
        result: std::result::Result<(), Error>,
    ) -> bool {
        let mut st = self.state.lock();
        let Some(g) = st.groups.get_mut(group) else {
            log::warn!(
                "completion for unknown request group {group} of batch {}",
                self.id
            );
            return true;
        };
        if g.done {
            log::warn!(
                "a transport completed request group {group} of batch {} twice; ignored",
                self.id
            );
            return true;
        }
        if let Err(e) = &result {
            if let Some((retry, index)) = refused_by_peer(e).then(|| g.retry.take()).flatten() {
                // The first attempt ends (no measurement); the group stays.
                let observer = g.observer.take();
                drop(st);
                if let Some(o) = observer {
                    o.finished(false);
                }
                retry.retry(token(self.id, group), index, e.clone());
                return false;
            }
        }
        if g.parts > 1 {
            g.parts -= 1;
            g.failed_part = g.failed_part.take().or(result.err());
            return false;
        }
        let result = g.failed_part.take().map_or(result, Err);
        g.done = true;
        // Nothing left to retry (dropping it is cheap: see retry.rs's Sent).
        g.retry = None;
        let (start, count) = (g.start, g.count);
        let local = g.local.clone();
        let observer = g.observer.take();
        // A group that failed whole fails its parts too, with its own error.
        let within = match result {
            Ok(()) => std::mem::take(&mut g.failed_within),
            Err(_) => Vec::new(),
        };
        if let Some(mut t) = g.tally.take() {
            let idle = st.requests_pending() == count;
            let mut failed = 0;
            for (_, n, bytes, e) in &within {
                st.tally.fail_part(&mut t, *n, *bytes, e.code);
                failed += n;
            }
            let code = match (&result, within.first()) {
                (Err(e), _) => Some(e.code),
                // Every request failed within: the hand-over failed.
                (Ok(()), Some((.., e))) if failed >= count => Some(e.code),
                _ => None,
            };
            st.tally.finish(t, count.saturating_sub(failed), code, idle);
        }
        local.inflight.fetch_sub(count, Ordering::SeqCst);
        self.finish(st, start, count, result, observer, within);
        true
    }

    /// Marks `count` requests from `start` finished, tells the observer,
    /// wakes waiters, and runs the notification hook after the last one.
    fn finish(
        &self,
        mut st: parking_lot::MutexGuard<'_, BatchState>,
        start: usize,
        count: usize,
        result: std::result::Result<(), Error>,
        observer: Option<Arc<dyn GroupObserver>>,
        within: Vec<(usize, usize, u64, Error)>,
    ) {
        let ok = result.is_ok();
        match result {
            Ok(()) => {
                st.states[start..start + count].fill(COMPLETED);
                st.completed += count;
                // Inside the group (fail_within checked); were two parts to
                // overlap, a request still counts failed once.
                for (at, n, _, e) in within {
                    let mut newly = 0;
                    for s in &mut st.states[at..at + n] {
                        if *s == COMPLETED {
                            *s = FAILED;
                            newly += 1;
                        }
                    }
                    st.completed -= newly;
                    st.failed += newly;
                    if st.first_error.is_none() {
                        st.first_error = Some((at, e.clone()));
                    }
                    st.failures.push((at, n, e));
                }
            }
            Err(e) => {
                if st.first_error.is_none() {
                    st.first_error = Some((start, e.clone()));
                }
                st.states[start..start + count].fill(FAILED);
                st.failures.push((start, count, e));
                st.failed += count;
            }
        }
        let hook = st.hook_if_done();
        drop(st);
        // Measured before waiters wake: it counts for the next batch.
        if let Some(o) = observer {
            o.finished(ok);
        }
        let before = self.pending.fetch_sub(count, Ordering::SeqCst);
        if before == count {
            // A waiter reads `pending` under the state lock, then sleeps:
            // taking the lock here means it has either not read `pending`
            // yet (and will see zero) or is asleep (and is woken). Without
            // it, a waiter that read a non-zero count just before the
            // decrement sleeps through the wake-up to its deadline.
            drop(self.state.lock());
            self.done.notify_all();
        }
        if let Some((hook, first_error)) = hook {
            hook(first_error);
        }
    }

    /// Finishes `count` requests from `start` that move nothing (length 0).
    pub(crate) fn complete_empty(&self, start: usize, count: usize) {
        if count == 0 {
            return;
        }
        let st = self.state.lock();
        self.finish(st, start, count, Ok(()), None, Vec::new());
    }

    /// Fails when the batch carries a notification (it takes no more).
    pub(crate) fn check_takes_requests(&self) -> Result<()> {
        match self.state.lock().notify {
            Some(_) => Err(self.carries_notify()),
            None => Ok(()),
        }
    }

    fn carries_notify(&self) -> Error {
        Error::new(
            ErrorCode::InvalidArgument,
            format!(
                "batch {} carries a notification: it takes no more requests",
                self.id
            ),
        )
    }

    /// Attaches a notification: `hook` runs once every request so far has
    /// finished, and the batch stays pending (taking no more requests)
    /// until [`Batch::finish_notify`].
    pub(crate) fn attach_notify(&self, hook: DoneHook) -> Result<()> {
        let mut st = self.state.lock();
        if st.notify.is_some() {
            return Err(self.carries_notify());
        }
        st.notify = Some(NotifyStatus::Pending);
        st.on_done = Some(hook);
        self.pending.fetch_add(1, Ordering::SeqCst);
        let ready = st.hook_if_done();
        drop(st);
        if let Some((hook, first_error)) = ready {
            hook(first_error);
        }
        Ok(())
    }

    /// Records what became of the notification and wakes waiters.
    pub(crate) fn finish_notify(&self, result: std::result::Result<(), Error>) {
        let mut st = self.state.lock();
        if st.notify != Some(NotifyStatus::Pending) {
            return;
        }
        st.notify = Some(match result {
            Ok(()) => NotifyStatus::Delivered,
            Err(e) => NotifyStatus::Failed(e),
        });
        let before = self.pending.fetch_sub(1, Ordering::SeqCst);
        drop(st);
        if before == 1 {
            self.done.notify_all();
        }
    }

    pub fn status(&self) -> BatchStatus {
        let st = self.state.lock();
        BatchStatus {
            total: st.states.len(),
            completed: st.completed,
            failed: st.failed,
            pending: st.requests_pending(),
            first_error: st.first_error.clone(),
            notify: st.notify.clone(),
        }
    }

    pub fn request_status(&self, index: usize) -> Result<RequestStatus> {
        let st = self.state.lock();
        match st.states.get(index) {
            Some(&PENDING) => Ok(RequestStatus::Pending),
            Some(&COMPLETED) => Ok(RequestStatus::Completed),
            Some(_) => Ok(RequestStatus::Failed(
                st.failures
                    .iter()
                    .find(|(start, count, _)| (*start..start + count).contains(&index))
                    .map(|(_, _, e)| e.clone())
                    .unwrap_or_else(|| Error::new(ErrorCode::Internal, "failed, cause lost")),
            )),
            None => Err(Error::new(
                ErrorCode::InvalidArgument,
                format!(
                    "batch {} has {} requests; there is no request {index}",
                    self.id,
                    st.states.len()
                ),
            )),
        }
    }

    /// Waits until every request finished or `timeout` passed; returns the
    /// status either way. For up to `spin` it polls, calling `progress` to
    /// pick up completions itself: sooner than a sleeping thread wakes up
    /// (tens of microseconds on a VM).
    pub fn wait(&self, timeout: Duration, spin: Duration, progress: impl FnMut()) -> BatchStatus {
        self.wait_reporting(timeout, spin, progress).0
    }

    /// As [`Batch::wait`], and whether it slept until the deadline.
    fn wait_reporting(
        &self,
        timeout: Duration,
        spin: Duration,
        mut progress: impl FnMut(),
    ) -> (BatchStatus, bool) {
        if self.pending.load(Ordering::SeqCst) == 0 {
            // Done already (a synchronous transfer): no clock to read.
            return (self.status(), false);
        }
        let started = Instant::now();
        let mut deadline_hit = false;
        let spin = spin.min(timeout);
        while self.pending.load(Ordering::SeqCst) != 0 && started.elapsed() < spin {
            progress();
            std::hint::spin_loop();
        }
        if self.pending.load(Ordering::SeqCst) != 0 {
            let deadline = started + timeout;
            let mut st = self.state.lock();
            while self.pending.load(Ordering::SeqCst) != 0 {
                #[cfg(test)]
                lost_wakeup::before_sleep(self);
                if self.done.wait_until(&mut st, deadline).timed_out() {
                    deadline_hit = true;
                    break;
                }
            }
        }
        (self.status(), deadline_hit)
    }

    pub fn pending(&self) -> usize {
        self.pending.load(Ordering::SeqCst)
    }
}

/// Every batch of an engine, by id; also where plugins' completions land.
#[derive(Default)]
pub struct BatchTable {
    batches: RwLock<IdMap<BatchId, Arc<Batch>>>,
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
            expected_ns: AtomicU64::new(0),
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

    /// [`Batch::split_group`] for the group of `token`.
    pub(crate) fn split_group(
        &self,
        token: u64,
        parts: usize,
        failed: Vec<(usize, usize, u64, Error)>,
    ) -> bool {
        let (id, group) = split_token(token);
        let batch = self.batches.read().get(&id).cloned();
        batch.is_some_and(|b| b.split_group(group, parts, failed))
    }
}

impl CompletionSink for BatchTable {
    fn complete(&self, token: u64, result: std::result::Result<(), Error>) {
        let (id, group) = split_token(token);
        let batch = self.batches.read().get(&id).cloned();
        match batch {
            Some(b) => {
                b.complete_group(group, result);
            }
            None => log::warn!("completion for unknown batch {id}; ignored"),
        }
    }
}

/// The hook a test of `wait` uses to hold open the window between
/// reading `pending` and going to sleep.
#[cfg(test)]
mod lost_wakeup {
    use super::*;
    use std::sync::atomic::AtomicBool;
    use std::time::Duration;

    thread_local! {
        /// Set by a test on the waiting thread: the flag to raise once the
        /// waiter is inside the window (pending read, not yet asleep).
        pub(super) static WINDOW: std::cell::RefCell<Option<Arc<AtomicBool>>> = const { std::cell::RefCell::new(None) };
    }

    /// Called by `wait` between reading a non-zero `pending` and going to
    /// sleep, with the state lock held: the window in which a wake-up can
    /// be lost. In the test, it lets the completer go on and holds the
    /// window open until the count is down (at most 5 s).
    pub(super) fn before_sleep(b: &Batch) {
        let Some(flag) = WINDOW.with_borrow(|w| w.clone()) else {
            return;
        };
        flag.store(true, Ordering::SeqCst);
        spin_until(|| b.pending.load(Ordering::SeqCst) == 0);
    }

    /// Spins until `done()` (at most 5 s).
    pub(super) fn spin_until(done: impl Fn() -> bool) {
        let until = Instant::now() + Duration::from_secs(5);
        while !done() && Instant::now() < until {
            std::hint::spin_loop();
        }
    }
}

#[cfg(test)]
#[path = "batch_tests.rs"]
mod tests;
