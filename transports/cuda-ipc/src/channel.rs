//! The side channel between cuda-ipc instances of one host: an abstract Unix
//! socket per instance (`sdk::local`). Handles only ever travel here, never
//! in the segment descriptor: a peer gets one only after the authentication
//! exchange and only when the kernel says (SO_PEERCRED) it runs as our
//! user.
//!
//! Admission is the SDK's gate (`sdk::gate`), as on every Ferry listener:
//! a process of another user is closed before a byte is read or sent, the
//! rest run the token exchange (kind "cuda-ipc") on the gate's one thread
//! under one deadline (auth_timeout_ms) in a pre-auth pool keyed by uid
//! (auth.max_pending, auth.max_pending_per_host; the oldest silent one is
//! evicted when it is full). Each authenticated peer is then served on a
//! thread of its own (at most `MAX_CONNECTIONS`; a peer's requests are few:
//! one per registration it opens).
//!
//! A client asks for a registration (OPEN) and gets its pieces, with a
//! descriptor per VMM chunk or host file; the server remembers who opened
//! what, and on unregister tells each of them (REVOKE) and waits until each
//! confirms (REVOKE_ACK) that it closed its mapping. A connection that
//! closes counts as confirmed: the process is gone or has dropped it.

use crate::wire::{self, Piece, Reply, Request, PIECE_LEN, REPLY_LEN, REQUEST_LEN};
use ferry_plugins_abi::sdk::admission::{Refusal, Refusals};
use ferry_plugins_abi::sdk::auth::{self, Token};
use ferry_plugins_abi::sdk::gate::{Admitted, Gate, GateConfig};
use ferry_plugins_abi::sdk::local;
use ferry_plugins_abi::sdk::{PluginError, PluginResult};
use ferry_plugins_abi::ErrorCode;
use std::collections::{HashMap, HashSet};
use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::time::{Duration, Instant};

/// How often blocked reads wake to check whether to stop.
const TICK: Duration = Duration::from_millis(100);
/// Connections one server serves at once.
const MAX_CONNECTIONS: usize = 1024;

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// What the server answers OPEN with: the registration's pieces and
/// descriptors, or why not.
pub struct Exported {
    pub addr: u64,
    pub len: u64,
    pub kind: u32,
    pub pieces: Vec<Piece>,
    pub fds: Vec<OwnedFd>,
}

pub type Lookup = dyn Fn(u64) -> Result<Arc<Exported>, PluginError> + Send + Sync;

struct Conn {
    stream: UnixStream,
    /// Serialises frames written to the stream.
    write: Mutex<()>,
    /// Registrations this peer opened.
    opened: Mutex<HashSet<u64>>,
    /// Revocations sent and not yet confirmed.
    awaiting: Mutex<HashSet<u64>>,
    alive: AtomicBool,
}

struct ServerState {
    conns: Mutex<HashMap<u64, Arc<Conn>>>,
    acked: Condvar,
    /// Paired with `acked`.
    ack_lock: Mutex<()>,
    stop: AtomicBool,
    lookup: Arc<Lookup>,
    /// The threads serving authenticated peers.
    workers: Mutex<Vec<std::thread::JoinHandle<()>>>,
    next_id: AtomicU64,
    refusals: Arc<Refusals>,
    log: Arc<dyn Fn(&str) + Send + Sync>,
}

/// Who may connect, and how refusals are counted and logged.
pub struct Admission {
    pub token: Option<Token>,
    /// The whole exchange's deadline (auth_timeout_ms).
    pub auth_timeout: Duration,
    /// Connections authenticating at once, in all and per uid.
    pub max_pending: usize,
    pub max_pending_per_source: usize,
    pub refusals: Arc<Refusals>,
    pub log: Arc<dyn Fn(&str) + Send + Sync>,
}

pub struct Server {
    state: Arc<ServerState>,
    gate: Option<Gate>,
}

impl Server {
    pub fn start(name: &[u8], lookup: Arc<Lookup>, admission: Admission) -> io::Result<Server> {
        let listener = local::listen(name)?;
        // SAFETY: getuid has no preconditions.
        let uid = unsafe { libc::getuid() };
        let state = Arc::new(ServerState {
            conns: Mutex::new(HashMap::new()),
            acked: Condvar::new(),
            ack_lock: Mutex::new(()),
            stop: AtomicBool::new(false),
            lookup,
            workers: Mutex::new(Vec::new()),
            next_id: AtomicU64::new(0),
            refusals: admission.refusals.clone(),
            log: admission.log.clone(),
        });
        let by_user = local::classify_by_user(
            Vec::new(),
            format!("CUDA handles go to the same user only: uid {uid}"),
        );
        let s = state.clone();
        let classify = move |fd: &OwnedFd| {
            let who = by_user(fd)?;
            let mut workers = lock(&s.workers);
            workers.retain(|w| !w.is_finished());
            if workers.len() >= MAX_CONNECTIONS {
                return Err((
                    Refusal::Full,
                    format!("{}: {MAX_CONNECTIONS} peers are connected", who.1),
                ));
            }
            Ok(who)
        };
        let s = state.clone();
        let on_admit = move |a: Admitted| admit(&s, a);
        let gate = Gate::start(
            OwnedFd::from(listener),
            "ferry-cuda-ipc-gate",
            GateConfig {
                // Bound into the proofs: peers of every version use it.
                kind: "cuda-ipc",
                token: admission.token,
                auth_timeout: admission.auth_timeout,
                max_pending: admission.max_pending,
                max_pending_per_source: admission.max_pending_per_source,
            },
            Box::new(classify),
            Box::new(on_admit),
            admission.refusals,
            admission.log,
        )?;
        Ok(Server {
            state,
            gate: Some(gate),
        })
    }

    /// Tells every peer that opened registration `id` to close it, and
    /// waits up to `timeout` for each to confirm; returns how many did not.
    pub fn revoke(&self, id: u64, timeout: Duration) -> usize {
        let conns: Vec<Arc<Conn>> = lock(&self.state.conns).values().cloned().collect();
        let mut waiting = Vec::new();
        for c in conns {
            if !lock(&c.opened).remove(&id) {
                continue;
            }
            lock(&c.awaiting).insert(id);
            let sent = {
                let _w = lock(&c.write);
                local::send_frame(&c.stream, &Reply::revoke(id).encode(), &[])
            };
            if sent.is_err() {
                c.alive.store(false, Ordering::SeqCst);
            }
            waiting.push(c);
        }
        let deadline = Instant::now() + timeout;
        let mut guard = lock(&self.state.ack_lock);
        loop {
            let missing = waiting
                .iter()
                .filter(|c| c.alive.load(Ordering::SeqCst) && lock(&c.awaiting).contains(&id))
                .count();
            let now = Instant::now();
            if missing == 0 || now >= deadline {
                return missing;
            }
            guard = self
                .state
                .acked
                .wait_timeout(guard, (deadline - now).min(TICK))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        // No new peers, then every served one closes and its thread ends.
        drop(self.gate.take());
        self.state.stop.store(true, Ordering::SeqCst);
        for c in lock(&self.state.conns).values() {
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
        }
        let workers = std::mem::take(&mut *lock(&self.state.workers));
        for w in workers {
            let _ = w.join();
        }
    }
}

/// Takes a proven peer (on the gate's thread) to a thread of its own.
fn admit(state: &Arc<ServerState>, a: Admitted) {
    let Admitted { fd, peer, .. } = a;
    let stream = UnixStream::from(fd);
    let id = state.next_id.fetch_add(1, Ordering::Relaxed) + 1;
    let s = state.clone();
    let spawned = std::thread::Builder::new()
        .name("ferry-cuda-ipc-peer".into())
        .spawn(move || serve(id, stream, &peer, &s));
    if let Ok(w) = spawned {
        let mut workers = lock(&state.workers);
        workers.retain(|w| !w.is_finished());
        workers.push(w);
    }
}

/// One authenticated peer's connection: answer until it leaves.
fn serve(conn_id: u64, stream: UnixStream, peer: &str, state: &Arc<ServerState>) {
    if stream.set_nonblocking(false).is_err() {
        return;
    }
    let _ = stream.set_read_timeout(Some(TICK));
    let _ = stream.set_write_timeout(Some(Duration::from_secs(5)));
    let Ok(write_stream) = stream.try_clone() else {
        return;
    };
    let conn = Arc::new(Conn {
        stream: write_stream,
        write: Mutex::new(()),
        opened: Mutex::new(HashSet::new()),
        awaiting: Mutex::new(HashSet::new()),
        alive: AtomicBool::new(true),
    });
    lock(&state.conns).insert(conn_id, conn.clone());
    let mut frame = [0u8; REQUEST_LEN];
    let mut broke = None;
    while !state.stop.load(Ordering::SeqCst) {
        match local::recv_frame(&stream, &mut frame) {
            Ok(Some(fds)) if fds.is_empty() => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            Ok(Some(_)) => {
                broke = Some("sent descriptors, which only servers send".to_string());
                break;
            }
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                broke = Some(e.to_string());
                break;
            }
            // Closed or failed.
            _ => break,
        }
        let Some(req) = Request::decode(&frame) else {
            broke = Some("sent a malformed request".to_string());
            break;
        };
        match req.op {
            wire::OP_OPEN => {
                let answer = (state.lookup)(req.id);
                if answer.is_ok() {
                    lock(&conn.opened).insert(req.id);
                }
                if send_reply(&conn, req.id, answer).is_err() {
                    break;
                }
            }
            _ => {
                lock(&conn.awaiting).remove(&req.id);
                let _g = lock(&state.ack_lock);
                state.acked.notify_all();
            }
        }
    }
    if let Some(why) = broke {
        let log = &state.log;
        state.refusals.record(
            Refusal::Protocol,
            || format!("{peer}: {why}; hung up"),
            |l| log(l),
        );
    }
    conn.alive.store(false, Ordering::SeqCst);
    lock(&state.conns).remove(&conn_id);
    let _g = lock(&state.ack_lock);
    state.acked.notify_all();
}

fn send_reply(conn: &Conn, id: u64, answer: Result<Arc<Exported>, PluginError>) -> io::Result<()> {
    let _w = lock(&conn.write);
    match answer {
        Ok(e) => {
            let header = Reply {
                op: wire::OP_REPLY,
                status: 0,
                id,
                addr: e.addr,
                len: e.len,
                kind: e.kind,
                count: e.pieces.len() as u32,
            };
            local::send_frame(&conn.stream, &header.encode(), &[])?;
            let mut fds = e.fds.iter();
            for p in &e.pieces {
                let fd: Vec<RawFd> = if p.has_fd {
                    fds.next().map(|f| f.as_raw_fd()).into_iter().collect()
                } else {
                    Vec::new()
                };
                local::send_frame(&conn.stream, &p.encode(), &fd)?;
            }
            Ok(())
        }
        Err(err) => {
            let mut msg = err.message.into_bytes();
            msg.truncate(wire::MAX_MESSAGE as usize);
            let header = Reply {
                op: wire::OP_REPLY,
                status: err.code.as_raw(),
                id,
                addr: 0,
                len: 0,
                kind: 0,
                count: msg.len() as u32,
            };
            local::send_frame(&conn.stream, &header.encode(), &[])?;
            if !msg.is_empty() {
                local::send_frame(&conn.stream, &msg, &[])?;
            }
            Ok(())
        }
    }
}

/// What a client learns when the server revokes or goes away.
pub trait ClientEvents: Send + Sync {
    /// Close registration `id`'s mapping; the server is told once this returns.
    fn revoke(&self, id: u64);
    /// The server is gone: close everything of it.
    fn closed(&self);
}

/// An opened registration, as the server sent it.
pub struct Opened {
    pub reply: Reply,
    pub pieces: Vec<Piece>,
    pub fds: Vec<OwnedFd>,
}

struct Slot {
    answer: Option<Result<Opened, PluginError>>,
}

/// A connection to one peer's server, with a reader thread for its frames.
pub struct Client {
    stream: UnixStream,
    /// One OPEN at a time per connection.
    opening: Mutex<()>,
    slot: Arc<(Mutex<Slot>, Condvar)>,
    dead: Arc<AtomicBool>,
    reader: Option<std::thread::JoinHandle<()>>,
    /// Frames written to the stream, one writer at a time.
    write: Arc<Mutex<()>>,
    pub opens: AtomicU64,
}

impl Client {
    /// Connects, authenticates, and checks that the socket's owner is the
    /// process the endpoint named and runs as our user.
    pub fn connect(
        socket: &[u8],
        expected_pid: i32,
        events: Arc<dyn ClientEvents>,
        token: Option<&Token>,
        timeout: Duration,
    ) -> Result<Client, String> {
        let stream = local::connect(socket, timeout)
            .map_err(|e| format!("cannot reach its cuda-ipc socket: {e}"))?;
        let cred = local::peer_credentials(&stream)
            .map_err(|e| format!("cannot read its socket's credentials: {e}"))?;
        // SAFETY: getuid has no preconditions.
        let uid = unsafe { libc::getuid() };
        if cred.uid != uid {
            return Err(format!(
                "its socket belongs to uid {}, not this process's uid {uid}: CUDA handles go to \
                 the same user only",
                cred.uid
            ));
        }
        if cred.pid != expected_pid {
            return Err(format!(
                "its socket belongs to pid {}, not the advertised pid {expected_pid}",
                cred.pid
            ));
        }
        let mut s = &stream;
        auth::connect(&mut s, token, "cuda-ipc", "the peer")
            .map_err(|e| format!("authentication failed: {e}"))?;
        let _ = stream.set_read_timeout(Some(TICK));
        let reader_stream = stream
            .try_clone()
            .map_err(|e| format!("cannot clone its socket: {e}"))?;
        let slot: Arc<(Mutex<Slot>, Condvar)> =
            Arc::new((Mutex::new(Slot { answer: None }), Condvar::new()));
        let dead = Arc::new(AtomicBool::new(false));
        let write = Arc::new(Mutex::new(()));
        let reader = {
            let (slot, dead, write) = (slot.clone(), dead.clone(), write.clone());
            std::thread::Builder::new()
                .name("ferry-cuda-ipc-client".into())
                .spawn(move || read_loop(&reader_stream, &slot, &dead, &write, &*events))
                .map_err(|e| format!("cannot start its reader thread: {e}"))?
        };
        Ok(Client {
            stream,
            opening: Mutex::new(()),
            slot,
            dead,
            reader: Some(reader),
            write,
            opens: AtomicU64::new(0),
        })
    }

    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    /// Asks for registration `id`'s pieces and descriptors.
    pub fn open(&self, id: u64, timeout: Duration) -> PluginResult<Opened> {
        let _one = lock(&self.opening);
        if self.is_dead() {
            return Err(PluginError::new(
                ErrorCode::Connection,
                "the peer has exited",
            ));
        }
        lock(&self.slot.0).answer = None;
        {
            let _w = lock(&self.write);
            let req = Request {
                op: wire::OP_OPEN,
                id,
            };
            local::send_frame(&self.stream, &req.encode(), &[]).map_err(|e| {
                PluginError::new(ErrorCode::Connection, format!("asking the peer: {e}"))
            })?;
        }
        self.opens.fetch_add(1, Ordering::Relaxed);
        let deadline = Instant::now() + timeout;
        let mut slot = lock(&self.slot.0);
        loop {
            if let Some(a) = slot.answer.take() {
                return a;
            }
            if self.is_dead() {
                return Err(PluginError::new(
                    ErrorCode::Connection,
                    "the peer has exited",
                ));
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(PluginError::new(
                    ErrorCode::Timeout,
                    format!("the peer did not answer within {} ms", timeout.as_millis()),
                ));
            }
            slot = self
                .slot
                .1
                .wait_timeout(slot, (deadline - now).min(TICK))
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        self.dead.store(true, Ordering::SeqCst);
        if let Some(t) = self.reader.take() {
            let _ = t.join();
        }
    }
}

fn protocol(msg: impl Into<String>) -> PluginError {
    PluginError::new(ErrorCode::Protocol, msg)
}

/// Reads the pieces (and descriptors) or the message after a reply header.
fn read_body(stream: &UnixStream, reply: Reply) -> io::Result<Result<Opened, PluginError>> {
    let wait = |stream: &UnixStream, buf: &mut [u8]| -> io::Result<Vec<OwnedFd>> {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            match local::recv_frame(stream, buf) {
                Ok(Some(fds)) => return Ok(fds),
                Ok(None) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Err(e)
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                    ) && Instant::now() < deadline =>
                {
                    continue
                }
                Err(e) => return Err(e),
            }
        }
    };
    if reply.status != 0 {
        let mut msg = vec![0u8; reply.count as usize];
        if !msg.is_empty() && !wait(stream, &mut msg)?.is_empty() {
            return Err(io::ErrorKind::InvalidData.into());
        }
        let code = ErrorCode::from_raw(reply.status).unwrap_or(ErrorCode::Plugin);
        return Ok(Err(PluginError::new(
            code,
            String::from_utf8_lossy(&msg).into_owned(),
        )));
    }
    let mut pieces = Vec::with_capacity(reply.count.min(1024) as usize);
    let mut fds = Vec::new();
    let mut bad = None;
    for _ in 0..reply.count {
        let mut b = [0u8; PIECE_LEN];
        let mut got = wait(stream, &mut b)?;
        match Piece::decode(&b) {
            Some(p) if p.has_fd == (got.len() == 1) => {
                fds.append(&mut got);
                pieces.push(p);
            }
            _ => {
                bad.get_or_insert_with(|| protocol("the peer sent a malformed piece"));
            }
        }
    }
    if let Some(e) = bad {
        return Ok(Err(e));
    }
    if let Err(why) = wire::check_pieces(&reply, &pieces) {
        return Ok(Err(protocol(format!("the peer's registration: {why}"))));
    }
    Ok(Ok(Opened { reply, pieces, fds }))
}

fn read_loop(
    stream: &UnixStream,
    slot: &(Mutex<Slot>, Condvar),
    dead: &AtomicBool,
    write: &Mutex<()>,
    events: &dyn ClientEvents,
) {
    let mut header = [0u8; REPLY_LEN];
    while !dead.load(Ordering::SeqCst) {
        match local::recv_frame(stream, &mut header) {
            Ok(Some(fds)) if fds.is_empty() => {}
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                continue
            }
            _ => break,
        }
        let Some(reply) = Reply::decode(&header) else {
            break;
        };
        if reply.op == wire::OP_REVOKE {
            events.revoke(reply.id);
            let _w = lock(write);
            let ack = Request {
                op: wire::OP_REVOKE_ACK,
                id: reply.id,
            };
            if local::send_frame(stream, &ack.encode(), &[]).is_err() {
                break;
            }
            continue;
        }
        let body = match read_body(stream, reply) {
            Ok(b) => b,
            Err(_) => break,
        };
        lock(&slot.0).answer = Some(body);
        slot.1.notify_all();
    }
    dead.store(true, Ordering::SeqCst);
    slot.1.notify_all();
    events.closed();
}

#[cfg(test)]
#[path = "channel_tests.rs"]
mod tests;
