//! The owner side of the side channel (`channel`): who may connect, and
//! one thread serving every connected peer.
//!
//! Admission is the SDK's gate (`sdk::gate`), as on every Ferry listener:
//! the kernel names the connecting process (SO_PEERCRED) before a byte is
//! read or sent, and every user but this one (and `shm.allowed_uids`) is
//! closed at once; the rest run the token exchange on the gate's one thread
//! under one deadline (auth_timeout_ms) in a pre-auth pool keyed by uid
//! (auth.max_pending, auth.max_pending_per_host), where a full pool evicts
//! its oldest silent connection, not the newcomer.
//!
//! Serving: one thread drives every authenticated peer by readiness
//! (epoll, through `polling`), none per peer. A peer's MAP is answered at
//! once; when its socket does not take the answer, the answer is held and
//! the peer is not read again until it is sent, so a peer that never reads
//! costs one held message and blocks no one else. A peer may confirm only
//! revocations it was sent and has not confirmed yet: anything else hangs
//! up, so nothing a peer sends grows the owner's memory.

use crate::channel::{recv, send, try_send, Live, Lookup};
use crate::wire::{Msg, LIVE, LIVE_ERR, LIVE_OK, MAP, MAP_ERR, MAP_OK, REVOKE, REVOKE_ACK};
use ferry_plugins_abi::sdk::admission::{Refusal, Refusals};
use ferry_plugins_abi::sdk::auth::Token;
use ferry_plugins_abi::sdk::gate::{Admitted, Gate, GateConfig};
use ferry_plugins_abi::sdk::local;
use polling::{Event, Events, Poller};
use std::collections::{HashMap, HashSet};
use std::io;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often the serving thread looks at its stop flag when idle, and how
/// often a revocation's waiter looks at its peers.
const TICK: Duration = Duration::from_millis(100);
/// Peers connected to one instance's socket at once; more are told BUSY.
/// Every peer process needs one (it carries revocations).
pub const MAX_CONNECTIONS: usize = 1024;
/// Messages read from one peer per turn, so one busy peer cannot starve
/// the others.
const MESSAGES_PER_TURN: usize = 64;

/// Who may connect to the owner's socket, and how refusals are logged.
pub struct Admission {
    pub token: Option<Token>,
    /// The exchange's deadline (auth_timeout_ms).
    pub auth_timeout: Duration,
    /// Connections authenticating at once, in all and per uid
    /// (auth.max_pending, auth.max_pending_per_host).
    pub max_pending: usize,
    pub max_pending_per_source: usize,
    /// Users besides the owner's own whose processes may connect
    /// (shm.allowed_uids).
    pub allowed_uids: Vec<u32>,
    /// Counts (and hands on) every refusal.
    pub refusals: Arc<Refusals>,
    pub log: Arc<dyn Fn(&str) + Send + Sync>,
}

/// One connected peer, as the owner sees it.
struct Conn {
    fd: OwnedFd,
    peer: String,
    /// Revocations sent to this peer and not confirmed yet; only those
    /// may be confirmed.
    outstanding: Mutex<HashSet<u64>>,
    acked: Mutex<Vec<u64>>,
    cond: Condvar,
    dead: AtomicBool,
}

/// What the gate and the serving thread share.
struct Shared {
    poller: Poller,
    stop: AtomicBool,
    /// Connected peers by their poller key.
    conns: Mutex<HashMap<usize, Arc<Conn>>>,
    next_key: AtomicUsize,
}

/// The owner side: the gate on the listening socket, the serving thread
/// and every connected peer.
pub struct Server {
    gate: Option<Gate>,
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    next_id: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Server {
    /// Serves `listener` (a bound, listening SOCK_SEQPACKET socket).
    pub fn start(
        listener: OwnedFd,
        lookup: Arc<Lookup>,
        live: Arc<Live>,
        admission: Admission,
    ) -> io::Result<Server> {
        let Admission {
            token,
            auth_timeout,
            max_pending,
            max_pending_per_source,
            allowed_uids,
            refusals,
            log,
        } = admission;
        // SAFETY: geteuid has no preconditions.
        let own_uid = unsafe { libc::geteuid() };
        let shared = Arc::new(Shared {
            poller: Poller::new()?,
            stop: AtomicBool::new(false),
            conns: Mutex::new(HashMap::new()),
            next_key: AtomicUsize::new(0),
        });
        let (s2, r2, log2) = (shared.clone(), refusals.clone(), log.clone());
        let thread = std::thread::Builder::new()
            .name("ferry-shm-serve".into())
            .spawn(move || serve_all(&s2, &*lookup, &*live, &r2, &log2))?;
        let by_user = local::classify_by_user(
            allowed_uids,
            format!("only uid {own_uid} and shm.allowed_uids may connect"),
        );
        let s3 = shared.clone();
        let classify = move |fd: &OwnedFd| {
            let who = by_user(fd)?;
            let connected = lock(&s3.conns).len();
            if connected >= MAX_CONNECTIONS {
                return Err((
                    Refusal::Full,
                    format!("{}: {MAX_CONNECTIONS} peers are connected", who.1),
                ));
            }
            Ok(who)
        };
        let s4 = shared.clone();
        let on_admit = move |a: Admitted| admit(&s4, a);
        let gate = Gate::start(
            listener,
            "ferry-shm-gate",
            GateConfig {
                kind: "shm",
                token,
                auth_timeout,
                max_pending,
                max_pending_per_source,
            },
            Box::new(classify),
            Box::new(on_admit),
            refusals,
            log,
        );
        let gate = match gate {
            Ok(g) => g,
            Err(e) => {
                shared.stop.store(true, Ordering::SeqCst);
                let _ = shared.poller.notify();
                let _ = thread.join();
                return Err(e);
            }
        };
        Ok(Server {
            gate: Some(gate),
            shared,
            thread: Some(thread),
            next_id: AtomicU64::new(1),
        })
    }

    /// Tells every peer that registration `id` (of allocation `token`, or 0)
    /// is going away and waits (up to `timeout`) until each confirms it no
    /// longer touches it. Returns how many peers did not confirm in time.
    pub fn revoke(&self, id_revoked: u64, token: u64, timeout: Duration) -> usize {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let conns: Vec<Arc<Conn>> = lock(&self.shared.conns)
            .values()
            .filter(|c| !c.dead.load(Ordering::SeqCst))
            .cloned()
            .collect();
        let msg = Msg {
            kind: REVOKE,
            id,
            a: id_revoked,
            b: token,
        };
        let deadline = Instant::now() + timeout;
        let sent: Vec<Arc<Conn>> = conns
            .into_iter()
            .filter(|c| {
                // Outstanding before it is sent: the answer may be quick.
                lock(&c.outstanding).insert(id);
                send(c.fd.as_raw_fd(), msg, None, deadline).is_ok()
            })
            .collect();
        let mut missing = 0;
        for c in sent {
            let mut acked = lock(&c.acked);
            loop {
                if let Some(pos) = acked.iter().position(|a| *a == id) {
                    acked.swap_remove(pos);
                    break;
                }
                let now = Instant::now();
                if c.dead.load(Ordering::SeqCst) {
                    break;
                }
                if now >= deadline {
                    // A late answer is no longer expected: it hangs up.
                    lock(&c.outstanding).remove(&id);
                    missing += 1;
                    break;
                }
                acked = c
                    .cond
                    .wait_timeout(acked, (deadline - now).min(TICK))
                    .map(|(g, _)| g)
                    .unwrap_or_else(|p| p.into_inner().0);
            }
        }
        missing
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // No new peers, then the serving thread stops, then every peer's
        // socket closes (each peer learns the owner is gone).
        drop(self.gate.take());
        self.shared.stop.store(true, Ordering::SeqCst);
        let _ = self.shared.poller.notify();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let conns = std::mem::take(&mut *lock(&self.shared.conns));
        for c in conns.values() {
            let _ = self.shared.poller.delete(c.fd.as_fd());
            c.dead.store(true, Ordering::SeqCst);
            c.cond.notify_all();
            // SAFETY: shutting down a socket we own; a revocation waiting on
            // it sees it dead.
            unsafe { libc::shutdown(c.fd.as_raw_fd(), libc::SHUT_RDWR) };
        }
    }
}

/// Takes a proven peer (on the gate's thread): into the map, then into the
/// poller, waiting for its first message.
fn admit(shared: &Shared, a: Admitted) {
    let Admitted { fd, peer, .. } = a;
    let key = shared.next_key.fetch_add(1, Ordering::Relaxed);
    let conn = Arc::new(Conn {
        fd,
        peer,
        outstanding: Mutex::new(HashSet::new()),
        acked: Mutex::new(Vec::new()),
        cond: Condvar::new(),
        dead: AtomicBool::new(false),
    });
    lock(&shared.conns).insert(key, conn.clone());
    // SAFETY: the descriptor stays open while it is in the poller: it is
    // deleted from the poller before its connection leaves the map, and
    // the map's Arc keeps it open until then.
    let added = unsafe { shared.poller.add(conn.fd.as_raw_fd(), Event::readable(key)) };
    if added.is_err() {
        lock(&shared.conns).remove(&key);
    }
}

/// What a peer waits for next, or why it goes.
enum Next {
    Read,
    Write,
    /// Closed by the peer (None) or for breaking the protocol.
    Close(Option<String>),
}

/// A MAP answer its socket did not take yet, with the memfd it carries.
type Held = (Msg, Option<OwnedFd>);

/// The serving thread: every connected peer, by readiness.
fn serve_all(
    shared: &Shared,
    lookup: &Lookup,
    live: &Live,
    refusals: &Refusals,
    log: &Arc<dyn Fn(&str) + Send + Sync>,
) {
    let mut events = Events::new();
    let mut held: HashMap<usize, Held> = HashMap::new();
    while !shared.stop.load(Ordering::SeqCst) {
        events.clear();
        if shared.poller.wait(&mut events, Some(TICK)).is_err() {
            std::thread::sleep(Duration::from_millis(5));
            continue;
        }
        for ev in events.iter() {
            let Some(conn) = lock(&shared.conns).get(&ev.key).cloned() else {
                continue;
            };
            let next = drive(&conn, lookup, live, held.remove(&ev.key), &mut |h| {
                held.insert(ev.key, h);
            });
            let interest = match next {
                Next::Read => Event::readable(ev.key),
                Next::Write => Event::writable(ev.key),
                Next::Close(why) => {
                    if let Some(why) = why {
                        refusals.record(
                            Refusal::Protocol,
                            || format!("{}: {why}; hung up", conn.peer),
                            |l| log(l),
                        );
                    }
                    close(shared, ev.key, &conn);
                    held.remove(&ev.key);
                    continue;
                }
            };
            if shared.poller.modify(conn.fd.as_fd(), interest).is_err() {
                close(shared, ev.key, &conn);
                held.remove(&ev.key);
            }
        }
    }
}

fn close(shared: &Shared, key: usize, conn: &Conn) {
    let _ = shared.poller.delete(conn.fd.as_fd());
    lock(&shared.conns).remove(&key);
    conn.dead.store(true, Ordering::SeqCst);
    // Wakes a revocation waiting on this peer.
    let _g = lock(&conn.acked);
    conn.cond.notify_all();
}

/// Serves one peer as far as its socket allows without blocking.
fn drive(
    conn: &Conn,
    lookup: &Lookup,
    live: &Live,
    held: Option<Held>,
    hold: &mut dyn FnMut(Held),
) -> Next {
    let fd = conn.fd.as_raw_fd();
    if let Some((msg, memfd)) = held {
        match try_send(fd, msg, memfd.as_ref().map(AsRawFd::as_raw_fd)) {
            Ok(true) => {}
            Ok(false) => {
                hold((msg, memfd));
                return Next::Write;
            }
            Err(_) => return Next::Close(None),
        }
    }
    for _ in 0..MESSAGES_PER_TURN {
        let msg = match recv(fd) {
            Ok(Some((m, _ignored_fd))) => m,
            Ok(None) => return Next::Read,
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                return Next::Close(Some(format!("sent a malformed message: {e}")))
            }
            Err(_) => return Next::Close(None),
        };
        match msg.kind {
            MAP => {
                let (reply, memfd) = match lookup(msg.a) {
                    Some((memfd, len)) => (
                        Msg {
                            kind: MAP_OK,
                            id: msg.id,
                            a: msg.a,
                            b: len,
                        },
                        Some(memfd),
                    ),
                    None => (
                        Msg {
                            kind: MAP_ERR,
                            id: msg.id,
                            a: msg.a,
                            b: 0,
                        },
                        None,
                    ),
                };
                match try_send(fd, reply, memfd.as_ref().map(AsRawFd::as_raw_fd)) {
                    Ok(true) => {}
                    Ok(false) => {
                        // Not read again until this answer is sent.
                        hold((reply, memfd));
                        return Next::Write;
                    }
                    Err(_) => return Next::Close(None),
                }
            }
            LIVE => {
                let reply = Msg {
                    kind: if live(msg.a) { LIVE_OK } else { LIVE_ERR },
                    id: msg.id,
                    a: msg.a,
                    b: 0,
                };
                match try_send(fd, reply, None) {
                    Ok(true) => {}
                    Ok(false) => {
                        hold((reply, None));
                        return Next::Write;
                    }
                    Err(_) => return Next::Close(None),
                }
            }
            REVOKE_ACK => {
                if !lock(&conn.outstanding).remove(&msg.id) {
                    return Next::Close(Some(format!(
                        "confirmed revocation {} that is not outstanding",
                        msg.id
                    )));
                }
                lock(&conn.acked).push(msg.id);
                conn.cond.notify_all();
            }
            // Anything else from a peer is a protocol error: hang up.
            k => {
                return Next::Close(Some(format!(
                    "sent message kind {k}, which only owners send"
                )))
            }
        }
    }
    // More may be waiting: the next round reads on, after the others.
    Next::Read
}

#[cfg(test)]
#[path = "owner_tests.rs"]
mod tests;
