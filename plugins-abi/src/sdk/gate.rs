//! One listener's admission, driven by a single thread for every
//! connection still proving itself: accept, classify the peer, run the
//! authentication exchange without blocking, and hand the proven
//! connection and its session keys to the listener's owner.
//!
//! An attacker cannot hold this door shut:
//! - no thread per pending connection: one poll loop drives them all;
//! - the whole exchange has one deadline (auth_timeout_ms);
//! - when the pending pool (in total, or for one source) is full, the
//!   *oldest* pending connection that has not sent its proof goes, not the
//!   newcomer. A real peer answers the greeting within a round trip, far
//!   sooner than a flood can open a pool's worth of connections after it,
//!   so silent connections that are reopened as fast as they are closed
//!   only ever evict each other;
//! - a proof that has arrived is checked before any new connection is
//!   accepted, in every round of the loop.
//!
//! An evicted peer is told BUSY (a DONE with the busy result, or a busy
//! greeting when it had none yet), so a real one retries.

use super::admission::{PreAuthPool, Refusal, Refusals, Source};
use super::auth::{AuthError, ServerExchange, Session, Token, HELLO_LEN, PROOF_LEN};
use std::collections::VecDeque;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often the loop looks at its stop flag when nothing happens.
const TICK: Duration = Duration::from_millis(50);
/// At most this many connections are accepted per round, so pending
/// proofs are checked between bursts of a flood.
const ACCEPTS_PER_ROUND: usize = 64;
/// A refused connection is shut down for writing (our last bytes, then
/// FIN) and closed this much later, so the peer reads why before a reset
/// (closing a socket with unread input sends one at once).
const LINGER: Duration = Duration::from_millis(200);
/// Refused connections lingering at most; beyond, the oldest closes now.
const MAX_LINGERING: usize = 256;

/// A proven connection: its socket (non-blocking), who it is, its keys.
pub struct Admitted {
    pub fd: OwnedFd,
    /// The peer in log words ("10.0.0.2:41234", "uid 1000 pid 77").
    pub peer: String,
    pub source: Source,
    pub session: Session,
}

/// Who a freshly accepted connection is, or why it may not even try (a
/// refusal for room, Busy, PerSource or Full, is told BUSY; any other is
/// closed without a byte).
pub type Classify = dyn Fn(&OwnedFd) -> Result<(Source, String), (Refusal, String)> + Send;
/// Takes each proven connection (called on the gate's thread: keep it short).
pub type OnAdmit = dyn FnMut(Admitted) + Send;
/// A line for the operator's log.
pub type Log = Arc<dyn Fn(&str) + Send + Sync>;

pub struct GateConfig {
    /// The exchange's kind ("control", "tcp", "shm"): bound into the proofs.
    pub kind: &'static str,
    pub token: Option<Token>,
    /// The whole exchange must finish within this.
    pub auth_timeout: Duration,
    pub max_pending: usize,
    pub max_pending_per_source: usize,
}

/// A running gate; dropping it stops the thread and closes what is pending.
pub struct Gate {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

struct Pending {
    fd: OwnedFd,
    source: Source,
    peer: String,
    accepted: Instant,
    deadline: Instant,
    exchange: Option<ServerExchange>,
    hello: [u8; HELLO_LEN],
    hello_sent: usize,
    proof: [u8; PROOF_LEN],
    proof_got: usize,
    /// Holds its place in the pool until it leaves.
    _slot: super::admission::PreAuthSlot,
}

impl Gate {
    /// Serves `listener` (a listening socket, TCP or Unix) on a thread of
    /// its own named `thread_name`.
    pub fn start(
        listener: OwnedFd,
        thread_name: &str,
        config: GateConfig,
        classify: Box<Classify>,
        on_admit: Box<OnAdmit>,
        refusals: Arc<Refusals>,
        log: Log,
    ) -> io::Result<Gate> {
        set_nonblocking(listener.as_raw_fd())?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name(thread_name.into())
            .spawn(move || {
                let mut door = Door {
                    listener,
                    pool: PreAuthPool::new(config.max_pending, config.max_pending_per_source),
                    config,
                    classify,
                    on_admit,
                    refusals,
                    log,
                    pending: VecDeque::new(),
                    lingering: VecDeque::new(),
                };
                while !stop2.load(Ordering::SeqCst) {
                    door.round();
                }
            })?;
        Ok(Gate {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct Door {
    listener: OwnedFd,
    config: GateConfig,
    pool: PreAuthPool,
    classify: Box<Classify>,
    on_admit: Box<OnAdmit>,
    refusals: Arc<Refusals>,
    log: Log,
    /// Oldest first.
    pending: VecDeque<Pending>,
    /// Refused connections about to close, oldest first.
    lingering: VecDeque<(Instant, OwnedFd)>,
}

enum Step {
    Waiting,
    Done(Box<Result<Session, AuthError>>),
    Failed(Refusal, String),
}

impl Door {
    fn refuse(&self, kind: Refusal, detail: String) {
        let log = &self.log;
        self.refusals.record(kind, || detail, |l| log(l));
    }

    /// Closes a refused connection after its last bytes reached the peer.
    fn linger(&mut self, fd: OwnedFd) {
        // SAFETY: shutdown on a socket we own.
        unsafe { libc::shutdown(fd.as_raw_fd(), libc::SHUT_WR) };
        if self.lingering.len() >= MAX_LINGERING {
            self.lingering.pop_front();
        }
        self.lingering.push_back((Instant::now() + LINGER, fd));
    }

    /// One poll over the listener and every pending connection.
    fn round(&mut self) {
        let now = Instant::now();
        let mut fds = Vec::with_capacity(self.pending.len() + 1);
        fds.push(libc::pollfd {
            fd: self.listener.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        });
        let mut wait = TICK;
        for p in &self.pending {
            let events = if p.hello_sent < HELLO_LEN {
                libc::POLLOUT
            } else {
                libc::POLLIN
            };
            fds.push(libc::pollfd {
                fd: p.fd.as_raw_fd(),
                events,
                revents: 0,
            });
            wait = wait.min(p.deadline.saturating_duration_since(now));
        }
        let ms = wait.as_millis().min(i32::MAX as u128) as i32;
        // SAFETY: `fds` is a valid array of fds.len() pollfds for the call.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, ms) };
        if n < 0 {
            return;
        }
        // Proofs first: a peer that answered is never evicted by what
        // arrives in the same round.
        let mut i = 0;
        let mut keep = VecDeque::with_capacity(self.pending.len());
        let now = Instant::now();
        while let Some(mut p) = self.pending.pop_front() {
            i += 1;
            let ready = fds.get(i).map(|f| f.revents != 0).unwrap_or(false);
            let step = if ready {
                advance(&mut p)
            } else {
                Step::Waiting
            };
            match step {
                Step::Waiting if now >= p.deadline => {
                    self.refuse(
                        Refusal::Timeout,
                        format!(
                            "{}: did not finish authenticating within {} ms",
                            p.peer,
                            self.config.auth_timeout.as_millis()
                        ),
                    );
                    self.linger(p.fd);
                }
                Step::Waiting => keep.push_back(p),
                Step::Failed(kind, why) => {
                    self.refuse(kind, format!("{}: {why}", p.peer));
                    self.linger(p.fd);
                }
                Step::Done(verdict) => match *verdict {
                    Err(e) => {
                        let kind = match &e {
                            AuthError::Refused(_) => Refusal::Auth,
                            _ => Refusal::Protocol,
                        };
                        self.refuse(kind, format!("{}: {e}", p.peer));
                        self.linger(p.fd);
                    }
                    Ok(session) => {
                        let Pending {
                            fd, source, peer, ..
                        } = p;
                        (self.on_admit)(Admitted {
                            fd,
                            peer,
                            source,
                            session,
                        });
                    }
                },
            }
        }
        self.pending = keep;
        while self.lingering.front().is_some_and(|(t, _)| *t <= now) {
            self.lingering.pop_front();
        }
        if fds[0].revents != 0 {
            for _ in 0..ACCEPTS_PER_ROUND {
                if !self.accept_one() {
                    break;
                }
            }
        }
    }

    /// Accepts one connection; false when none is waiting.
    fn accept_one(&mut self) -> bool {
        // SAFETY: accept4 on our listening socket; no address is asked for.
        let raw = unsafe {
            libc::accept4(
                self.listener.as_raw_fd(),
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            )
        };
        if raw < 0 {
            let e = io::Error::last_os_error();
            // Out of descriptors or memory: back off rather than spin.
            if !matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
            ) {
                std::thread::sleep(Duration::from_millis(5));
            }
            return false;
        }
        // SAFETY: a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(raw) };
        let (source, peer) = match (self.classify)(&fd) {
            Ok(who) => who,
            Err((kind, why)) => {
                // Turned away for room, not for who it is: told BUSY, so a
                // real peer retries. Anyone else learns nothing. Counted
                // first: whoever hears of a refusal finds it counted.
                self.refuse(kind, why);
                if matches!(kind, Refusal::Busy | Refusal::PerSource | Refusal::Full) {
                    let _ = send_all_now(fd.as_raw_fd(), &super::auth::busy_hello());
                    self.linger(fd);
                }
                return true;
            }
        };
        let slot = loop {
            match self.pool.enter(source) {
                Ok(slot) => break slot,
                Err(why) => {
                    // Full: the oldest silent one goes (of this source when
                    // the source is at its cap), never the newcomer.
                    let victim = self.pending.iter().position(|p| {
                        p.proof_got == 0 && (why != Refusal::PerSource || p.source == source)
                    });
                    match victim.and_then(|i| self.pending.remove(i)) {
                        Some(old) => {
                            let age = old.accepted.elapsed().as_millis();
                            self.refuse(
                                why,
                                format!(
                                    "{}: evicted after {age} ms without a proof, for a newer \
                                     connection ({} pending)",
                                    old.peer,
                                    self.pool.pending()
                                ),
                            );
                            busy(&old);
                            self.linger(old.fd);
                        }
                        None => {
                            // Everyone pending is mid-proof: the newcomer waits
                            // its turn by retrying.
                            self.refuse(
                                why,
                                format!(
                                    "{peer}: {} connections are being set up",
                                    self.pool.pending()
                                ),
                            );
                            let _ = send_all_now(fd.as_raw_fd(), &super::auth::busy_hello());
                            self.linger(fd);
                            return true;
                        }
                    }
                }
            }
        };
        let (exchange, hello) =
            match ServerExchange::start(self.config.token.as_ref(), self.config.kind) {
                Ok(x) => x,
                Err(e) => {
                    self.refuse(Refusal::Protocol, format!("{peer}: {e}"));
                    return true;
                }
            };
        let mut p = Pending {
            fd,
            source,
            peer,
            accepted: Instant::now(),
            deadline: Instant::now() + self.config.auth_timeout,
            exchange: Some(exchange),
            hello,
            hello_sent: 0,
            proof: [0; PROOF_LEN],
            proof_got: 0,
            _slot: slot,
        };
        // The greeting goes at once: a fresh socket's buffer takes it.
        match send_some(p.fd.as_raw_fd(), &p.hello[..]) {
            Ok(n) => p.hello_sent = n,
            Err(e) => {
                self.refuse(
                    Refusal::Protocol,
                    format!("{}: sending the greeting: {e}", p.peer),
                );
                return true;
            }
        }
        self.pending.push_back(p);
        true
    }
}

/// Moves one pending exchange as far as it goes without blocking.
fn advance(p: &mut Pending) -> Step {
    let fd = p.fd.as_raw_fd();
    if p.hello_sent < HELLO_LEN {
        match send_some(fd, &p.hello[p.hello_sent..]) {
            Ok(n) => p.hello_sent += n,
            Err(e) => return Step::Failed(Refusal::Protocol, format!("sending the greeting: {e}")),
        }
        if p.hello_sent < HELLO_LEN {
            return Step::Waiting;
        }
    }
    while p.proof_got < PROOF_LEN {
        let rest = &mut p.proof[p.proof_got..];
        // SAFETY: `rest` is writable for its length.
        let n = unsafe { libc::recv(fd, rest.as_mut_ptr().cast(), rest.len(), libc::MSG_DONTWAIT) };
        if n == 0 {
            return Step::Failed(
                Refusal::Protocol,
                "closed the connection before proving itself".into(),
            );
        }
        if n < 0 {
            let e = io::Error::last_os_error();
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
            ) {
                return Step::Waiting;
            }
            return Step::Failed(Refusal::Protocol, format!("reading its proof: {e}"));
        }
        p.proof_got += n as usize;
    }
    let Some(exchange) = p.exchange.take() else {
        return Step::Failed(Refusal::Protocol, "answered twice".into());
    };
    let (done, verdict) = exchange.finish(&p.proof);
    // The verdict is 40 bytes into a socket that holds nothing of ours.
    if let Some(done) = done {
        if let Err(e) = send_all_now(fd, &done) {
            if verdict.is_ok() {
                return Step::Failed(Refusal::Protocol, format!("sending the verdict: {e}"));
            }
        }
    }
    Step::Done(Box::new(verdict))
}

/// Tells an evicted connection it was turned away as busy.
fn busy(p: &Pending) {
    let fd = p.fd.as_raw_fd();
    if p.hello_sent == 0 {
        let _ = send_all_now(fd, &super::auth::busy_hello());
    } else if p.hello_sent == HELLO_LEN {
        let _ = send_all_now(fd, &super::auth::busy_done());
    }
}

fn send_some(fd: RawFd, bytes: &[u8]) -> io::Result<usize> {
    // SAFETY: `bytes` is readable for its length.
    let n = unsafe {
        libc::send(
            fd,
            bytes.as_ptr().cast(),
            bytes.len(),
            libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL,
        )
    };
    if n < 0 {
        let e = io::Error::last_os_error();
        if matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
        ) {
            return Ok(0);
        }
        return Err(e);
    }
    Ok(n as usize)
}

/// Sends a short message that must go whole now.
fn send_all_now(fd: RawFd, bytes: &[u8]) -> io::Result<()> {
    if send_some(fd, bytes)? == bytes.len() {
        Ok(())
    } else {
        Err(io::Error::new(
            io::ErrorKind::WouldBlock,
            "the socket did not take a short message",
        ))
    }
}

fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we own, with no pointers.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    // SAFETY: fcntl on the same descriptor we own, with an int argument.
    if flags < 0 || unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// Classifies a TCP connection by its peer's address (an IPv6 /64 is one
/// source).
pub fn classify_tcp(fd: &OwnedFd) -> Result<(Source, String), (Refusal, String)> {
    // SAFETY: a zeroed sockaddr_storage is valid for getpeername to fill.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: ss is writable for `len` bytes.
    let rc = unsafe {
        libc::getpeername(
            fd.as_raw_fd(),
            (&mut ss as *mut libc::sockaddr_storage).cast(),
            &mut len,
        )
    };
    if rc != 0 {
        return Err((
            Refusal::Protocol,
            format!("a peer that left at once: {}", io::Error::last_os_error()),
        ));
    }
    let addr = sockaddr_to_std(&ss).ok_or_else(|| {
        (
            Refusal::Protocol,
            "a peer of an unknown address family".to_string(),
        )
    })?;
    Ok((Source::ip(addr.ip()), addr.to_string()))
}

fn sockaddr_to_std(ss: &libc::sockaddr_storage) -> Option<std::net::SocketAddr> {
    use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
    match i32::from(ss.ss_family) {
        libc::AF_INET => {
            // SAFETY: the family says the storage holds a sockaddr_in.
            let a = unsafe { &*(ss as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            Some(SocketAddr::V4(SocketAddrV4::new(
                Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr)),
                u16::from_be(a.sin_port),
            )))
        }
        libc::AF_INET6 => {
            // SAFETY: the family says the storage holds a sockaddr_in6.
            let a = unsafe { &*(ss as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            Some(SocketAddr::V6(SocketAddrV6::new(
                Ipv6Addr::from(a.sin6_addr.s6_addr),
                u16::from_be(a.sin6_port),
                a.sin6_flowinfo,
                a.sin6_scope_id,
            )))
        }
        _ => None,
    }
}

#[cfg(test)]
#[path = "gate_tests.rs"]
mod tests;
