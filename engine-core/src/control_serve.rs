//! Serving authenticated control connections without a thread each: one
//! I/O thread drives every connection's reads and writes by readiness
//! (epoll, through `polling`), each connection a state machine
//! (`control_conn`), and a fixed pool of [`WORKERS`] threads answers the
//! requests (`ControlHandler::request` may block), handing replies back to
//! the I/O thread.
//!
//! Who may stay: at most `max_per_host` connections per host and
//! `max_total` in all. A newcomer over a cap takes the place of the
//! longest-idle connection (idle for [`EVICTABLE_AFTER`] at least) of its
//! own host, or at the total cap of the host holding the most; when none
//! is that idle, the newcomer is told BUSY.

use crate::control::{ControlHandler, MsgType};
use crate::control_budget::{BodyBudget, Held};
use crate::control_conn::{Conn, Due, Failure, Progress};
use crate::error::ErrorCode;
use ferry_plugins_abi::sdk::admission::{Refusal, Source};
use ferry_plugins_abi::sdk::gate::Admitted;
use polling::{Event, Events, Poller};
use std::collections::{HashMap, VecDeque};
use std::io;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Threads answering requests.
pub(crate) const WORKERS: usize = 2;
/// A connection idle at least this long may be closed for a newcomer.
pub(crate) const EVICTABLE_AFTER: Duration = Duration::from_secs(1);
/// How often the loop looks at its stop flag when nothing happens.
const TICK: Duration = Duration::from_millis(100);
/// A refused connection is closed this much after its last bytes, so the
/// peer reads why before a reset (as the gate does).
const LINGER: Duration = Duration::from_millis(200);
const MAX_LINGERING: usize = 256;

/// Counts and logs one refusal (the listener's `REFUSALS`).
pub(crate) type Refuse = Arc<dyn Fn(Refusal, String) + Send + Sync>;

pub(crate) struct ServeConfig {
    pub io_timeout: Duration,
    pub idle_timeout: Duration,
    pub max_per_host: usize,
    pub max_total: usize,
}

enum Job {
    Request {
        conn: u64,
        kind: MsgType,
        body: Vec<u8>,
        held: Held,
    },
    Closed(u64),
}

enum Reply {
    Frame(MsgType, Vec<u8>),
    /// The engine is gone: close the connection.
    Close,
}

#[derive(Default)]
struct Jobs {
    queue: VecDeque<Job>,
    stop: bool,
}

#[derive(Default)]
struct Replies {
    ready: Vec<(u64, Reply)>,
    /// The I/O loop has stopped: a worker closes its connection itself.
    loop_gone: bool,
}

/// What the control plane's I/O loop and its workers share (not the
/// engine's `Shared`: this one only moves control messages).
struct ServeState {
    poller: Poller,
    stop: AtomicBool,
    incoming: Mutex<Vec<Admitted>>,
    replies: Mutex<Replies>,
    jobs: Mutex<Jobs>,
    job_ready: Condvar,
    handler: Weak<dyn ControlHandler>,
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ServeState {
    fn push_job(&self, job: Job) {
        lock(&self.jobs).queue.push_back(job);
        self.job_ready.notify_one();
    }

    fn closed(&self, conn: u64) {
        if let Some(h) = self.handler.upgrade() {
            h.connection_closed(conn);
        }
    }
}

/// The running I/O thread and workers; dropping it stops them and closes
/// every connection (it waits for the I/O thread only).
pub(crate) struct Serve {
    shared: Arc<ServeState>,
    threads: Vec<JoinHandle<()>>,
}

impl Serve {
    pub(crate) fn start(
        handler: Weak<dyn ControlHandler>,
        config: ServeConfig,
        refuse: Refuse,
    ) -> io::Result<Serve> {
        let shared = Arc::new(ServeState {
            poller: Poller::new()?,
            stop: AtomicBool::new(false),
            incoming: Mutex::default(),
            replies: Mutex::default(),
            jobs: Mutex::default(),
            job_ready: Condvar::new(),
            handler,
        });
        let mut serve = Serve {
            shared: shared.clone(),
            threads: Vec::new(),
        };
        for i in 0..WORKERS {
            let s = shared.clone();
            serve.threads.push(
                std::thread::Builder::new()
                    .name(format!("ferry-control-w{i}"))
                    .spawn(move || work(&s))?,
            );
        }
        let s = shared.clone();
        serve.threads.push(
            std::thread::Builder::new()
                .name("ferry-control-io".into())
                .spawn(move || {
                    let mut lp = Loop {
                        shared: &s,
                        config,
                        refuse,
                        budget: BodyBudget::default(),
                        conns: HashMap::new(),
                        lingering: VecDeque::new(),
                        next_id: 0,
                    };
                    lp.run();
                })?,
        );
        Ok(serve)
    }

    /// Hands a proven connection to the I/O thread (the gate calls this).
    pub(crate) fn admitter(&self) -> impl FnMut(Admitted) + Send + 'static {
        let shared = self.shared.clone();
        move |a| {
            lock(&shared.incoming).push(a);
            let _ = shared.poller.notify();
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::SeqCst);
        let _ = self.shared.poller.notify();
        // The I/O thread is last: it ends first, then the workers finish
        // what it left them.
        if let Some(io) = self.threads.pop() {
            let _ = io.join();
        }
        // Workers finish the jobs left and end on their own, unwaited: one
        // may be inside the engine (a request blocks on a lock the thread
        // dropping the engine holds), as connection threads were before.
        lock(&self.shared.jobs).stop = true;
        self.shared.job_ready.notify_all();
        self.threads.clear();
    }
}

/// A worker: answers requests, one at a time, until told to stop and no
/// job is left.
fn work(shared: &ServeState) {
    loop {
        let job = {
            let mut jobs = lock(&shared.jobs);
            loop {
                if let Some(j) = jobs.queue.pop_front() {
                    break j;
                }
                if jobs.stop {
                    return;
                }
                jobs = shared
                    .job_ready
                    .wait(jobs)
                    .unwrap_or_else(|p| p.into_inner());
            }
        };
        match job {
            Job::Closed(conn) => shared.closed(conn),
            Job::Request {
                conn,
                kind,
                body,
                held,
            } => {
                let reply = match shared.handler.upgrade() {
                    None => Reply::Close,
                    Some(h) => answer(&*h, conn, kind, &body),
                };
                drop((body, held));
                let gone = {
                    let mut r = lock(&shared.replies);
                    if !r.loop_gone {
                        r.ready.push((conn, reply));
                    }
                    r.loop_gone
                };
                if gone {
                    shared.closed(conn);
                } else {
                    let _ = shared.poller.notify();
                }
            }
        }
    }
}

/// One request's reply; a panic in the handler is an error reply, not a
/// lost worker.
fn answer(h: &dyn ControlHandler, conn: u64, kind: MsgType, body: &[u8]) -> Reply {
    let run = || match kind {
        MsgType::GetDescriptor => Ok((MsgType::Descriptor, h.descriptor().to_json())),
        k => h.request(conn, k, body),
    };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).unwrap_or_else(|_| {
        Err(crate::error::Error::new(
            ErrorCode::Panic,
            "the engine panicked answering this request",
        ))
    });
    match result {
        Ok((kind, body)) => Reply::Frame(kind, body),
        Err(e) => Reply::Frame(
            MsgType::Error,
            crate::control::error_body(e.code, &e.message),
        ),
    }
}

/// What admitting a newcomer from `host` takes.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Admit {
    Yes,
    /// Close this idle connection first (refused as this kind).
    Evict(u64, Refusal),
    /// Turn the newcomer away.
    Refuse(Refusal),
}

/// Decides a newcomer's fate from the connections served: (id, host, how
/// long idle, None while busy).
pub(crate) fn choose(
    host: Source,
    served: &[(u64, Source, Option<Duration>)],
    max_per_host: usize,
    max_total: usize,
) -> Admit {
    let longest_idle = |of: Source| {
        served
            .iter()
            .filter(|(_, h, idle)| *h == of && idle.is_some_and(|d| d >= EVICTABLE_AFTER))
            .max_by_key(|(_, _, idle)| *idle)
            .map(|(id, _, _)| *id)
    };
    let mut per_host: HashMap<Source, usize> = HashMap::new();
    for (_, h, _) in served {
        *per_host.entry(*h).or_insert(0) += 1;
    }
    if per_host.get(&host).copied().unwrap_or(0) >= max_per_host {
        return match longest_idle(host) {
            Some(id) => Admit::Evict(id, Refusal::PerSource),
            None => Admit::Refuse(Refusal::PerSource),
        };
    }
    if served.len() >= max_total {
        // The host holding the most gives way (of equals, one with an
        // evictable connection).
        let top = per_host
            .iter()
            .max_by_key(|(h, n)| (**n, longest_idle(**h).is_some()))
            .map(|(h, _)| *h);
        return match top.and_then(longest_idle) {
            Some(id) => Admit::Evict(id, Refusal::Full),
            None => Admit::Refuse(Refusal::Full),
        };
    }
    Admit::Yes
}

/// Whether the peer has closed its side (or reset): seen without reading
/// what it sent before.
fn hung_up(stream: &TcpStream) -> bool {
    use std::os::fd::AsRawFd;
    let mut pfd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLRDHUP,
        revents: 0,
    };
    // SAFETY: one valid pollfd for the duration of the call; a zero timeout
    // never blocks.
    let n = unsafe { libc::poll(&mut pfd, 1, 0) };
    n > 0 && pfd.revents & (libc::POLLRDHUP | libc::POLLHUP | libc::POLLERR) != 0
}

struct Slot {
    conn: Conn,
    stream: TcpStream,
    /// The interest armed now (one-shot: gone once reported).
    armed: Option<(bool, bool, bool)>,
}

struct Loop<'a> {
    shared: &'a ServeState,
    config: ServeConfig,
    refuse: Refuse,
    budget: BodyBudget,
    conns: HashMap<u64, Slot>,
    lingering: VecDeque<(Instant, TcpStream)>,
    next_id: u64,
}

impl Loop<'_> {
    fn run(&mut self) {
        let mut events = Events::new();
        while !self.shared.stop.load(Ordering::SeqCst) {
            let now = Instant::now();
            let mut wait = TICK;
            for s in self.conns.values() {
                if let Some(t) = s.conn.next_due() {
                    wait = wait.min(t.saturating_duration_since(now));
                }
            }
            if let Some((t, _)) = self.lingering.front() {
                wait = wait.min(t.saturating_duration_since(now));
            }
            self.arm();
            events.clear();
            let _ = self.shared.poller.wait(&mut events, Some(wait));
            let now = Instant::now();
            for ev in events.iter() {
                let id = ev.key as u64;
                let Some(s) = self.conns.get_mut(&id) else {
                    continue;
                };
                let was = s.armed.take();
                if was == Some((false, false, false)) {
                    // Nothing was asked for: the peer reset or hung up
                    // (reported whatever the interest).
                    self.close(id, false);
                    continue;
                }
                // Waiting for the budget, only a hang-up is asked for.
                let hung_up = ev.is_interrupt() || was.is_some_and(|w| w.2 && !w.0);
                if ev.writable {
                    self.write(id, now);
                }
                if ev.readable || hung_up {
                    self.read(id, now, hung_up);
                }
            }
            let replies = std::mem::take(&mut lock(&self.shared.replies).ready);
            for (id, reply) in replies {
                self.deliver(id, reply, now);
            }
            // Bytes given back since: frames waiting for the budget go on;
            // those still waiting are looked at for a hang-up (before any
            // newcomer is counted against their places).
            let stalled: Vec<u64> = self
                .conns
                .iter()
                .filter(|(_, s)| s.conn.stalled())
                .map(|(id, _)| *id)
                .collect();
            for id in stalled {
                let hung_up = self.conns.get(&id).is_some_and(|s| hung_up(&s.stream));
                self.read(id, now, hung_up);
            }
            let incoming = std::mem::take(&mut *lock(&self.shared.incoming));
            for a in incoming {
                self.admit(a, now);
            }
            self.deadlines(now);
            while self.lingering.front().is_some_and(|(t, _)| *t <= now) {
                self.lingering.pop_front();
            }
        }
        self.shutdown();
    }

    /// Arms each connection's interest for what it waits for now.
    fn arm(&mut self) {
        for (id, s) in self.conns.iter_mut() {
            let want = (s.conn.wants_read(), s.conn.wants_write(), s.conn.stalled());
            if s.armed == Some(want) {
                continue;
            }
            let mut ev = Event::new(*id as usize, want.0, want.1);
            if want.2 {
                // Waiting for the budget: a reset is still reported (a peer
                // that only closed its side is looked for every round).
                ev = ev.with_interrupt();
            }
            if self.shared.poller.modify(&s.stream, ev).is_ok() {
                s.armed = Some(want);
            }
        }
    }

    fn read(&mut self, id: u64, now: Instant, hung_up: bool) {
        let Some(s) = self.conns.get_mut(&id) else {
            return;
        };
        let progress = s.conn.read_from(&mut &s.stream, now);
        match progress {
            Progress::Wait => {}
            Progress::Stalled if hung_up => self.close(id, false),
            Progress::Stalled => {}
            Progress::Gone => self.close(id, false),
            Progress::Closed(f) => self.fail(id, f, now),
            Progress::Frame(kind, body, held) => {
                if kind.is_request() {
                    self.shared.push_job(Job::Request {
                        conn: id,
                        kind,
                        body,
                        held,
                    });
                } else {
                    s.conn.reply_error(
                        ErrorCode::Protocol,
                        "unexpected message type for a request",
                        now,
                    );
                    self.write(id, now);
                }
            }
        }
    }

    fn write(&mut self, id: u64, now: Instant) {
        let Some(s) = self.conns.get_mut(&id) else {
            return;
        };
        match s.conn.write_to(&mut &s.stream, now) {
            // Once all has left, reading is armed again (never a read from
            // here: a peer's stream of bad frames must not nest calls).
            Ok(_) => {}
            Err(f) => self.fail(id, f, now),
        }
    }

    fn deliver(&mut self, id: u64, reply: Reply, now: Instant) {
        let Some(s) = self.conns.get_mut(&id) else {
            // Closed while its request was answered: closed for good now.
            self.shared.push_job(Job::Closed(id));
            return;
        };
        match reply {
            Reply::Frame(kind, body) => {
                s.conn.reply(kind, &body, now);
                self.write(id, now);
            }
            Reply::Close => {
                log::debug!(
                    "control connection from {}: the engine is gone; closing it",
                    s.conn.peer
                );
                s.conn.end_request();
                self.close(id, false);
            }
        }
    }

    fn deadlines(&mut self, now: Instant) {
        let due: Vec<(u64, Due)> = self
            .conns
            .iter()
            .filter(|(_, s)| s.conn.next_due().is_some_and(|t| t <= now))
            .map(|(id, s)| (*id, s.conn.check(now)))
            .collect();
        for (id, d) in due {
            match d {
                Due::Nothing => {}
                Due::Idle => {
                    if let Some(s) = self.conns.get(&id) {
                        log::debug!(
                            "control connection from {}: idle for {} s; closing it",
                            s.conn.peer,
                            self.config.idle_timeout.as_secs()
                        );
                    }
                    self.close(id, false);
                }
                Due::Closed(f) => self.fail(id, f, now),
            }
        }
    }

    /// Closes a connection for `f`: counted as a refusal (or logged at
    /// debug), the peer told why when it should be.
    fn fail(&mut self, id: u64, f: Failure, now: Instant) {
        let Some(s) = self.conns.get_mut(&id) else {
            return;
        };
        match f.refusal {
            Some(kind) => (self.refuse)(kind, f.error.message.clone()),
            None => log::debug!("control connection: {}", f.error.message),
        }
        if f.tell {
            s.conn.reply_error(f.error.code, &f.error.message, now);
            let _ = s.conn.write_to(&mut &s.stream, now);
        }
        self.close(id, f.tell);
    }

    /// Forgets a connection: its socket closes now, or lingers a moment
    /// after a last word; its owner hears of it once no request of it is
    /// being answered.
    fn close(&mut self, id: u64, told: bool) {
        let Some(s) = self.conns.remove(&id) else {
            return;
        };
        let _ = self.shared.poller.delete(&s.stream);
        if told {
            self.linger(s.stream);
        }
        if !s.conn.busy() {
            self.shared.push_job(Job::Closed(id));
        }
    }

    fn linger(&mut self, stream: TcpStream) {
        let _ = stream.shutdown(Shutdown::Write);
        if self.lingering.len() >= MAX_LINGERING {
            self.lingering.pop_front();
        }
        self.lingering.push_back((Instant::now() + LINGER, stream));
    }

    fn admit(&mut self, a: Admitted, now: Instant) {
        let Admitted {
            fd,
            peer,
            source,
            session,
        } = a;
        self.next_id += 1;
        let id = self.next_id;
        let stream = TcpStream::from(fd);
        let _ = stream.set_nodelay(true);
        let mut conn = Conn::new(
            peer,
            session,
            self.budget.hold(source),
            self.config.io_timeout,
            self.config.idle_timeout,
            now,
        );
        let served: Vec<(u64, Source, Option<Duration>)> = self
            .conns
            .iter()
            .map(|(id, s)| (*id, s.conn.host, s.conn.idle_for(now)))
            .collect();
        let (per_host, total) = (self.config.max_per_host, self.config.max_total);
        let from_host = served.iter().filter(|(_, h, _)| *h == source).count();
        let cap = |kind: Refusal| match kind {
            Refusal::PerSource => format!(
                "{from_host} control connections from its host are served (control_max_per_host \
                 = {per_host})"
            ),
            _ => format!("{total} control connections are served (the most)"),
        };
        match choose(source, &served, per_host, total) {
            Admit::Yes => {}
            Admit::Evict(old, kind) => {
                if let Some(s) = self.conns.get_mut(&old) {
                    let idle = s.conn.idle_for(now).unwrap_or_default().as_secs();
                    (self.refuse)(
                        kind,
                        format!(
                            "{}: idle for {idle} s, closed for a newer connection from {} ({})",
                            s.conn.peer,
                            conn.peer,
                            cap(kind)
                        ),
                    );
                    s.conn.reply_error(
                        ErrorCode::Busy,
                        "this idle control connection was closed for a newer one; reconnect when \
                     needed",
                        now,
                    );
                    let _ = s.conn.write_to(&mut &s.stream, now);
                    self.close(old, true);
                }
            }
            Admit::Refuse(kind) => {
                (self.refuse)(
                    kind,
                    format!(
                        "{}: {}, none idle for {} s",
                        conn.peer,
                        cap(kind),
                        EVICTABLE_AFTER.as_secs()
                    ),
                );
                conn.reply_error(
                    ErrorCode::Busy,
                    "too many control connections from this host are busy; try again",
                    now,
                );
                let _ = conn.write_to(&mut &stream, now);
                self.linger(stream);
                // Never served: its owner has nothing of it to drop.
                return;
            }
        }
        // SAFETY: the socket stays open while registered: it lives in the
        // slot, and `close` and `shutdown` delete it from the poller before
        // the slot (and the socket) go.
        let added = unsafe { self.shared.poller.add(&stream, Event::none(id as usize)) };
        if let Err(e) = added {
            log::warn!(
                "control connection from {}: cannot watch it ({e}); closing it",
                conn.peer
            );
            return;
        }
        self.conns.insert(
            id,
            Slot {
                conn,
                stream,
                armed: Some((false, false, false)),
            },
        );
        // Its first request may have come with the proof.
        self.read(id, now, false);
    }

    /// The loop is stopping: every connection closes, and each owner
    /// hears of it (from a worker once a request being answered is done).
    fn shutdown(&mut self) {
        let left = {
            let mut r = lock(&self.shared.replies);
            r.loop_gone = true;
            std::mem::take(&mut r.ready)
        };
        for (id, _) in left {
            self.conns.remove(&id);
            self.shared.push_job(Job::Closed(id));
        }
        let ids: Vec<u64> = self.conns.keys().copied().collect();
        for id in ids {
            self.close(id, false);
        }
        for a in std::mem::take(&mut *lock(&self.shared.incoming)) {
            drop(a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn host(i: u8) -> Source {
        Source::ip(std::net::Ipv4Addr::new(127, 0, 0, i).into())
    }

    const IDLE: Option<Duration> = Some(Duration::from_secs(5));
    const FRESH: Option<Duration> = Some(Duration::from_millis(10));

    #[test]
    fn a_host_at_its_cap_gives_up_its_longest_idle_or_the_newcomer_waits() {
        let served = [
            (1, host(2), FRESH),
            (2, host(2), IDLE),
            (3, host(2), Some(Duration::from_secs(9))),
            (4, host(3), IDLE),
        ];
        assert_eq!(
            choose(host(2), &served, 3, 128),
            Admit::Evict(3, Refusal::PerSource)
        );
        // Another host is not at its cap.
        assert_eq!(choose(host(3), &served, 3, 128), Admit::Yes);
        // Nothing idle for a second: the newcomer is refused, not a
        // connection in use.
        let busy = [(1, host(2), FRESH), (2, host(2), None), (3, host(2), FRESH)];
        assert_eq!(
            choose(host(2), &busy, 3, 128),
            Admit::Refuse(Refusal::PerSource)
        );
    }

    #[test]
    fn at_the_total_cap_the_host_holding_the_most_gives_way() {
        let served = [
            (1, host(2), IDLE),
            (2, host(3), IDLE),
            (3, host(3), FRESH),
            (4, host(3), Some(Duration::from_secs(2))),
        ];
        assert_eq!(
            choose(host(9), &served, 32, 4),
            Admit::Evict(2, Refusal::Full)
        );
        let busy = [(1, host(2), IDLE), (2, host(3), None), (3, host(3), FRESH)];
        assert_eq!(choose(host(9), &busy, 32, 3), Admit::Refuse(Refusal::Full));
    }
}
