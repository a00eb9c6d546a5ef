//! Keeps this engine's segments registered: each stored under one lease,
//! which a keeper thread renews every third of its TTL.
//!
//! The rules that keep a registration from being lost while it is reported
//! made:
//!
//! - a lease is replaced only when etcd says it no longer knows it (it
//!   expired, or etcd lost its data), never because a renewal could not
//!   reach etcd: the keys are attached to it, and it may well be alive;
//! - a new lease is recorded with every key marked to be written again
//!   under it, and a key counts as stored only once its write under the
//!   current lease succeeded (a write that fails is retried next round);
//! - each round also reads the keys back: one deleted behind the keeper's
//!   back is written again; one that another engine registered under the
//!   same name since is left to it, with a warning;
//! - while etcd cannot be reached, a round runs every half interval, so
//!   that registration follows etcd's recovery within one interval, and
//!   "registered again" is logged only after a round in which every write
//!   succeeded.
//!
//! A process that never publishes (it only looks segments up) starts no
//! thread.

use super::failure::CallError;
use super::gateway;
use super::pool::Pool;
use crate::error::{Error, ErrorCode, Result};
use parking_lot::{Condvar, Mutex};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Leases granted by this keeper that it still recognises as its own.
const OWN_LEASES: usize = 16;

struct Entry {
    name: String,
    value: Vec<u8>,
    /// Bumped by every publication.
    generation: u64,
    /// (lease, generation) of the last write that succeeded.
    stored: Option<(i64, u64)>,
    /// Another engine registered this name since: no longer kept.
    yielded: bool,
}

#[derive(Default)]
struct State {
    entries: Vec<Entry>,
    lease: Option<i64>,
    /// Leases this keeper granted, newest last.
    granted: Vec<i64>,
    /// Why registration fails, while it does.
    lost: Option<String>,
    stop: bool,
    /// Run a round now.
    poke: bool,
    generations: u64,
}

impl State {
    fn names(&self) -> String {
        let names: Vec<&str> = self.entries.iter().map(|e| e.name.as_str()).collect();
        names.join(", ")
    }

    /// What is to be written under `lease`: (name, value, generation).
    fn pending(&self, lease: i64) -> Vec<(String, Vec<u8>, u64)> {
        self.entries
            .iter()
            .filter(|e| !e.yielded && e.stored != Some((lease, e.generation)))
            .map(|e| (e.name.clone(), e.value.clone(), e.generation))
            .collect()
    }
}

struct Shared {
    pool: Arc<Pool>,
    /// "<prefix>/segments/"
    key_prefix: String,
    ttl_s: u64,
    /// The deadline of a publication made by the engine.
    deadline: Duration,
    state: Mutex<State>,
    wake: Condvar,
    /// Held across the network calls of one store or round: the engine's
    /// publications and the keeper thread never grant or write at once.
    work: Mutex<()>,
}

pub struct Keeper {
    shared: Arc<Shared>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl Keeper {
    pub fn new(pool: Arc<Pool>, key_prefix: String, ttl_s: u64, deadline: Duration) -> Keeper {
        Keeper {
            shared: Arc::new(Shared {
                pool,
                key_prefix,
                ttl_s,
                deadline,
                state: Mutex::new(State::default()),
                wake: Condvar::new(),
                work: Mutex::new(()),
            }),
            thread: Mutex::new(None),
        }
    }

    /// Stores (or replaces) a segment's descriptor under this engine's
    /// lease. Waits for etcd, within the deadline, when etcd answered last
    /// time; when it did not, returns at once and the keeper stores it
    /// when etcd answers.
    pub fn publish(&self, name: &str, value: Vec<u8>) -> Result<()> {
        let s = &self.shared;
        {
            let mut st = s.state.lock();
            if st.stop {
                // The engine is going away: nothing to keep.
                return Ok(());
            }
            st.generations += 1;
            let generation = st.generations;
            match st.entries.iter_mut().find(|e| e.name == name) {
                Some(e) => {
                    e.value = value;
                    e.generation = generation;
                    if e.yielded {
                        return Err(Error::new(
                            ErrorCode::Busy,
                            format!(
                                "segment {name} is registered in etcd by another engine; this \
                                 engine no longer publishes it (give each engine its own \
                                 FERRY_NAME)"
                            ),
                        ));
                    }
                }
                None => st.entries.push(Entry {
                    name: name.to_string(),
                    value,
                    generation,
                    stored: None,
                    yielded: false,
                }),
            }
            if let Some(cause) = &st.lost {
                return Err(Error::new(
                    ErrorCode::Unavailable,
                    format!(
                        "segment {name} is not registered in etcd yet ({cause}); the keeper \
                         registers it when etcd answers"
                    ),
                ));
            }
        }
        self.start_thread();
        let _work = s.work.lock();
        match store_pending(s, Instant::now() + s.deadline) {
            Ok(()) => Ok(()),
            Err(e) => {
                let mut st = s.state.lock();
                st.lost.get_or_insert_with(|| e.cause_text());
                let e = e.to_error(&format!("cannot register segment {name} in etcd"));
                st.poke = true;
                s.wake.notify_all();
                Err(Error::new(
                    e.code,
                    format!("{}; retrying in the background", e.message),
                ))
            }
        }
    }

    fn start_thread(&self) {
        let mut thread = self.thread.lock();
        if thread.is_some() || self.shared.state.lock().stop {
            return;
        }
        let s = self.shared.clone();
        match std::thread::Builder::new()
            .name("ferry-etcd-keeper".into())
            .spawn(move || run(&s))
        {
            Ok(t) => *thread = Some(t),
            Err(e) => log::error!("metadata: cannot start the etcd keeper thread: {e}"),
        }
    }

    /// Stops the keeper and removes this engine's segments now (revoking
    /// the lease) rather than when the lease expires.
    pub fn withdraw(&self) {
        let s = &self.shared;
        let lease = {
            let mut st = s.state.lock();
            st.stop = true;
            st.entries.clear();
            s.wake.notify_all();
            st.lease.take()
        };
        if let Some(t) = self.thread.lock().take() {
            let _ = t.join();
        }
        if let Some(id) = lease {
            let _work = s.work.lock();
            if let Err(e) = gateway::revoke(&s.pool, id, Instant::now() + s.deadline) {
                log::info!(
                    "metadata: {}; its segments disappear when the lease expires",
                    e.to_error("cannot revoke this engine's lease")
                );
            }
        }
    }
}

/// The keeper thread.
fn run(s: &Shared) {
    let interval = Duration::from_millis(s.ttl_s * 1000 / 3);
    // A round may take half an interval, within the deadline.
    let budget = (interval / 2)
        .max(Duration::from_millis(200))
        .min(s.deadline);
    // The publication that started this thread just stored everything.
    let mut next = Instant::now() + interval;
    loop {
        {
            let mut st = s.state.lock();
            while !st.stop && !st.poke && Instant::now() < next {
                s.wake.wait_until(&mut st, next);
            }
            st.poke = false;
            if st.stop {
                return;
            }
        }
        let start = Instant::now();
        let result = {
            let _work = s.work.lock();
            if s.state.lock().stop {
                return;
            }
            round(s, start + budget)
        };
        let healthy = {
            let mut st = s.state.lock();
            match result {
                Ok(()) => {
                    if st.lost.take().is_some() && !st.entries.is_empty() {
                        log::info!(
                            "metadata: etcd answers again; segment {} registered",
                            st.names()
                        );
                    }
                    true
                }
                Err(e) => {
                    if st.lost.is_none() {
                        let cause = e.cause_text();
                        log::warn!(
                            "metadata: cannot keep segment {} registered: {cause}; transfers to \
                             open segments continue; retrying every {:?}",
                            st.names(),
                            interval / 2
                        );
                        st.lost = Some(cause);
                    }
                    false
                }
            }
        };
        s.pool.reprobe(Instant::now() + budget);
        next = start + if healthy { interval } else { interval / 2 };
    }
}

/// One round: renew the lease, write what is not stored, read the keys
/// back and restore any that went missing.
fn round(s: &Shared, deadline: Instant) -> Result<(), CallError> {
    let lease = {
        let st = s.state.lock();
        if st.entries.iter().all(|e| e.yielded) {
            return Ok(());
        }
        st.lease
    };
    if let Some(id) = lease {
        // An error here (etcd unreachable, no quorum) keeps the lease: it
        // may be alive, and the keys are attached to it.
        if gateway::keep_alive(&s.pool, id, deadline)? <= 0 {
            let mut st = s.state.lock();
            log::info!(
                "metadata: etcd no longer knows lease {id:x} (it expired, or etcd lost its \
                 data); registering segment {} under a new one",
                st.names()
            );
            forget_lease(&mut st);
        }
    }
    store_pending(s, deadline)?;
    if verify(s, deadline)? {
        store_pending(s, deadline)?;
    }
    Ok(())
}

fn forget_lease(st: &mut State) {
    st.lease = None;
    for e in &mut st.entries {
        e.stored = None;
    }
}

/// Writes every entry not stored under the current lease; grants a lease
/// first when there is none.
fn store_pending(s: &Shared, deadline: Instant) -> Result<(), CallError> {
    let lease = {
        let st = s.state.lock();
        match st.lease {
            Some(id) if st.pending(id).is_empty() => return Ok(()),
            None if st.entries.iter().all(|e| e.yielded) => return Ok(()),
            l => l,
        }
    };
    let id = match lease {
        Some(id) => id,
        None => {
            let id = gateway::grant(&s.pool, s.ttl_s, deadline)?;
            let mut st = s.state.lock();
            // Recorded with every key still to be written under it.
            forget_lease(&mut st);
            st.lease = Some(id);
            st.granted.push(id);
            if st.granted.len() > OWN_LEASES {
                st.granted.remove(0);
            }
            id
        }
    };
    let pending = s.state.lock().pending(id);
    for (name, value, generation) in pending {
        let key = format!("{}{name}", s.key_prefix);
        gateway::put(&s.pool, key.as_bytes(), &value, id, deadline)?;
        let mut st = s.state.lock();
        if st.lease == Some(id) {
            if let Some(e) = st.entries.iter_mut().find(|e| e.name == name) {
                e.stored = Some((id, generation));
            }
        }
    }
    Ok(())
}

/// Reads back every key counted as stored. Returns whether one has to be
/// written again.
fn verify(s: &Shared, deadline: Instant) -> Result<bool, CallError> {
    let (lease, stored): (Option<i64>, Vec<String>) = {
        let st = s.state.lock();
        (
            st.lease,
            st.entries
                .iter()
                .filter(|e| !e.yielded && e.stored.is_some())
                .map(|e| e.name.clone())
                .collect(),
        )
    };
    let Some(lease) = lease else {
        return Ok(false);
    };
    let mut again = false;
    for name in stored {
        let key = format!("{}{name}", s.key_prefix);
        let found = gateway::range(&s.pool, key.as_bytes(), false, true, deadline)?;
        let mut st = s.state.lock();
        let owner = found.first().map(|kv| kv.lease);
        let own = owner.is_some_and(|l| st.granted.contains(&l));
        let Some(e) = st.entries.iter_mut().find(|e| e.name == name) else {
            continue;
        };
        match owner {
            Some(l) if l == lease => {}
            None => {
                log::info!(
                    "metadata: segment {name} was removed from etcd behind this engine's back; \
                     storing it again"
                );
                e.stored = None;
                again = true;
            }
            Some(_) if own => {
                e.stored = None;
                again = true;
            }
            Some(l) => {
                log::warn!(
                    "metadata: segment {name} is now registered by another engine (lease \
                     {l:x}); this engine no longer keeps it registered"
                );
                e.yielded = true;
            }
        }
    }
    Ok(again)
}
