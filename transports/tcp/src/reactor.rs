//! The I/O threads: a fixed set of loops, each driving many connections
//! through readiness (epoll, through the `polling` crate), so a target or an
//! initiator with a thousand connections still runs a handful of threads.
//!
//! A connection is a [`Handler`]: the loop calls it when its socket is
//! ready, when its timer is due, or when another thread woke it, always on
//! the loop's thread, and the handler answers what it waits for next
//! ([`Want`]: readable, writable, a time, or to be closed). Interest is
//! one-shot: nothing is reported twice unless the handler asks again, so a
//! handler whose socket is also read by a waiting caller (the initiator's
//! latency path) is not woken for bytes that caller takes.
//!
//! While any of its connections were busy in the last
//! [`DEEP_SLEEP_AFTER`], a loop also looks at the connections that asked
//! for a lazy look ([`Registration::poke`]) every [`LAZY_POLL`], without
//! being woken for each; after that it sleeps until woken.

use polling::{Event, Events, Poller};
use std::collections::{BinaryHeap, HashMap};
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often a busy loop looks at connections that asked for a lazy look.
pub const LAZY_POLL: Duration = Duration::from_millis(1);
/// After this long without work a loop sleeps until woken.
const DEEP_SLEEP_AFTER: Duration = Duration::from_secs(1);
/// A sleeping loop still looks at its stop flag this often.
const TICK: Duration = Duration::from_millis(100);

/// Why a handler is called.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Ready {
    /// Its socket is readable and/or writable (or has an error or hang-up,
    /// which the next read or write reports).
    Io { readable: bool, writable: bool },
    /// Its time came, another thread woke it, or it asked for a lazy look.
    Look,
}

/// What a handler waits for next.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Want {
    pub read: bool,
    pub write: bool,
    /// Call again at this time (a deadline, an idle timeout).
    pub at: Option<Instant>,
    /// Poll this loop without sleeping for this long (a peer that sends
    /// its next request right after a response gets it picked up without
    /// a wake-up).
    pub spin: Option<Duration>,
    /// Done: forget the connection (the handler closes its socket).
    pub close: bool,
}

impl Want {
    pub fn close() -> Want {
        Want {
            close: true,
            ..Want::default()
        }
    }
}

/// A connection driven by a loop.
pub trait Handler: Send + Sync + 'static {
    /// Its socket, valid until the handler is dropped.
    fn fd(&self) -> RawFd;
    /// Called on the loop's thread only, never twice at once.
    fn ready(&self, why: Ready) -> Want;
}

#[derive(Default)]
struct Commands {
    add: Vec<(usize, Arc<dyn Handler>, Want)>,
    remove: Vec<usize>,
    look: Vec<usize>,
    /// The loop sleeps until notified: a poke must wake it.
    deep: bool,
}

struct Shared {
    poller: Poller,
    commands: Mutex<Commands>,
    stop: AtomicBool,
    next_key: AtomicUsize,
    /// Connections registered now (for reports and tests).
    connections: AtomicUsize,
}

/// A connection's place in a loop: how other threads wake it or remove it.
#[derive(Clone)]
pub struct Registration {
    shared: Arc<Shared>,
    key: usize,
}

impl Registration {
    /// Starts driving `handler`, waiting for `want` first.
    pub fn start(&self, handler: Arc<dyn Handler>, want: Want) {
        self.shared.commands().add.push((self.key, handler, want));
        let _ = self.shared.poller.notify();
    }

    /// Has the loop call the handler (`Ready::Look`) now.
    pub fn wake(&self) {
        self.shared.commands().look.push(self.key);
        let _ = self.shared.poller.notify();
    }

    /// Has the loop call the handler at its next lazy look (within
    /// [`LAZY_POLL`] while the loop is busy), waking it only when it sleeps.
    pub fn poke(&self) {
        let deep = {
            let mut c = self.shared.commands();
            c.look.push(self.key);
            c.deep
        };
        if deep {
            let _ = self.shared.poller.notify();
        }
    }

    /// Stops driving the handler; the loop drops it soon after.
    pub fn remove(&self) {
        self.shared.commands().remove.push(self.key);
        let _ = self.shared.poller.notify();
    }
}

impl Shared {
    fn commands(&self) -> std::sync::MutexGuard<'_, Commands> {
        self.commands.lock().unwrap_or_else(|p| p.into_inner())
    }
}

/// The I/O threads of one transport instance.
pub struct Reactor {
    loops: Vec<Arc<Shared>>,
    threads: Vec<JoinHandle<()>>,
    next: AtomicUsize,
}

impl Reactor {
    /// Starts `threads` loops (at least one).
    pub fn start(threads: usize, name: &str) -> io::Result<Reactor> {
        let mut loops = Vec::new();
        let mut handles = Vec::new();
        for i in 0..threads.max(1) {
            let shared = Arc::new(Shared {
                poller: Poller::new()?,
                commands: Mutex::default(),
                stop: AtomicBool::new(false),
                next_key: AtomicUsize::new(1),
                connections: AtomicUsize::new(0),
            });
            let s2 = shared.clone();
            let spawned = std::thread::Builder::new()
                .name(format!("{name}-{i}"))
                .spawn(move || run(&s2));
            match spawned {
                Ok(h) => handles.push(h),
                Err(e) => {
                    let r = Reactor {
                        loops,
                        threads: handles,
                        next: AtomicUsize::new(0),
                    };
                    drop(r);
                    return Err(e);
                }
            }
            loops.push(shared);
        }
        Ok(Reactor {
            loops,
            threads: handles,
            next: AtomicUsize::new(0),
        })
    }

    /// A place for a new connection, on the loops in turn.
    pub fn place(&self) -> Registration {
        let i = self.next.fetch_add(1, Ordering::Relaxed) % self.loops.len();
        let shared = self.loops[i].clone();
        let key = shared.next_key.fetch_add(1, Ordering::Relaxed);
        Registration { shared, key }
    }

    pub fn threads(&self) -> usize {
        self.loops.len()
    }

    /// Connections the loops drive now.
    pub fn connections(&self) -> usize {
        self.loops
            .iter()
            .map(|l| l.connections.load(Ordering::Relaxed))
            .sum()
    }
}

impl Drop for Reactor {
    fn drop(&mut self) {
        for l in &self.loops {
            l.stop.store(true, Ordering::SeqCst);
            let _ = l.poller.notify();
        }
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

struct Entry {
    handler: Arc<dyn Handler>,
    /// Its pending timer, if any (stale heap entries are skipped).
    at: Option<Instant>,
    registered: bool,
    /// The interest armed in the poller now (one-shot: gone once reported).
    armed: Option<(bool, bool)>,
    /// The interest it asked for (re-armed when a spin ends).
    wants: (bool, bool),
}

/// A connection the loop polls directly for a while, its poller interest
/// disarmed, so a request right after a response costs one poll and no
/// wake-up or re-arming.
#[derive(Clone, Copy)]
struct Spin {
    key: usize,
    fd: RawFd,
    until: Instant,
}

struct Loop<'a> {
    shared: &'a Shared,
    entries: HashMap<usize, Entry>,
    timers: BinaryHeap<std::cmp::Reverse<(Instant, usize)>>,
    spin: Option<Spin>,
    last_work: Instant,
}

fn run(shared: &Shared) {
    let mut lp = Loop {
        shared,
        entries: HashMap::new(),
        timers: BinaryHeap::new(),
        spin: None,
        last_work: Instant::now(),
    };
    let mut events = Events::new();
    while !shared.stop.load(Ordering::SeqCst) {
        let mut wait_now = false;
        if let Some(spin) = lp.spin {
            match lp.spin_once(spin) {
                SpinStep::Again => continue,
                SpinStep::Poller => wait_now = true,
                SpinStep::Over => lp.end_spin(),
            }
        }
        let now = Instant::now();
        let busy = now.duration_since(lp.last_work) < DEEP_SLEEP_AFTER;
        let mut wait = if busy { LAZY_POLL } else { TICK };
        if let Some(std::cmp::Reverse((at, _))) = lp.timers.peek() {
            wait = wait.min(at.saturating_duration_since(now));
        }
        if wait_now {
            wait = Duration::ZERO;
        }
        {
            let mut c = shared.commands();
            if !c.add.is_empty() || !c.remove.is_empty() || !c.look.is_empty() {
                wait = Duration::ZERO;
            }
            c.deep = !busy;
        }
        events.clear();
        let _ = shared.poller.wait(&mut events, Some(wait));
        let got: Vec<Event> = events.iter().collect();
        if !got.is_empty() {
            lp.last_work = Instant::now();
        }
        lp.commands();
        for ev in got {
            if let Some(e) = lp.entries.get_mut(&ev.key) {
                e.armed = None;
            }
            lp.call(
                ev.key,
                Ready::Io {
                    readable: ev.readable,
                    writable: ev.writable,
                },
            );
        }
        lp.timers_due();
    }
    // Stopping: forget every connection (their owners close them).
    for (_, e) in lp.entries.drain() {
        if e.registered {
            // SAFETY: the handler (alive in `e`) keeps its socket open.
            let _ = shared
                .poller
                .delete(unsafe { BorrowedFd::borrow_raw(e.handler.fd()) });
        }
    }
}

enum SpinStep {
    /// Nothing yet, or the spinning connection was served: spin on.
    Again,
    /// The poller has events (or commands arrived): take them, then spin on.
    Poller,
    /// The spin is over.
    Over,
}

impl Loop<'_> {
    /// One look at the spinning connection and at the poller, without
    /// waiting.
    fn spin_once(&mut self, spin: Spin) -> SpinStep {
        if Instant::now() >= spin.until || !self.entries.contains_key(&spin.key) {
            return SpinStep::Over;
        }
        let mut fds = [
            libc::pollfd {
                fd: spin.fd,
                events: libc::POLLIN,
                revents: 0,
            },
            libc::pollfd {
                fd: self.shared.poller.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            },
        ];
        // SAFETY: two valid pollfds for the duration of the call; the
        // spinning connection's handler keeps its socket open.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), 2, 0) };
        if n <= 0 {
            std::hint::spin_loop();
            return SpinStep::Again;
        }
        if fds[0].revents != 0 {
            self.last_work = Instant::now();
            self.call(
                spin.key,
                Ready::Io {
                    readable: true,
                    writable: false,
                },
            );
            return SpinStep::Again;
        }
        SpinStep::Poller
    }

    /// Hands the spinning connection back to the poller.
    fn end_spin(&mut self) {
        if let Some(spin) = self.spin.take() {
            if let Some(e) = self.entries.get(&spin.key) {
                let wants = e.wants;
                self.arm(spin.key, wants);
            }
        }
    }

    /// Arms `interest` for `key` in the poller unless it is armed already.
    fn arm(&mut self, key: usize, interest: (bool, bool)) {
        let Some(e) = self.entries.get_mut(&key) else {
            return;
        };
        if e.armed == Some(interest) {
            return;
        }
        let event = Event::new(key, interest.0, interest.1);
        let fd = e.handler.fd();
        if e.registered {
            // SAFETY: the handler, kept alive by this entry until `forget`
            // deletes the registration, keeps its socket open.
            let source = unsafe { BorrowedFd::borrow_raw(fd) };
            if self.shared.poller.modify(source, event).is_ok() {
                e.armed = Some(interest);
            }
        } else {
            // SAFETY: the handler, kept alive by this entry until `forget`
            // deletes the registration, keeps its socket open while it is
            // registered.
            if unsafe { self.shared.poller.add(fd, event) }.is_ok() {
                e.registered = true;
                e.armed = Some(interest);
            }
        }
    }

    fn commands(&mut self) {
        let (add, remove, look) = {
            let mut c = self.shared.commands();
            (
                std::mem::take(&mut c.add),
                std::mem::take(&mut c.remove),
                std::mem::take(&mut c.look),
            )
        };
        if !add.is_empty() || !look.is_empty() {
            self.last_work = Instant::now();
        }
        for (key, handler, want) in add {
            self.entries.insert(
                key,
                Entry {
                    handler,
                    at: None,
                    registered: false,
                    armed: None,
                    wants: (false, false),
                },
            );
            self.shared.connections.fetch_add(1, Ordering::Relaxed);
            self.apply(key, want);
        }
        for key in remove {
            self.forget(key);
        }
        for key in look {
            self.call(key, Ready::Look);
        }
    }

    fn call(&mut self, key: usize, why: Ready) {
        let Some(handler) = self.entries.get(&key).map(|e| e.handler.clone()) else {
            return;
        };
        let want = handler.ready(why);
        self.apply(key, want);
    }

    fn timers_due(&mut self) {
        let now = Instant::now();
        while let Some(std::cmp::Reverse((at, key))) = self.timers.peek().copied() {
            if at > now {
                break;
            }
            self.timers.pop();
            let due = self.entries.get_mut(&key).is_some_and(|e| e.at == Some(at));
            if due {
                if let Some(e) = self.entries.get_mut(&key) {
                    e.at = None;
                }
                self.call(key, Ready::Look);
            }
        }
    }

    fn apply(&mut self, key: usize, want: Want) {
        if want.close {
            self.forget(key);
            return;
        }
        let Some(e) = self.entries.get_mut(&key) else {
            return;
        };
        if e.at != want.at {
            e.at = want.at;
            if let Some(at) = want.at {
                self.timers.push(std::cmp::Reverse((at, key)));
            }
        }
        e.wants = (want.read, want.write);
        let fd = e.handler.fd();
        let spin = want.spin.filter(|_| want.read && !want.write);
        if let Some(spin) = spin {
            // Polled directly for a while: the poller need not report it.
            if self.spin.is_some_and(|s| s.key != key) {
                self.end_spin();
            }
            self.spin = Some(Spin {
                key,
                fd,
                until: Instant::now() + spin,
            });
            self.arm(key, (false, false));
            return;
        }
        if self.spin.is_some_and(|s| s.key == key) {
            self.spin = None;
        }
        self.arm(key, (want.read, want.write));
    }

    fn forget(&mut self, key: usize) {
        if self.spin.is_some_and(|s| s.key == key) {
            self.spin = None;
        }
        if let Some(e) = self.entries.remove(&key) {
            if e.registered {
                // SAFETY: the handler (alive in `e`) keeps its socket open.
                let _ = self
                    .shared
                    .poller
                    .delete(unsafe { BorrowedFd::borrow_raw(e.handler.fd()) });
            }
            self.shared.connections.fetch_sub(1, Ordering::Relaxed);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::os::fd::AsRawFd;
    use std::os::unix::net::UnixStream;
    use std::sync::mpsc;

    /// Reports each call; waits for reading, and for a timer 20 ms after
    /// its first call.
    struct Probe {
        sock: UnixStream,
        calls: mpsc::Sender<Ready>,
        started: Instant,
    }

    impl Handler for Probe {
        fn fd(&self) -> RawFd {
            self.sock.as_raw_fd()
        }
        fn ready(&self, why: Ready) -> Want {
            let _ = self.calls.send(why);
            Want {
                read: true,
                at: Some(self.started + Duration::from_millis(20)).filter(|t| *t > Instant::now()),
                ..Want::default()
            }
        }
    }

    #[test]
    fn a_loop_reports_readiness_timers_and_wakes_and_forgets_on_remove() {
        let reactor = Reactor::start(2, "test-io").unwrap();
        let (a, mut b) = UnixStream::pair().unwrap();
        a.set_nonblocking(true).unwrap();
        let (tx, rx) = mpsc::channel();
        let reg = reactor.place();
        reg.start(
            Arc::new(Probe {
                sock: a,
                calls: tx,
                started: Instant::now(),
            }),
            Want {
                read: true,
                at: Some(Instant::now() + Duration::from_millis(20)),
                ..Want::default()
            },
        );
        // The timer.
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(5)).unwrap(),
            Ready::Look
        );
        // Readiness (one-shot, re-armed by the handler's answer).
        b.write_all(b"x").unwrap();
        let got = rx.recv_timeout(Duration::from_secs(5)).unwrap();
        assert!(matches!(got, Ready::Io { readable: true, .. }), "{got:?}");
        // A wake.
        while rx.try_recv().is_ok() {}
        reg.wake();
        let mut saw_look = false;
        for _ in 0..10 {
            match rx.recv_timeout(Duration::from_secs(5)) {
                Ok(Ready::Look) => {
                    saw_look = true;
                    break;
                }
                Ok(_) => continue,
                Err(e) => panic!("no call after a wake: {e}"),
            }
        }
        assert!(saw_look);
        assert_eq!(reactor.connections(), 1);
        reg.remove();
        let t = Instant::now();
        while reactor.connections() != 0 && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(reactor.connections(), 0);
    }
}
