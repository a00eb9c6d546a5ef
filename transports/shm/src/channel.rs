//! The side channel between shm instances of one host: an abstract Unix
//! socket (SOCK_SEQPACKET, so messages keep their boundaries) per instance.
//!
//! A peer asks the owner for a memfd (MAP, answered with the fd itself over
//! SCM_RIGHTS, so mapping needs no ptrace permission), and the owner tells
//! every peer when a buffer goes away (REVOKE) and waits for each to confirm
//! that it no longer touches it (REVOKE_ACK). A peer that loses the socket
//! knows the owner is gone.
//!
//! Every message is 32 bytes (`wire::Msg`).
//!
//! Who may connect: the kernel names the process at the other end
//! (SO_PEERCRED), and before anything else is read or sent the owner
//! refuses every user but its own (and those in `shm.allowed_uids`); then
//! the token exchange (`sdk::auth`) runs under the short auth deadline,
//! checked on every packet, in a pool of its own (`sdk::admission`) apart
//! from the served connections. A peer may confirm only revocations it was
//! sent and has not confirmed yet: anything else hangs up, so nothing a peer
//! sends grows the owner's memory.

use crate::wire::{Msg, MAP, MAP_ERR, MAP_OK, MSG_LEN, REVOKE, REVOKE_ACK};
use ferry_plugins_abi::sdk::admission::{PreAuthPool, Refusal, Refusals, Source};
use ferry_plugins_abi::sdk::auth::{self, Token};
use std::collections::{HashMap, HashSet};
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often blocked reads wake to check whether to stop.
const TICK: Duration = Duration::from_millis(100);
/// Peers connected to one instance's socket at once; more are closed at
/// accept. Every peer process needs one (it carries revocations).
pub const MAX_CONNECTIONS: usize = 1024;
/// Connections authenticating at once (their own pool).
pub const MAX_PENDING: usize = 64;

fn abstract_addr(name: &[u8]) -> io::Result<(libc::sockaddr_un, libc::socklen_t)> {
    // SAFETY: a zeroed sockaddr_un is a valid value.
    let mut addr: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    addr.sun_family = libc::AF_UNIX as libc::sa_family_t;
    if name.len() + 1 > addr.sun_path.len() {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "socket name too long",
        ));
    }
    // sun_path[0] stays 0: the abstract namespace.
    for (dst, src) in addr.sun_path[1..].iter_mut().zip(name) {
        *dst = *src as libc::c_char;
    }
    let len = std::mem::size_of::<libc::sa_family_t>() + 1 + name.len();
    Ok((addr, len as libc::socklen_t))
}

fn seqpacket() -> io::Result<OwnedFd> {
    // SAFETY: socket() has no memory preconditions; the fd is checked.
    let fd = unsafe { libc::socket(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn set_timeouts(fd: RawFd) {
    let tv = libc::timeval {
        tv_sec: 0,
        tv_usec: TICK.as_micros() as libc::suseconds_t,
    };
    for opt in [libc::SO_RCVTIMEO, libc::SO_SNDTIMEO] {
        // SAFETY: setsockopt with a valid timeval of the right size.
        unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                (&tv as *const libc::timeval).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
    }
}

/// A connected socket as a byte stream for the authentication exchange:
/// each write is one packet, each read takes one; the short socket timeouts
/// are retried until `deadline`.
struct Handshake {
    fd: RawFd,
    deadline: std::time::Instant,
}

impl Handshake {
    fn again(&self, e: &io::Error) -> bool {
        matches!(
            e.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
        ) && std::time::Instant::now() < self.deadline
    }

    /// Checked before every packet, so a peer trickling its proof a byte
    /// per packet cannot stretch the deadline (at most one socket tick past
    /// it).
    fn in_time(&self) -> io::Result<()> {
        if std::time::Instant::now() >= self.deadline {
            return Err(io::Error::new(io::ErrorKind::TimedOut, "deadline passed"));
        }
        Ok(())
    }
}

impl io::Read for Handshake {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            self.in_time()?;
            // SAFETY: recv into a buffer of buf.len() bytes we own.
            let n = unsafe { libc::recv(self.fd, buf.as_mut_ptr().cast(), buf.len(), 0) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            if !self.again(&e) {
                return Err(e);
            }
        }
    }
}

impl io::Write for Handshake {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        loop {
            self.in_time()?;
            // SAFETY: send from a buffer of buf.len() bytes; MSG_NOSIGNAL: a
            // closed peer is an error, not a signal.
            let n =
                unsafe { libc::send(self.fd, buf.as_ptr().cast(), buf.len(), libc::MSG_NOSIGNAL) };
            if n >= 0 {
                return Ok(n as usize);
            }
            let e = io::Error::last_os_error();
            if !self.again(&e) {
                return Err(e);
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

fn handshake(fd: RawFd, timeout: Duration) -> Handshake {
    Handshake {
        fd,
        deadline: std::time::Instant::now() + timeout,
    }
}

/// The pid of the process at the other end of a Unix socket.
pub fn peer_pid(fd: RawFd) -> Option<i32> {
    peer_cred(fd).map(|c| c.pid)
}

/// The credentials of the process at the other end of a Unix socket (as
/// the kernel recorded them when it connected).
pub fn peer_cred(fd: RawFd) -> Option<libc::ucred> {
    // SAFETY: a zeroed ucred is valid storage.
    let mut cred: libc::ucred = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::ucred>() as libc::socklen_t;
    // SAFETY: getsockopt(SO_PEERCRED) writes at most len bytes into cred.
    let rc = unsafe {
        libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_PEERCRED,
            (&mut cred as *mut libc::ucred).cast(),
            &mut len,
        )
    };
    (rc == 0).then_some(cred)
}

/// Sends one message, with an fd attached when given.
fn send(fd: RawFd, msg: Msg, pass: Option<RawFd>) -> io::Result<()> {
    let bytes = msg.encode();
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // Room for one SCM_RIGHTS fd, aligned like a cmsghdr.
    let mut control = [0u64; 4];
    // SAFETY: a zeroed msghdr is valid; fields are set below.
    let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
    hdr.msg_iov = &mut iov;
    hdr.msg_iovlen = 1;
    if let Some(pass) = pass {
        // SAFETY: CMSG_SPACE is a pure computation.
        let space = unsafe { libc::CMSG_SPACE(std::mem::size_of::<RawFd>() as u32) } as usize;
        hdr.msg_control = control.as_mut_ptr().cast();
        hdr.msg_controllen = space;
        // SAFETY: msg_control points at `space` <= 32 writable, aligned bytes,
        // enough for one cmsghdr carrying one fd.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&hdr);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(std::mem::size_of::<RawFd>() as u32) as usize;
            std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<RawFd>(), pass);
        }
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        // SAFETY: hdr describes valid buffers for the call.
        let rc = unsafe { libc::sendmsg(fd, &hdr, libc::MSG_NOSIGNAL) };
        if rc == MSG_LEN as isize {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        if rc < 0 && e.kind() == io::ErrorKind::WouldBlock && Instant::now() < deadline {
            continue;
        }
        return Err(if rc < 0 {
            e
        } else {
            io::Error::new(io::ErrorKind::WriteZero, "short send")
        });
    }
}

/// Receives one message and any fd attached. Ok(None) on a tick timeout.
fn recv(fd: RawFd) -> io::Result<Option<(Msg, Option<OwnedFd>)>> {
    let mut bytes = [0u8; MSG_LEN];
    let mut iov = libc::iovec {
        iov_base: bytes.as_mut_ptr().cast(),
        iov_len: bytes.len(),
    };
    let mut control = [0u64; 8];
    // SAFETY: a zeroed msghdr is valid; fields set below.
    let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
    hdr.msg_iov = &mut iov;
    hdr.msg_iovlen = 1;
    hdr.msg_control = control.as_mut_ptr().cast();
    hdr.msg_controllen = std::mem::size_of_val(&control);
    // SAFETY: hdr describes valid, writable buffers.
    let rc = unsafe { libc::recvmsg(fd, &mut hdr, libc::MSG_CMSG_CLOEXEC) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        if e.kind() == io::ErrorKind::WouldBlock || e.kind() == io::ErrorKind::Interrupted {
            return Ok(None);
        }
        return Err(e);
    }
    if rc == 0 {
        return Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            "the peer closed the socket",
        ));
    }
    // Take ownership of every fd that came along, so none leaks.
    let mut passed: Option<OwnedFd> = None;
    // SAFETY: walking the control buffer the kernel filled, with the CMSG
    // macros, within msg_controllen.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&hdr);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg);
                let header = libc::CMSG_LEN(0) as usize;
                let n = ((*cmsg).cmsg_len as usize).saturating_sub(header)
                    / std::mem::size_of::<RawFd>();
                for i in 0..n {
                    let raw = std::ptr::read_unaligned(data.cast::<RawFd>().add(i));
                    let owned = OwnedFd::from_raw_fd(raw);
                    if passed.is_none() {
                        passed = Some(owned);
                    }
                }
            }
            cmsg = libc::CMSG_NXTHDR(&hdr, cmsg);
        }
    }
    if rc as usize != MSG_LEN || hdr.msg_flags & libc::MSG_TRUNC != 0 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "malformed message",
        ));
    }
    let msg = Msg::decode(&bytes)
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "malformed message"))?;
    Ok(Some((msg, passed)))
}

/// What the owner side serves: the fd (a duplicate, so it cannot be
/// closed and reused while being sent) and length for a token, if the
/// memory is still registered.
pub type Lookup = dyn Fn(u64) -> Option<(OwnedFd, u64)> + Send + Sync;

/// One connected peer, as the owner sees it.
struct ServerConn {
    fd: OwnedFd,
    /// Revocations sent to this peer and not confirmed yet; only those
    /// may be confirmed.
    outstanding: Mutex<HashSet<u64>>,
    acked: Mutex<Vec<u64>>,
    cond: Condvar,
    dead: AtomicBool,
}

/// Connected peers and the threads serving them.
type ConnList = Arc<Mutex<Vec<(Arc<ServerConn>, JoinHandle<()>)>>>;

/// The owner side: the listening socket and every connected peer.
pub struct Server {
    stop: Arc<AtomicBool>,
    conns: ConnList,
    accept: Option<JoinHandle<()>>,
    next_id: AtomicU64,
}

/// Who may connect to the owner's socket, and how refusals are logged.
pub struct Admission {
    pub token: Option<Token>,
    /// The exchange's deadline (auth_timeout_ms).
    pub auth_timeout: Duration,
    /// Users besides the owner's own whose processes may connect
    /// (shm.allowed_uids).
    pub allowed_uids: Vec<u32>,
    pub log: Arc<dyn Fn(&str) + Send + Sync>,
}

impl Server {
    pub fn start(name: Vec<u8>, lookup: Arc<Lookup>, admission: Admission) -> io::Result<Server> {
        let Admission {
            token,
            auth_timeout,
            allowed_uids,
            log,
        } = admission;
        // SAFETY: geteuid has no preconditions.
        let own_uid = unsafe { libc::geteuid() };
        let refusals2 = Arc::new(Refusals::new("shm"));
        let pending = PreAuthPool::new(MAX_PENDING, MAX_PENDING);
        let listener = seqpacket()?;
        let (addr, len) = abstract_addr(&name)?;
        // SAFETY: bind/listen with a valid address of `len` bytes.
        unsafe {
            if libc::bind(
                listener.as_raw_fd(),
                (&addr as *const libc::sockaddr_un).cast(),
                len,
            ) != 0
                || libc::listen(listener.as_raw_fd(), 64) != 0
            {
                return Err(io::Error::last_os_error());
            }
        }
        set_timeouts(listener.as_raw_fd());
        let stop = Arc::new(AtomicBool::new(false));
        let conns: ConnList = Arc::default();
        let (stop2, conns2) = (stop.clone(), conns.clone());
        let accept = std::thread::Builder::new()
            .name("ferry-shm-accept".into())
            .spawn(move || {
                while !stop2.load(Ordering::SeqCst) {
                    // SAFETY: accept4 on our listener; SO_RCVTIMEO makes it
                    // return regularly so the stop flag is seen.
                    let fd = unsafe {
                        libc::accept4(
                            listener.as_raw_fd(),
                            std::ptr::null_mut(),
                            std::ptr::null_mut(),
                            libc::SOCK_CLOEXEC,
                        )
                    };
                    // Forget peers that left each time accept returns (at
                    // least every receive timeout), not only when the next
                    // peer connects: each entry owns its socket, so a
                    // finished one kept its descriptor open (found by
                    // tests/faults.rs counting a target's descriptors).
                    conns2
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .retain(|(c, _)| !c.dead.load(Ordering::SeqCst));
                    if fd < 0 {
                        continue;
                    }
                    // SAFETY: a fresh descriptor we own.
                    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
                    let record = |kind: Refusal, detail: String| {
                        refusals2.record(kind, || detail, |l| log(l));
                    };
                    // Before anything is read or sent: which user is it?
                    let uid = match peer_cred(fd.as_raw_fd()) {
                        Some(c) if c.uid == own_uid || allowed_uids.contains(&c.uid) => c.uid,
                        Some(c) => {
                            record(
                                Refusal::PeerUser,
                                format!(
                                    "pid {} of uid {} (only uid {own_uid} and shm.allowed_uids \
                                     may connect)",
                                    c.pid, c.uid
                                ),
                            );
                            continue;
                        }
                        None => {
                            record(Refusal::PeerUser, "a process the kernel cannot name".into());
                            continue;
                        }
                    };
                    set_timeouts(fd.as_raw_fd());
                    {
                        let mut list = conns2.lock().unwrap_or_else(|p| p.into_inner());
                        list.retain(|(c, _)| !c.dead.load(Ordering::SeqCst));
                        if list.len() >= MAX_CONNECTIONS {
                            auth::refuse_busy(&mut handshake(fd.as_raw_fd(), TICK));
                            record(Refusal::Full, format!("{MAX_CONNECTIONS} peers connected"));
                            continue;
                        }
                    }
                    let slot = match pending.enter(Source::Other(u64::from(uid))) {
                        Ok(slot) => slot,
                        Err(why) => {
                            auth::refuse_busy(&mut handshake(fd.as_raw_fd(), TICK));
                            record(
                                why,
                                format!("{} connections are being set up", pending.pending()),
                            );
                            continue;
                        }
                    };
                    let conn = Arc::new(ServerConn {
                        fd,
                        outstanding: Mutex::new(HashSet::new()),
                        acked: Mutex::new(Vec::new()),
                        cond: Condvar::new(),
                        dead: AtomicBool::new(false),
                    });
                    let (c, lookup, stop3) = (conn.clone(), lookup.clone(), stop2.clone());
                    let (token, refusals3, log3) = (token.clone(), refusals2.clone(), log.clone());
                    let t = std::thread::Builder::new()
                        .name("ferry-shm-serve".into())
                        .spawn(move || {
                            // Nothing is served before the peer proved itself.
                            let mut h = handshake(c.fd.as_raw_fd(), auth_timeout);
                            let proved = auth::accept(&mut h, token.as_ref(), "shm");
                            drop(slot);
                            match proved {
                                Ok(_) => {
                                    if let Err(why) = serve(&c, &*lookup, &stop3) {
                                        refusals3.record(Refusal::Protocol, || why, |l| log3(l));
                                    }
                                }
                                Err(e) => {
                                    let kind = match &e {
                                        auth::AuthError::Refused(_) => Refusal::Auth,
                                        _ if e.to_string().contains("deadline") => Refusal::Timeout,
                                        _ => Refusal::Protocol,
                                    };
                                    refusals3.record(
                                        kind,
                                        || format!("uid {uid}: {e}"),
                                        |l| log3(l),
                                    );
                                }
                            }
                            c.dead.store(true, Ordering::SeqCst);
                        });
                    let mut list = conns2.lock().unwrap_or_else(|p| p.into_inner());
                    list.retain(|(c, _)| !c.dead.load(Ordering::SeqCst));
                    if let Ok(t) = t {
                        list.push((conn, t));
                    }
                }
            })?;
        Ok(Server {
            stop,
            conns,
            accept: Some(accept),
            next_id: AtomicU64::new(1),
        })
    }

    /// Tells every peer that registration `id` (of allocation `token`, or 0)
    /// is going away and waits (up to `timeout`) until each confirms it no
    /// longer touches it. Returns how many peers did not confirm in time.
    pub fn revoke(&self, id_revoked: u64, token: u64, timeout: Duration) -> usize {
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let conns: Vec<Arc<ServerConn>> = self
            .conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(|(c, _)| c.clone())
            .filter(|c| !c.dead.load(Ordering::SeqCst))
            .collect();
        let msg = Msg {
            kind: REVOKE,
            id,
            a: id_revoked,
            b: token,
        };
        let sent: Vec<Arc<ServerConn>> = conns
            .into_iter()
            .filter(|c| {
                // Outstanding before it is sent: the answer may be quick.
                c.outstanding
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .insert(id);
                send(c.fd.as_raw_fd(), msg, None).is_ok()
            })
            .collect();
        let deadline = Instant::now() + timeout;
        let mut missing = 0;
        for c in sent {
            let mut acked = c.acked.lock().unwrap_or_else(|p| p.into_inner());
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
                    c.outstanding
                        .lock()
                        .unwrap_or_else(|p| p.into_inner())
                        .remove(&id);
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
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        let conns = std::mem::take(&mut *self.conns.lock().unwrap_or_else(|p| p.into_inner()));
        for (c, _) in &conns {
            // SAFETY: shutting down a socket we own; wakes its thread.
            unsafe { libc::shutdown(c.fd.as_raw_fd(), libc::SHUT_RDWR) };
        }
        for (_, t) in conns {
            let _ = t.join();
        }
    }
}

/// Serves a peer until it leaves; Err says how it broke the protocol.
fn serve(conn: &ServerConn, lookup: &Lookup, stop: &AtomicBool) -> Result<(), String> {
    let fd = conn.fd.as_raw_fd();
    let mut broke = Ok(());
    while !stop.load(Ordering::SeqCst) {
        let msg = match recv(fd) {
            Ok(Some((m, _ignored_fd))) => m,
            Ok(None) => continue,
            Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                broke = Err(format!("a peer sent a malformed message: {e}"));
                break;
            }
            Err(_) => break,
        };
        match msg.kind {
            MAP => {
                let reply = match lookup(msg.a) {
                    Some((memfd, len)) => send(
                        fd,
                        Msg {
                            kind: MAP_OK,
                            id: msg.id,
                            a: msg.a,
                            b: len,
                        },
                        Some(memfd.as_raw_fd()),
                    ),
                    None => send(
                        fd,
                        Msg {
                            kind: MAP_ERR,
                            id: msg.id,
                            a: msg.a,
                            b: 0,
                        },
                        None,
                    ),
                };
                if reply.is_err() {
                    break;
                }
            }
            REVOKE_ACK => {
                let expected = conn
                    .outstanding
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .remove(&msg.id);
                if !expected {
                    broke = Err(format!(
                        "a peer confirmed revocation {} that is not outstanding; hung up",
                        msg.id
                    ));
                    break;
                }
                conn.acked
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .push(msg.id);
                conn.cond.notify_all();
            }
            // Anything else from a peer is a protocol error: hang up.
            k => {
                broke = Err(format!(
                    "a peer sent message kind {k}, which only owners send"
                ));
                break;
            }
        }
    }
    conn.dead.store(true, Ordering::SeqCst);
    conn.cond.notify_all();
    broke
}

/// What a peer's reader does with the owner's announcements.
pub trait ClientEvents: Send + Sync + 'static {
    /// Registration `id` (of allocation `token`, or 0) is going away: stop
    /// touching it, then return.
    fn revoke(&self, id: u64, token: u64);
    /// The owner is gone.
    fn closed(&self);
}

enum Reply {
    Mapped(OwnedFd, u64),
    Refused,
}

/// The peer side: a connection to an owner's socket.
pub struct Client {
    fd: Arc<OwnedFd>,
    replies: Arc<(Mutex<HashMap<u64, Reply>>, Condvar)>,
    dead: Arc<AtomicBool>,
    stop: Arc<AtomicBool>,
    reader: Option<JoinHandle<()>>,
    next_id: AtomicU64,
}

impl Client {
    /// Connects to the owner's socket and checks that the process at the
    /// other end is `pid` (a recycled socket name cannot fool us).
    pub fn connect(
        name: &[u8],
        pid: i32,
        events: Arc<dyn ClientEvents>,
        token: Option<&Token>,
        auth_timeout: Duration,
    ) -> Result<Client, String> {
        let fd = seqpacket().map_err(|e| e.to_string())?;
        let (addr, len) = abstract_addr(name).map_err(|e| e.to_string())?;
        // SAFETY: connect with a valid address of `len` bytes.
        let rc = unsafe {
            libc::connect(
                fd.as_raw_fd(),
                (&addr as *const libc::sockaddr_un).cast(),
                len,
            )
        };
        if rc != 0 {
            return Err(format!(
                "cannot reach its shm socket: {} (a different network namespace?)",
                io::Error::last_os_error()
            ));
        }
        match peer_pid(fd.as_raw_fd()) {
            Some(p) if p == pid => {}
            Some(p) => {
                return Err(format!(
                    "its shm socket belongs to pid {p}, not {pid} (a different PID namespace?)"
                ))
            }
            None => return Err("cannot identify the process behind its shm socket".into()),
        }
        set_timeouts(fd.as_raw_fd());
        let owner_uid = peer_cred(fd.as_raw_fd()).map(|c| c.uid);
        auth::connect(
            &mut handshake(fd.as_raw_fd(), auth_timeout),
            token,
            "shm",
            &format!("pid {pid}"),
        )
        .map_err(|e| {
            // SAFETY: geteuid has no preconditions.
            let me = unsafe { libc::geteuid() };
            match owner_uid {
                // Closed before the greeting: the owner's user check.
                Some(owner) if owner != me && e.to_string().contains("greeting") => format!(
                    "its shm socket refused this process: it belongs to uid {owner} and lets in \
                     only that user and shm.allowed_uids (this process is uid {me})"
                ),
                _ => e.to_string(),
            }
        })?;
        let fd = Arc::new(fd);
        let replies: Arc<(Mutex<HashMap<u64, Reply>>, Condvar)> = Arc::default();
        let dead = Arc::new(AtomicBool::new(false));
        let stop = Arc::new(AtomicBool::new(false));
        let (fd2, replies2, dead2, stop2) =
            (fd.clone(), replies.clone(), dead.clone(), stop.clone());
        let reader = std::thread::Builder::new()
            .name("ferry-shm-peer".into())
            .spawn(move || {
                while !stop2.load(Ordering::SeqCst) {
                    let (msg, passed) = match recv(fd2.as_raw_fd()) {
                        Ok(Some(m)) => m,
                        Ok(None) => continue,
                        Err(_) => break,
                    };
                    match msg.kind {
                        MAP_OK | MAP_ERR => {
                            let reply = match (msg.kind, passed) {
                                (MAP_OK, Some(f)) => Reply::Mapped(f, msg.b),
                                _ => Reply::Refused,
                            };
                            let (lock, cond) = &*replies2;
                            lock.lock()
                                .unwrap_or_else(|p| p.into_inner())
                                .insert(msg.id, reply);
                            cond.notify_all();
                        }
                        REVOKE => {
                            events.revoke(msg.a, msg.b);
                            let ack = Msg {
                                kind: REVOKE_ACK,
                                id: msg.id,
                                a: msg.a,
                                b: msg.b,
                            };
                            if send(fd2.as_raw_fd(), ack, None).is_err() {
                                break;
                            }
                        }
                        _ => break,
                    }
                }
                dead2.store(true, Ordering::SeqCst);
                replies2.1.notify_all();
                events.closed();
            })
            .map_err(|e| format!("cannot start a thread: {e}"))?;
        Ok(Client {
            fd,
            replies,
            dead,
            stop,
            reader: Some(reader),
            next_id: AtomicU64::new(1),
        })
    }

    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    /// Asks the owner for the memfd behind `token`.
    pub fn map(&self, token: u64, timeout: Duration) -> Result<(OwnedFd, u64), String> {
        if self.is_dead() {
            return Err("the peer process has exited".into());
        }
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        send(
            self.fd.as_raw_fd(),
            Msg {
                kind: MAP,
                id,
                a: token,
                b: 0,
            },
            None,
        )
        .map_err(|e| format!("asking the peer for its memory: {e}"))?;
        let (lock, cond) = &*self.replies;
        let deadline = Instant::now() + timeout;
        let mut map = lock.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(reply) = map.remove(&id) {
                return match reply {
                    Reply::Mapped(fd, len) => Ok((fd, len)),
                    Reply::Refused => Err("the peer no longer shares that memory".into()),
                };
            }
            let now = Instant::now();
            if self.is_dead() {
                return Err("the peer process has exited".into());
            }
            if now >= deadline {
                return Err("the peer did not answer in time".into());
            }
            map = cond
                .wait_timeout(map, (deadline - now).min(TICK))
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
        }
    }
}

impl Drop for Client {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // SAFETY: shutting down our own socket wakes the reader.
        unsafe { libc::shutdown(self.fd.as_raw_fd(), libc::SHUT_RDWR) };
        if let Some(t) = self.reader.take() {
            let _ = t.join();
        }
    }
}
