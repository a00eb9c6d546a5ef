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
//! The owner's side (who may connect, serving every peer) is `owner`; this
//! file has the socket, its messages and the peer's side.

use crate::wire::{
    Msg, LIVE, LIVE_ERR, LIVE_OK, MAP, MAP_ERR, MAP_OK, MSG_LEN, REVOKE, REVOKE_ACK,
};
use ferry_plugins_abi::sdk::auth::{self, Token};
use std::collections::HashMap;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// How often blocked reads wake to check whether to stop.
const TICK: Duration = Duration::from_millis(100);
/// How long a peer's message may wait for room in the socket.
const SEND_TIMEOUT: Duration = Duration::from_secs(5);

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

/// A listening socket on the abstract name `name`.
pub fn listen(name: &[u8]) -> io::Result<OwnedFd> {
    let listener = seqpacket()?;
    let (addr, len) = abstract_addr(name)?;
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
    Ok(listener)
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

/// Sends one message, with an fd attached when given, without waiting:
/// Ok(false) when the socket has no room for it now.
pub fn try_send(fd: RawFd, msg: Msg, pass: Option<RawFd>) -> io::Result<bool> {
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
    loop {
        // SAFETY: hdr describes valid buffers for the call.
        let rc = unsafe { libc::sendmsg(fd, &hdr, libc::MSG_NOSIGNAL | libc::MSG_DONTWAIT) };
        if rc == MSG_LEN as isize {
            return Ok(true);
        }
        if rc >= 0 {
            return Err(io::Error::new(io::ErrorKind::WriteZero, "short send"));
        }
        let e = io::Error::last_os_error();
        match e.kind() {
            io::ErrorKind::Interrupted => continue,
            io::ErrorKind::WouldBlock => return Ok(false),
            _ => return Err(e),
        }
    }
}

/// Sends one message (and fd), waiting for room until `deadline`.
pub fn send(fd: RawFd, msg: Msg, pass: Option<RawFd>, deadline: Instant) -> io::Result<()> {
    loop {
        if try_send(fd, msg, pass)? {
            return Ok(());
        }
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the peer did not take a message in time",
            ));
        }
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLOUT,
            revents: 0,
        };
        let ms = left.min(TICK).as_millis().max(1) as i32;
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut pfd, 1, ms) };
    }
}

/// Receives one message and any fd attached. Ok(None) on a tick timeout.
pub fn recv(fd: RawFd) -> io::Result<Option<(Msg, Option<OwnedFd>)>> {
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

/// Whether the owner still has registration `id` (what a peer asks before
/// its first cross-memory copy under a key).
pub type Live = dyn Fn(u64) -> bool + Send + Sync;

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
    Live,
    Refused,
}

/// A connection to the owner's socket, checked to belong to process `pid`
/// (a recycled socket name cannot fool us), with short socket timeouts.
pub(crate) fn open(name: &[u8], pid: i32) -> Result<OwnedFd, String> {
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
    Ok(fd)
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
    /// A busy owner (its pre-auth pool full) is asked again, with a pause
    /// doubling up to 250 ms, until `auth_timeout` has passed.
    pub fn connect(
        name: &[u8],
        pid: i32,
        events: Arc<dyn ClientEvents>,
        token: Option<&Token>,
        auth_timeout: Duration,
    ) -> Result<Client, String> {
        let started = Instant::now();
        let mut pause = Duration::from_millis(5);
        let fd = loop {
            let fd = open(name, pid)?;
            let owner_uid = peer_cred(fd.as_raw_fd()).map(|c| c.uid);
            let left = auth_timeout
                .saturating_sub(started.elapsed())
                .max(Duration::from_millis(100));
            match auth::connect(
                &mut handshake(fd.as_raw_fd(), left),
                token,
                "shm",
                &format!("pid {pid}"),
            ) {
                Ok(_) => break fd,
                Err(auth::AuthError::Busy(_)) if started.elapsed() + pause < auth_timeout => {
                    std::thread::sleep(pause);
                    pause = (pause * 2).min(Duration::from_millis(250));
                }
                Err(e) => {
                    // SAFETY: geteuid has no preconditions.
                    let me = unsafe { libc::geteuid() };
                    return Err(match owner_uid {
                        // Closed before the greeting: the owner's user check.
                        Some(owner) if owner != me && e.to_string().contains("greeting") => {
                            format!(
                                "its shm socket refused this process: it belongs to uid {owner} \
                                 and lets in only that user and shm.allowed_uids (this process \
                                 is uid {me})"
                            )
                        }
                        _ => e.to_string(),
                    });
                }
            }
        };
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
                        MAP_OK | MAP_ERR | LIVE_OK | LIVE_ERR => {
                            let reply = match (msg.kind, passed) {
                                (MAP_OK, Some(f)) => Reply::Mapped(f, msg.b),
                                (LIVE_OK, None) => Reply::Live,
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
                            let deadline = Instant::now() + SEND_TIMEOUT;
                            if send(fd2.as_raw_fd(), ack, None, deadline).is_err() {
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
        let client = Client {
            fd,
            replies,
            dead,
            stop,
            reader: Some(reader),
            next_id: AtomicU64::new(1),
        };
        // One round trip before any copy. The handshake's verdict comes
        // from the owner's gate, before the owner lists the connection; a
        // buffer unregistered in between would not be revoked here, and a
        // cross-memory copy could still reach it. The owner answers only
        // connections it lists, so after this answer every revocation
        // reaches this reader (token 0 names no memory: it is refused).
        client
            .ask(MAP, 0, auth_timeout.max(Duration::from_millis(100)))
            .map_err(|e| format!("waiting to be admitted: {e}"))?;
        Ok(client)
    }

    pub fn is_dead(&self) -> bool {
        self.dead.load(Ordering::SeqCst)
    }

    /// Asks the owner for the memfd behind `token`.
    pub fn map(&self, token: u64, timeout: Duration) -> Result<(OwnedFd, u64), String> {
        match self.ask(MAP, token, timeout)? {
            Reply::Mapped(fd, len) => Ok((fd, len)),
            _ => Err("the peer no longer shares that memory".into()),
        }
    }

    /// Whether the owner still has registration `id`.
    pub fn live(&self, id: u64, timeout: Duration) -> Result<bool, String> {
        Ok(matches!(self.ask(LIVE, id, timeout)?, Reply::Live))
    }

    /// Sends `kind` (MAP or LIVE) about `a` and waits for the owner's answer.
    fn ask(&self, kind: u32, a: u64, timeout: Duration) -> Result<Reply, String> {
        if self.is_dead() {
            return Err("the peer process has exited".into());
        }
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        send(
            self.fd.as_raw_fd(),
            Msg { kind, id, a, b: 0 },
            None,
            Instant::now() + SEND_TIMEOUT,
        )
        .map_err(|e| format!("asking the peer about its memory: {e}"))?;
        let (lock, cond) = &*self.replies;
        let deadline = Instant::now() + timeout;
        let mut map = lock.lock().unwrap_or_else(|p| p.into_inner());
        loop {
            if let Some(reply) = map.remove(&id) {
                return Ok(reply);
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
