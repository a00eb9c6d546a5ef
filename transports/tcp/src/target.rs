//! The target side: accepts data connections and serves READ and WRITE
//! frames against registered memory only.
//!
//! For each frame: read and check the header and descriptors, pin every
//! range that lies inside a registered region, then move the payload
//! straight between the socket and those ranges. A range outside registered
//! memory gets an error status and its WRITE bytes are read into a scratch
//! buffer and dropped, so the stream stays in step and nothing else is
//! touched. Anything malformed closes the connection.
//!
//! Limits: a connection has at most one frame in flight (at most
//! [`wire::MAX_DESCS`] requests and [`wire::MAX_FRAME_PAYLOAD`] bytes): the
//! next is not read before this one's response is sent, so a peer that
//! sends faster than it reads is held back by TCP flow control, and one
//! that stops reading is dropped once a response cannot be sent within the
//! timeout. Authenticated connections are capped per target and per peer
//! host, and one that carries no frame for the idle timeout is closed.
//! Connections still authenticating have a pool of their own (per source and
//! in total, `sdk::admission`) and the short auth deadline, so they never
//! take the places of authenticated peers; one that finds the pool full is
//! told BUSY.
//!
//! Every frame's header and descriptors must pass their session tag
//! (`wire`) before anything in them is acted on.

use crate::regions::{Pin, Regions};
use crate::sockio::{self, Deadline, IoSlices, IoStop};
use crate::wire::{self, Desc, Header, Kind};
use ferry_plugins_abi::sdk::admission::{PreAuthPool, Refusal, Refusals, Source};
use ferry_plugins_abi::sdk::auth::{self, AuthError, Direction, Session, Token, TAG_LEN};
use ferry_plugins_abi::sdk::deadline::DeadlineStream;
use ferry_plugins_abi::sys;
use std::io::Write;
use std::net::{IpAddr, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Incoming data connections served at once; more are closed at accept
/// (tcp.max_connections).
pub const DEFAULT_MAX_CONNECTIONS: usize = 1024;
/// Of those, from one peer host (tcp.max_connections_per_host).
pub const DEFAULT_MAX_CONNECTIONS_PER_HOST: usize = 256;

pub struct TargetConfig {
    /// A frame must arrive, and its response leave, within this.
    pub timeout: Duration,
    /// A connection with no frame for this long is closed.
    pub idle_timeout: Duration,
    pub max_connections: usize,
    pub max_connections_per_host: usize,
    /// Sent in the hello after authentication (and in the endpoint).
    pub instance: u64,
    /// Deadline of a new connection's authentication (auth_timeout_ms).
    pub auth_timeout: Duration,
    /// Connections authenticating at once: in all, and per source.
    pub max_pending: usize,
    pub max_pending_per_source: usize,
    /// FERRY_INTEGRITY=payload: frames whose payload is not tagged are
    /// refused (and responses to tagged requests are tagged either way).
    pub require_payload_tag: bool,
    /// The cluster's token (`auth.token`): a connection that does not prove
    /// it knows it is closed before any frame is read.
    pub token: Option<Token>,
    /// How long a connection's thread polls for the next frame (tcp.spin_us).
    pub spin: Duration,
}

/// One connection as the accept loop tracks it.
struct Tracked {
    ip: IpAddr,
    /// A clone of its socket, to shut it down.
    stream: TcpStream,
    thread: JoinHandle<()>,
    /// It passed authentication (only those count against the caps).
    authed: Arc<AtomicBool>,
}

/// The target's connections.
type ConnList = Arc<Mutex<Vec<Tracked>>>;

/// Frames that failed their tag, process-wide (for tests and reports).
pub static INTEGRITY_FAILURES: AtomicU64 = AtomicU64::new(0);

pub struct Target {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    accept_thread: Option<JoinHandle<()>>,
    conns: ConnList,
}

impl Target {
    pub fn start(
        bind: &str,
        regions: Arc<Regions>,
        config: TargetConfig,
        log: Arc<dyn Fn(&str) + Send + Sync>,
    ) -> std::io::Result<Target> {
        let listener = TcpListener::bind(bind)?;
        let addr = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let conns: ConnList = Arc::default();
        let refusals = Arc::new(Refusals::new("tcp"));
        let (stop2, conns2, refusals2) = (stop.clone(), conns.clone(), refusals);
        let accept_thread = std::thread::Builder::new()
            .name("ferry-tcp-accept".into())
            .spawn(move || accept_loop(listener, regions, stop2, conns2, config, log, refusals2))?;
        Ok(Target {
            addr,
            stop,
            accept_thread: Some(accept_thread),
            conns,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.accept_thread.take() {
            let _ = t.join();
        }
        let conns = std::mem::take(&mut *self.conns.lock().unwrap_or_else(|e| e.into_inner()));
        for c in &conns {
            let _ = c.stream.shutdown(std::net::Shutdown::Both);
        }
        for c in conns {
            let _ = c.thread.join();
        }
    }
}

fn accept_loop(
    listener: TcpListener,
    regions: Arc<Regions>,
    stop: Arc<AtomicBool>,
    conns: ConnList,
    config: TargetConfig,
    log: Arc<dyn Fn(&str) + Send + Sync>,
    refusals: Arc<Refusals>,
) {
    let config = Arc::new(config);
    let pending = PreAuthPool::new(config.max_pending, config.max_pending_per_source);
    let fd = listener.as_raw_fd();
    while !stop.load(Ordering::SeqCst) {
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut pfd, 1, 100) };
        // Forget connections whose thread ended, on every tick: each entry
        // holds a clone of its socket, so a finished one kept its file
        // descriptor open until the next peer connected (found by
        // tests/faults.rs counting a target's descriptors after its peers
        // left).
        conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|c| !c.thread.is_finished());
        let (stream, peer) = match listener.accept() {
            Ok(s) => s,
            Err(_) => continue,
        };
        if stream.set_nonblocking(false).is_err() {
            continue;
        }
        let slot = match pending.enter(Source::ip(peer.ip())) {
            Ok(slot) => slot,
            Err(why) => {
                auth::refuse_busy(&mut DeadlineStream::new(
                    &stream,
                    Duration::from_millis(100),
                ));
                refusals.record(
                    why,
                    || format!("{peer}: {} connections are being set up", pending.pending()),
                    |l| log(l),
                );
                continue;
            }
        };
        let Ok(clone) = stream.try_clone() else {
            continue;
        };
        let authed = Arc::new(AtomicBool::new(false));
        let (regions, stop, log, config, conns2, authed2, refusals) = (
            regions.clone(),
            stop.clone(),
            log.clone(),
            config.clone(),
            conns.clone(),
            authed.clone(),
            refusals.clone(),
        );
        let spawned = std::thread::Builder::new()
            .name("ferry-tcp-target".into())
            .spawn(move || {
                let served = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    // Nothing the peer sends is parsed before it proved
                    // itself; the whole exchange has the auth deadline.
                    let mut proving = DeadlineStream::new(&stream, config.auth_timeout);
                    let proved = auth::accept(&mut proving, config.token.as_ref(), "tcp");
                    drop(slot);
                    let mut session = match proved {
                        Ok(s) => s,
                        Err(e) => {
                            let kind = match &e {
                                AuthError::Refused(_) => Refusal::Auth,
                                AuthError::Protocol(m) if m.contains("deadline") => {
                                    Refusal::Timeout
                                }
                                _ => Refusal::Protocol,
                            };
                            refusals.record(kind, || format!("{peer}: {e}"), |l| log(l));
                            return Ok(());
                        }
                    };
                    admit(&conns2, peer, &authed2, &config).map_err(|(kind, why)| {
                        refusals.record(kind, || format!("{peer}: {why}"), |l| log(l));
                        why
                    })?;
                    let hello = wire::encode_hello(config.instance);
                    let tag = session.send.seal(&[&hello]);
                    proving.restart(config.timeout);
                    proving
                        .write_all(&hello)
                        .and_then(|()| proving.write_all(&tag))
                        .map_err(|e| format!("sending the hello: {e}"))?;
                    sockio::configure(&stream).map_err(|e| e.to_string())?;
                    serve(&stream, &regions, &stop, &config, &mut session).map_err(|e| {
                        if e.contains("integrity check failed") {
                            INTEGRITY_FAILURES.fetch_add(1, Ordering::SeqCst);
                            refusals.record(
                                Refusal::Integrity,
                                || format!("{peer}: {e}"),
                                |l| log(l),
                            );
                        }
                        e
                    })
                }));
                match served {
                    Ok(Ok(())) => {}
                    Ok(Err(why)) => log(&format!("data connection from {peer} closed: {why}")),
                    Err(_) => log(&format!(
                        "data connection from {peer} closed: its thread failed unexpectedly \
                         (a bug; please report it)"
                    )),
                }
                // The peer sees the connection close and fails its requests.
                let _ = stream.shutdown(std::net::Shutdown::Both);
            });
        if let Ok(thread) = spawned {
            conns
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(Tracked {
                    ip: peer.ip(),
                    stream: clone,
                    thread,
                    authed,
                });
        }
    }
}

/// Counts an authenticated connection against the caps on served ones
/// (in all and per peer host), or says which cap it would pass.
fn admit(
    conns: &ConnList,
    peer: SocketAddr,
    authed: &AtomicBool,
    config: &TargetConfig,
) -> Result<(), (Refusal, String)> {
    let list = conns.lock().unwrap_or_else(|e| e.into_inner());
    let served: Vec<&Tracked> = list
        .iter()
        .filter(|c| c.authed.load(Ordering::SeqCst) && !c.thread.is_finished())
        .collect();
    if served.len() >= config.max_connections {
        return Err((
            Refusal::Full,
            format!(
                "{} data connections are served (tcp.max_connections)",
                config.max_connections
            ),
        ));
    }
    let from_host = served.iter().filter(|c| c.ip == peer.ip()).count();
    if from_host >= config.max_connections_per_host {
        return Err((
            Refusal::PerSource,
            format!(
                "{from_host} data connections from that host are served \
                 (tcp.max_connections_per_host)"
            ),
        ));
    }
    authed.store(true, Ordering::SeqCst);
    Ok(())
}

/// A fixed buffer that swallows WRITE bytes aimed outside registered memory.
const SCRATCH_LEN: usize = 64 * 1024;

fn serve(
    stream: &TcpStream,
    regions: &Regions,
    stop: &AtomicBool,
    config: &TargetConfig,
    session: &mut Session,
) -> Result<(), String> {
    let (timeout, spin) = (config.timeout, config.spin);
    let fd = stream.as_raw_fd();
    let keep_going = || !stop.load(Ordering::SeqCst);
    let mut scratch = vec![0u8; SCRATCH_LEN];
    let mut desc_bytes: Vec<u8> = Vec::new();
    let mut out: Vec<u8> = Vec::new();
    loop {
        // Every frame has at least one descriptor: read the header and the
        // first descriptor in one call.
        let mut hb = [0u8; wire::HEADER_LEN];
        let mut first_desc = [0u8; wire::DESC_LEN];
        let mut s = IoSlices::new();
        s.push(hb.as_mut_ptr(), hb.len());
        s.push(first_desc.as_mut_ptr(), first_desc.len());
        // A connection waits for its next frame up to the idle timeout;
        // once a frame begins, all of it must arrive within the timeout.
        spin_for_next_frame(fd, spin);
        let wait = Deadline::Idle {
            idle: config.idle_timeout,
            frame: timeout,
        };
        match sockio::recv_all(fd, &mut s, wait, keep_going) {
            Ok(()) => {}
            Err(IoStop::Io(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Err(e) if e.is_idle() => {
                return Err(format!(
                    "idle for {} s (the peer reconnects when it needs to)",
                    config.idle_timeout.as_secs()
                ))
            }
            Err(e) => return Err(e.describe()),
        }
        let deadline = Instant::now() + timeout;
        let header = Header::decode(&hb).map_err(|e| e.0)?;
        if header.kind == Kind::Response {
            return Err("a peer sent a response frame as a request".into());
        }
        desc_bytes.clear();
        desc_bytes.extend_from_slice(&first_desc);
        desc_bytes.resize(header.count as usize * wire::DESC_LEN, 0);
        let mut tag = [0u8; TAG_LEN];
        let mut s = IoSlices::new();
        s.push(
            desc_bytes[wire::DESC_LEN..].as_mut_ptr(),
            desc_bytes.len() - wire::DESC_LEN,
        );
        s.push(tag.as_mut_ptr(), TAG_LEN);
        sockio::recv_all(fd, &mut s, Deadline::At(deadline), keep_going)
            .map_err(|e| format!("reading descriptors: {}", e.describe()))?;
        // Nothing in the frame is acted on before its tag passed.
        session
            .recv
            .open(&[&hb, &desc_bytes], &tag)
            .map_err(|e| e.to_string())?;
        if config.require_payload_tag && !header.payload_tagged() {
            return Err(
                "the peer sent a frame without a payload tag, and this target requires \
                 them (FERRY_INTEGRITY=payload); set it on the peer too"
                    .into(),
            );
        }
        let descs = wire::decode_descs(&header, &desc_bytes).map_err(|e| e.0)?;

        // Check every range; keep the pins until the payload has moved.
        let mut pins: Vec<Option<Pin>> = Vec::with_capacity(descs.len());
        let mut statuses: Vec<i32> = Vec::with_capacity(descs.len());
        for d in &descs {
            match regions.pin(d.addr, d.len) {
                Ok(p) => {
                    pins.push(Some(p));
                    statuses.push(sys::FERRY_OK);
                }
                Err(code) => {
                    pins.push(None);
                    statuses.push(code);
                }
            }
        }

        match header.kind {
            Kind::Write if header.payload_tagged() => {
                receive_tagged_payload(
                    fd,
                    &descs,
                    &pins,
                    &mut scratch,
                    &header,
                    &session.recv,
                    deadline,
                    keep_going,
                )?;
                drop(pins);
                respond(
                    fd,
                    &mut out,
                    &header,
                    &statuses,
                    &[],
                    timeout,
                    keep_going,
                    &mut session.send,
                )?;
            }
            Kind::Write => {
                let mut s = IoSlices::new();
                for (d, pin) in descs.iter().zip(&pins) {
                    if pin.is_some() {
                        s.push(d.addr as *const u8, d.len as usize);
                    } else {
                        push_scratch(&mut s, &mut scratch, d.len);
                    }
                }
                sockio::recv_all(fd, &mut s, Deadline::At(deadline), keep_going)
                    .map_err(|e| format!("reading a WRITE payload: {}", e.describe()))?;
                drop(pins);
                respond(
                    fd,
                    &mut out,
                    &header,
                    &statuses,
                    &[],
                    timeout,
                    keep_going,
                    &mut session.send,
                )?;
            }
            Kind::Read => {
                respond(
                    fd,
                    &mut out,
                    &header,
                    &statuses,
                    &descs,
                    timeout,
                    keep_going,
                    &mut session.send,
                )?;
                drop(pins);
            }
            Kind::Response => return Err("a peer sent a response frame as a request".into()),
        }
    }
}

/// Polls for the next frame for up to `spin` before the thread sleeps: a
/// peer issuing requests one after another gets each picked up without a
/// thread wake-up, which costs more than the round trip itself on a VM.
fn spin_for_next_frame(fd: i32, spin: Duration) {
    let started = Instant::now();
    while started.elapsed() < spin {
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        if unsafe { libc::poll(&mut pfd, 1, 0) } != 0 {
            return;
        }
        std::hint::spin_loop();
    }
}

/// Queues `len` bytes of scratch (reused as often as needed).
fn push_scratch(s: &mut IoSlices, scratch: &mut [u8], mut len: u64) {
    while len > 0 {
        let n = len.min(scratch.len() as u64) as usize;
        s.push(scratch.as_mut_ptr(), n);
        len -= n as u64;
    }
}

/// Receives a WRITE payload whose tag follows it: a run of pinned ranges at
/// a time straight into memory, refused ranges through the scratch buffer,
/// each hashed once it arrived, then the tag. A payload that fails it has
/// landed already: the connection is closed and the peer's requests fail.
#[allow(clippy::too_many_arguments)]
fn receive_tagged_payload(
    fd: i32,
    descs: &[Desc],
    pins: &[Option<Pin>],
    scratch: &mut [u8],
    header: &Header,
    rx: &Direction,
    deadline: Instant,
    mut keep_going: impl FnMut() -> bool,
) -> Result<(), String> {
    let mut mac = rx.payload(header.seq);
    let mut i = 0;
    while i < descs.len() {
        if pins[i].is_some() {
            let mut j = i;
            let mut s = IoSlices::new();
            while j < descs.len() && pins[j].is_some() {
                s.push(descs[j].addr as *const u8, descs[j].len as usize);
                j += 1;
            }
            sockio::recv_all(fd, &mut s, Deadline::At(deadline), &mut keep_going)
                .map_err(|e| format!("reading a WRITE payload: {}", e.describe()))?;
            for d in &descs[i..j] {
                // SAFETY: the range lies inside a registered region that the
                // pin keeps registered; the bytes were just received there.
                mac.update(unsafe {
                    std::slice::from_raw_parts(d.addr as *const u8, d.len as usize)
                });
            }
            i = j;
        } else {
            let mut left = descs[i].len;
            while left > 0 {
                let n = left.min(scratch.len() as u64) as usize;
                let mut s = IoSlices::new();
                s.push(scratch.as_mut_ptr(), n);
                sockio::recv_all(fd, &mut s, Deadline::At(deadline), &mut keep_going)
                    .map_err(|e| format!("reading a WRITE payload: {}", e.describe()))?;
                mac.update(&scratch[..n]);
                left -= n as u64;
            }
            i += 1;
        }
    }
    let mut tag = [0u8; TAG_LEN];
    let mut s = IoSlices::new();
    s.push(tag.as_mut_ptr(), TAG_LEN);
    sockio::recv_all(fd, &mut s, Deadline::At(deadline), keep_going)
        .map_err(|e| format!("reading a payload tag: {}", e.describe()))?;
    mac.verify(&tag).map_err(|e| format!("WRITE payload: {e}"))
}

#[allow(clippy::too_many_arguments)]
fn respond(
    fd: i32,
    out: &mut Vec<u8>,
    request: &Header,
    statuses: &[i32],
    read_descs: &[Desc],
    timeout: Duration,
    keep_going: impl FnMut() -> bool,
    tx: &mut Direction,
) -> Result<(), String> {
    let payload_len: u64 = read_descs
        .iter()
        .zip(statuses)
        .filter(|(_, s)| **s == sys::FERRY_OK)
        .map(|(d, _)| d.len)
        .sum();
    let header = Header {
        kind: Kind::Response,
        flags: request.flags,
        count: request.count,
        seq: request.seq,
        payload_len,
    };
    out.clear();
    out.extend_from_slice(&header.encode());
    wire::encode_statuses(statuses, out);
    let tag = tx.seal(&[out]);
    out.extend_from_slice(&tag);
    let mut s = IoSlices::new();
    s.push(out.as_ptr(), out.len());
    let mut mac = request.payload_tagged().then(|| tx.payload(request.seq));
    for (d, st) in read_descs.iter().zip(statuses) {
        if *st == sys::FERRY_OK {
            s.push(d.addr as *const u8, d.len as usize);
            if let Some(m) = &mut mac {
                // SAFETY: the range was pinned inside a registered region by
                // the caller, which holds the pins until this returns.
                m.update(unsafe {
                    std::slice::from_raw_parts(d.addr as *const u8, d.len as usize)
                });
            }
        }
    }
    let ptag = mac.map(|m| m.finish());
    if let Some(t) = &ptag {
        s.push(t.as_ptr(), TAG_LEN);
    }
    sockio::send_all(fd, &mut s, Instant::now() + timeout, keep_going)
        .map_err(|e| format!("sending a response: {}", e.describe()))
}
