//! The copy threads: one pool per NUMA node that holds memory being copied
//! (created on first use, pinned to that node's CPUs), shared by every peer
//! of the instance, so threads never multiply with peers.
//!
//! A caller splits its work into parts and calls [`Pool::run`]: the caller
//! copies too, helpers take the other parts, and `run` returns only when
//! every part is done and no helper still holds the work. Copies into a
//! peer's memory therefore stay inside the caller's copy lock, as they did
//! when the caller copied alone.
//!
//! Waking a sleeping thread costs tens of microseconds on a virtual
//! machine (an interrupt to a halted virtual CPU), as long as copying a
//! megabyte. So a helper that finishes watches the queue for [`SPIN`]
//! before it sleeps, and a caller whose parts are all taken watches the
//! last helpers for as long before it sleeps: back-to-back submissions
//! never wait for a wake-up, and an idle pool costs nothing.

use crate::numa;
use std::collections::{BTreeSet, HashMap, VecDeque};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How long a thread watches for what it waits on before it sleeps.
const SPIN: Duration = Duration::from_micros(50);

/// Watches `ready` for up to [`SPIN`]; true when it became true.
fn spin_until(ready: impl Fn() -> bool) -> bool {
    let deadline = Instant::now() + SPIN;
    loop {
        for _ in 0..32 {
            if ready() {
                return true;
            }
            std::hint::spin_loop();
        }
        if Instant::now() >= deadline {
            return ready();
        }
    }
}

/// Work that outlives no call of [`Pool::run`]: parts are claimed by index.
type Work = dyn Fn(usize) + Sync;

/// One call of `run`, as helpers see it.
struct Job {
    /// The caller's work. Dereferenced only while the helper is counted in
    /// `busy`; the caller does not return before `busy` is 0 and its queued
    /// tickets are withdrawn.
    work: *const Work,
    parts: usize,
    next: AtomicUsize,
    /// Helpers inside the work.
    busy: AtomicUsize,
    /// Whether the caller sleeps on `idle` (it stopped watching `busy`).
    waiting: Mutex<bool>,
    idle: Condvar,
    panicked: AtomicBool,
}

// SAFETY: `work` points to a `dyn Fn + Sync`, callable from any thread; the
// rest is atomics and locks.
unsafe impl Send for Job {}
// SAFETY: shared references only call `work` (a `dyn Fn + Sync`) and use
// atomics and locks.
unsafe impl Sync for Job {}

impl Job {
    /// Claims and runs parts until none is left.
    fn drain(&self) {
        loop {
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.parts {
                return;
            }
            // SAFETY: see `work`: the caller's closure is alive while this
            // thread is counted busy (helpers) or is the caller itself.
            unsafe { (*self.work)(i) };
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

#[derive(Default)]
struct Queue {
    tickets: VecDeque<Arc<Job>>,
    /// Helpers asleep on `wake`.
    sleepers: usize,
    stop: bool,
}

#[derive(Default)]
struct Inner {
    queue: Mutex<Queue>,
    wake: Condvar,
    /// Tickets in the queue, for helpers watching it without its lock.
    queued: AtomicUsize,
}

/// Copy threads pinned near one NUMA node.
pub struct Pool {
    inner: Arc<Inner>,
    threads: Vec<JoinHandle<()>>,
}

impl Pool {
    /// `helpers` threads (besides each caller) allowed on `cpus`.
    pub fn new(helpers: usize, cpus: BTreeSet<usize>) -> std::io::Result<Pool> {
        let inner: Arc<Inner> = Arc::default();
        let mut pool = Pool {
            inner: inner.clone(),
            threads: Vec::with_capacity(helpers),
        };
        let cpus = Arc::new(cpus);
        for _ in 0..helpers {
            let (inner, cpus) = (inner.clone(), cpus.clone());
            pool.threads.push(
                std::thread::Builder::new()
                    .name("ferry-shm-copy".into())
                    .spawn(move || {
                        numa::pin_current_thread(&cpus);
                        helper(&inner)
                    })?,
            );
        }
        Ok(pool)
    }

    /// Threads that copy with a caller (the caller not counted).
    pub fn helpers(&self) -> usize {
        self.threads.len()
    }

    /// Runs `work(0..parts)` on the caller and the helpers; returns when
    /// all are done. False when some part panicked (its work is unfinished).
    pub fn run<'w>(&self, parts: usize, work: &'w (dyn Fn(usize) + Sync + 'w)) -> bool {
        let want = parts.saturating_sub(1).min(self.threads.len());
        if want == 0 {
            return std::panic::catch_unwind(AssertUnwindSafe(|| (0..parts).for_each(work)))
                .is_ok();
        }
        // SAFETY: only the lifetime is erased. `Withdraw` below keeps this
        // frame alive until no helper can reach `work` any more.
        let work: &'static Work =
            unsafe { std::mem::transmute::<&'w (dyn Fn(usize) + Sync + 'w), &'static Work>(work) };
        let job = Arc::new(Job {
            work,
            parts,
            next: AtomicUsize::new(0),
            busy: AtomicUsize::new(0),
            waiting: Mutex::new(false),
            idle: Condvar::new(),
            panicked: AtomicBool::new(false),
        });
        let asleep = {
            let mut q = lock(&self.inner.queue);
            for _ in 0..want {
                q.tickets.push_back(job.clone());
            }
            self.inner.queued.fetch_add(want, Ordering::Release);
            q.sleepers
        };
        // Helpers still watching the queue take their tickets unwoken.
        for _ in 0..want.min(asleep) {
            self.inner.wake.notify_one();
        }
        let guard = Withdraw {
            job: &job,
            inner: &self.inner,
        };
        if std::panic::catch_unwind(AssertUnwindSafe(|| job.drain())).is_err() {
            job.panicked.store(true, Ordering::SeqCst);
        }
        drop(guard);
        !job.panicked.load(Ordering::SeqCst)
    }
}

/// Withdraws a job's queued tickets and waits for helpers inside it; runs
/// on every exit of `run`, unwinding included.
struct Withdraw<'a> {
    job: &'a Arc<Job>,
    inner: &'a Inner,
}

impl Drop for Withdraw<'_> {
    fn drop(&mut self) {
        {
            let mut q = lock(&self.inner.queue);
            let before = q.tickets.len();
            q.tickets.retain(|t| !Arc::ptr_eq(t, self.job));
            self.inner
                .queued
                .fetch_sub(before - q.tickets.len(), Ordering::Relaxed);
        }
        let busy = &self.job.busy;
        if spin_until(|| busy.load(Ordering::Acquire) == 0) {
            return;
        }
        let mut waiting = lock(&self.job.waiting);
        while busy.load(Ordering::Acquire) > 0 {
            *waiting = true;
            waiting = self
                .job
                .idle
                .wait(waiting)
                .unwrap_or_else(|p| p.into_inner());
        }
    }
}

fn helper(inner: &Inner) {
    loop {
        spin_until(|| inner.queued.load(Ordering::Acquire) > 0);
        let job = {
            let mut q = lock(&inner.queue);
            loop {
                if q.stop {
                    return;
                }
                if let Some(job) = q.tickets.pop_front() {
                    inner.queued.fetch_sub(1, Ordering::Relaxed);
                    // Counted busy before the queue lock is released, so a
                    // caller withdrawing its tickets waits for this one.
                    job.busy.fetch_add(1, Ordering::AcqRel);
                    break job;
                }
                q.sleepers += 1;
                q = inner.wake.wait(q).unwrap_or_else(|p| p.into_inner());
                q.sleepers -= 1;
            }
        };
        if std::panic::catch_unwind(AssertUnwindSafe(|| job.drain())).is_err() {
            job.panicked.store(true, Ordering::SeqCst);
        }
        if job.busy.fetch_sub(1, Ordering::AcqRel) == 1 {
            // The caller checks `busy` under this lock before it sleeps, so
            // it either sees 0 or is asleep by the time this lock is ours.
            if *lock(&job.waiting) {
                job.idle.notify_all();
            }
        }
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        lock(&self.inner.queue).stop = true;
        self.inner.wake.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

/// How many threads copy one job (caller included): a number, or every CPU
/// of the memory's NUMA node that this process may use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Copiers {
    Auto,
    Fixed(usize),
}

impl Copiers {
    /// From the `shm.copy_threads` setting; Err explains a bad value.
    pub fn parse(v: Option<&str>) -> Result<Copiers, String> {
        match v.map(str::trim) {
            None | Some("" | "auto") => Ok(Copiers::Auto),
            Some(s) => match s.parse::<usize>() {
                Ok(n @ 1..=256) => Ok(Copiers::Fixed(n)),
                _ => Err(format!(
                    "FERRY_SHM_COPY_THREADS={s:?} is not 'auto' or a number from 1 to 256"
                )),
            },
        }
    }

    /// Threads for memory on `node` (caller included).
    pub fn for_node(self, node: u32) -> usize {
        match self {
            Copiers::Fixed(n) => n,
            Copiers::Auto => numa::node_cpus(node).len().clamp(1, 256),
        }
    }
}

/// The pools of one instance, by NUMA node.
pub struct Pools {
    copiers: Copiers,
    nodes: numa::NodeMap,
    pools: Mutex<HashMap<u32, Arc<Pool>>>,
    /// Called once per pool created, with a line for the log.
    announce: Box<dyn Fn(&str) + Send + Sync>,
}

impl Pools {
    pub fn new(copiers: Copiers, announce: Box<dyn Fn(&str) + Send + Sync>) -> Pools {
        Pools {
            copiers,
            nodes: numa::NodeMap::read(),
            pools: Mutex::default(),
            announce,
        }
    }

    /// The pool near `node` (a node this host has; else the caller's).
    pub fn near(&self, node: Option<u32>) -> Option<Arc<Pool>> {
        let node = self.nodes.resolve(node);
        let mut pools = lock(&self.pools);
        if let Some(p) = pools.get(&node) {
            return Some(p.clone());
        }
        let copiers = self.copiers.for_node(node);
        let cpus = numa::node_cpus(node);
        let pool = match Pool::new(copiers - 1, cpus.clone()) {
            Ok(p) => Arc::new(p),
            Err(e) => {
                (self.announce)(&format!(
                    "shm: cannot start copy threads ({e}); each transfer copies on its caller's \
                     thread"
                ));
                Arc::new(Pool::new(0, BTreeSet::new()).ok()?)
            }
        };
        (self.announce)(&format!(
            "shm: large transfers split over {copiers} thread(s) (the caller and {} copy \
             thread(s) on NUMA node {node}'s {} CPU(s)); FERRY_SHM_COPY_THREADS sets the number",
            pool.helpers(),
            cpus.len()
        ));
        pools.insert(node, pool.clone());
        Some(pool)
    }

    /// Copy threads running now, over all pools.
    #[cfg(test)]
    pub fn threads(&self) -> usize {
        lock(&self.pools).values().map(|p| p.helpers()).sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_part_runs_once_on_several_threads() {
        let pool = Pool::new(3, BTreeSet::new()).unwrap();
        for parts in [0, 1, 2, 3, 4, 17, 1000] {
            let hits: Vec<AtomicUsize> = (0..parts).map(|_| AtomicUsize::new(0)).collect();
            assert!(pool.run(parts, &|i| {
                hits[i].fetch_add(1, Ordering::Relaxed);
            }));
            assert!(hits.iter().all(|h| h.load(Ordering::Relaxed) == 1));
        }
    }

    #[test]
    fn concurrent_callers_share_the_pool_and_a_panic_is_reported() {
        let pool = Arc::new(Pool::new(2, BTreeSet::new()).unwrap());
        let total = Arc::new(AtomicUsize::new(0));
        let callers: Vec<_> = (0..4)
            .map(|_| {
                let (pool, total) = (pool.clone(), total.clone());
                std::thread::spawn(move || {
                    for _ in 0..200 {
                        pool.run(8, &|_| {
                            total.fetch_add(1, Ordering::Relaxed);
                        });
                    }
                })
            })
            .collect();
        for c in callers {
            c.join().unwrap();
        }
        assert_eq!(total.load(Ordering::Relaxed), 4 * 200 * 8);
        let ok = pool.run(4, &|i| {
            if i == 3 {
                panic!("part 3 fails");
            }
        });
        assert!(!ok);
        // The pool still works after a part panicked.
        assert!(pool.run(4, &|_| {}));
    }

    #[test]
    fn settings_parse_and_pools_do_not_grow_per_call() {
        assert_eq!(Copiers::parse(None), Ok(Copiers::Auto));
        assert_eq!(Copiers::parse(Some(" 4 ")), Ok(Copiers::Fixed(4)));
        assert!(Copiers::parse(Some("0")).is_err());
        assert!(Copiers::parse(Some("many")).is_err());
        let pools = Pools::new(Copiers::Fixed(3), Box::new(|_| {}));
        for _ in 0..10 {
            pools.near(None).unwrap();
            pools.near(Some(100_000)).unwrap();
        }
        assert_eq!(pools.threads(), 2);
    }
}
