//! One served data connection, as a state machine an I/O loop drives
//! (reactor.rs): read a frame's header and descriptors, check their tag,
//! pin every range inside registered memory, move the payload straight
//! between the socket and those ranges, send the response, and wait for
//! the next frame; each step goes as far as the socket allows without
//! blocking, and picks up where it stopped when the socket is ready again.
//!
//! A range outside registered memory gets an error status and its WRITE
//! bytes are read into a sink and dropped, so the stream stays in step and
//! nothing else is touched. Anything malformed closes the connection.
//! A connection has at most one frame in flight: the next is not read
//! before this one's response is sent, so a peer that sends faster than it
//! reads is held back by TCP flow control. A frame must arrive, and its
//! response leave, within the timeout from its first byte; a connection
//! without a frame for the idle timeout is closed.

use crate::reactor::{Handler, Ready, Want};
use crate::regions::{Pin, Regions};
use crate::sockio::{self, IoSlices};
use crate::wire::{self, Desc, Header, Kind};
use ferry_plugins_abi::sdk::admission::{Refusal, Refusals};
use ferry_plugins_abi::sdk::auth::{PayloadTag, Session, TAG_LEN};
use ferry_plugins_abi::sys;
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::{Duration, Instant};

/// Where a connection's lines go: refusals (a failed tag, a broken
/// protocol, a stalled frame) at warn, rate-limited by `Refusals`; the
/// ordinary reasons connections close (idle, the peer left) at debug.
#[derive(Clone)]
pub struct Logs {
    pub warn: Arc<dyn Fn(&str) + Send + Sync>,
    pub debug: Arc<dyn Fn(&str) + Send + Sync>,
}

/// Settings a served connection needs (from the target's configuration).
pub struct ServeConfig {
    pub timeout: Duration,
    pub idle_timeout: Duration,
    pub require_payload_tag: bool,
    pub spin: Duration,
}

/// Bytes one call moves at most before it lets the loop's other
/// connections have a turn.
const TURN_BYTES: usize = 2 << 20;
/// The sink of refused WRITE bytes, shared by every connection: the
/// kernel writes into it and nothing reads it.
const SINK_LEN: usize = 64 * 1024;
static SINK: LazyLock<usize> =
    LazyLock::new(|| Box::leak(vec![0u8; SINK_LEN].into_boxed_slice()).as_mut_ptr() as usize);

/// A frame being served: its header, ranges, pins and statuses.
struct Work {
    header: Header,
    descs: Vec<Desc>,
    /// The regions the ranges lie in, each pinned once.
    pins: Vec<Pin>,
    statuses: Vec<i32>,
    deadline: Instant,
}

/// A piece of a tagged WRITE payload: a run of pinned ranges received in
/// place, or refused bytes received into `scratch` (which is hashed).
enum Seg {
    Pinned(usize, usize),
    Refused(usize),
}

enum Phase {
    /// Waiting for a frame: its header, then as many bytes as the smallest
    /// frame's descriptor and tag, in one call.
    Head {
        buf: [u8; HEAD_READ],
        got: usize,
        deadline: Option<Instant>,
    },
    /// The other descriptors, then the tag.
    Descs {
        header: Header,
        bytes: Vec<u8>,
        got: usize,
        deadline: Instant,
    },
    /// A WRITE payload, straight into memory (refused ranges to the sink).
    Payload { work: Work, io: IoSlices },
    /// A tagged WRITE payload, a piece at a time, then its tag.
    Tagged {
        work: Work,
        segs: Vec<Seg>,
        seg: usize,
        io: IoSlices,
        scratch: Vec<u8>,
        mac: Option<Box<PayloadTag>>,
        tag: Box<[u8; TAG_LEN]>,
    },
    /// The response (and a READ's payload) going out.
    Respond {
        _out: Vec<u8>,
        _tail: Vec<u8>,
        io: IoSlices,
        _pins: Vec<Pin>,
        deadline: Instant,
        /// Close the connection once it has left, for this reason.
        then_close: Option<String>,
    },
}

/// A frame has at least one descriptor and a tag after its header.
const HEAD_READ: usize = wire::HEADER_LEN + wire::DESC_LEN + TAG_LEN;

fn waiting() -> Phase {
    Phase::Head {
        buf: [0; HEAD_READ],
        got: 0,
        deadline: None,
    }
}

struct State {
    session: Session,
    phase: Phase,
    last_frame: Instant,
}

/// How a step ended.
enum Stop {
    /// The socket has no more for now: wait for it, by this deadline.
    Wait { read: bool, at: Instant },
    /// The turn's bytes are used up: come back at once.
    Yield,
    /// The peer closed the connection between frames.
    Closed,
    /// A response just left: the peer's next request may follow at once.
    Answered,
}

pub struct ServedConn {
    stream: TcpStream,
    fd: RawFd,
    peer: SocketAddr,
    regions: Arc<Regions>,
    config: Arc<ServeConfig>,
    refusals: Arc<Refusals>,
    logs: Logs,
    state: Mutex<State>,
    /// Releases its place under the caps when the connection goes.
    _place: Box<dyn Send + Sync>,
}

impl ServedConn {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        stream: TcpStream,
        peer: SocketAddr,
        session: Session,
        regions: Arc<Regions>,
        config: Arc<ServeConfig>,
        refusals: Arc<Refusals>,
        logs: Logs,
        place: Box<dyn Send + Sync>,
    ) -> ServedConn {
        ServedConn {
            fd: stream.as_raw_fd(),
            stream,
            peer,
            regions,
            config,
            refusals,
            logs,
            state: Mutex::new(State {
                session,
                phase: waiting(),
                last_frame: Instant::now(),
            }),
            _place: place,
        }
    }

    /// What it waits for first: a frame, by the idle timeout.
    pub fn first_want(&self) -> Want {
        Want {
            read: true,
            at: Some(Instant::now() + self.config.idle_timeout),
            ..Want::default()
        }
    }

    /// Closes the socket (the peer fails what it has in flight).
    pub fn shutdown(&self) {
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
    }

    fn closed(&self, why: &str) -> Want {
        if let Some(kind) = refusal_of(why) {
            let (peer, warn) = (self.peer, &self.logs.warn);
            self.refusals
                .record(kind, || format!("{peer}: {why}"), |l| warn(l));
        } else if !why.is_empty() {
            (self.logs.debug)(&format!(
                "data connection from {}: closed: {why}",
                self.peer
            ));
        }
        self.shutdown();
        Want::close()
    }
}

impl Handler for ServedConn {
    fn fd(&self) -> RawFd {
        self.fd
    }

    fn ready(&self, _why: Ready) -> Want {
        let mut st = self.state.lock().unwrap_or_else(|p| p.into_inner());
        match step(&mut st, &self.regions, &self.config, self.fd) {
            Ok(Stop::Wait { read, at }) => Want {
                read,
                write: !read,
                at: Some(at),
                ..Want::default()
            },
            Ok(Stop::Yield) => {
                // One-shot interest fires again at once if bytes are there.
                let at = Instant::now() + self.config.timeout;
                let read = !matches!(st.phase, Phase::Respond { .. });
                Want {
                    read,
                    write: !read,
                    at: Some(at),
                    ..Want::default()
                }
            }
            Ok(Stop::Answered) => Want {
                read: true,
                at: Some(Instant::now() + self.config.idle_timeout),
                spin: Some(self.config.spin).filter(|s| !s.is_zero()),
                ..Want::default()
            },
            Ok(Stop::Closed) => self.closed(""),
            Err(why) => self.closed(&why),
        }
    }
}

/// Which refusal closing a served connection for `why` is: a peer that
/// failed a tag, broke the protocol or stalled mid-frame (counted, at
/// warn); None for the ordinary ends (idle, the peer's reset or close),
/// which are logged at debug.
fn refusal_of(why: &str) -> Option<Refusal> {
    if why.is_empty()
        || why.starts_with("idle for")
        || why.starts_with("reading a frame:")
        || why.starts_with("sending a response:")
    {
        None
    } else if why.contains("integrity check failed") {
        Some(Refusal::Integrity)
    } else if why.contains("did not finish within") {
        Some(Refusal::Timeout)
    } else {
        Some(Refusal::Protocol)
    }
}

/// Receives into `buf[*got..]` without blocking; Ok(false) when the socket
/// has nothing more now, Err on EOF or an error.
fn fill(fd: RawFd, buf: &mut [u8], got: &mut usize) -> Result<bool, std::io::Error> {
    let mut s = IoSlices::new();
    s.push(buf[*got..].as_mut_ptr(), buf.len() - *got);
    let n = sockio::recv_some(fd, &mut s, true)?;
    *got += n;
    Ok(n > 0 || *got == buf.len())
}

fn timed_out(what: &str, timeout: Duration) -> String {
    format!("{what} did not finish within {} ms", timeout.as_millis())
}

/// Drives the connection as far as it goes without blocking.
fn step(
    st: &mut State,
    regions: &Regions,
    config: &ServeConfig,
    fd: RawFd,
) -> Result<Stop, String> {
    let now = Instant::now();
    let mut moved = 0usize;
    loop {
        if moved >= TURN_BYTES {
            return Ok(Stop::Yield);
        }
        match &mut st.phase {
            Phase::Head { buf, got, deadline } => {
                let before = *got;
                match fill(fd, buf, got) {
                    Ok(_) => {}
                    Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof && *got == 0 => {
                        return Ok(Stop::Closed)
                    }
                    Err(e) => return Err(format!("reading a frame: {e}")),
                }
                moved += *got - before;
                if *got > 0 && deadline.is_none() {
                    *deadline = Some(now + config.timeout);
                }
                if *got < buf.len() {
                    return match deadline {
                        None => {
                            let at = st.last_frame + config.idle_timeout;
                            if now >= at {
                                Err(format!(
                                    "idle for {} s (the peer reconnects when it needs to)",
                                    config.idle_timeout.as_secs()
                                ))
                            } else {
                                Ok(Stop::Wait { read: true, at })
                            }
                        }
                        Some(at) if now >= *at => Err(timed_out("a frame", config.timeout)),
                        Some(at) => Ok(Stop::Wait {
                            read: true,
                            at: *at,
                        }),
                    };
                }
                let hb: [u8; wire::HEADER_LEN] = buf[..wire::HEADER_LEN]
                    .try_into()
                    .map_err(|_| "a short header".to_string())?;
                let header = Header::decode(&hb).map_err(|e| e.0)?;
                if header.kind == Kind::Response {
                    return Err("a peer sent a response frame as a request".into());
                }
                // The descriptors and tag, of which the first bytes came
                // with the header (a one-descriptor frame is whole now).
                let mut bytes = vec![0u8; header.count as usize * wire::DESC_LEN + TAG_LEN];
                let early = HEAD_READ - wire::HEADER_LEN;
                bytes[..early].copy_from_slice(&buf[wire::HEADER_LEN..]);
                let deadline = deadline.unwrap_or(now + config.timeout);
                st.phase = Phase::Descs {
                    header,
                    bytes,
                    got: early,
                    deadline,
                };
            }
            Phase::Descs {
                header,
                bytes,
                got,
                deadline,
            } => {
                let before = *got;
                fill(fd, bytes, got).map_err(|e| format!("reading descriptors: {e}"))?;
                moved += *got - before;
                if *got < bytes.len() {
                    if now >= *deadline {
                        return Err(timed_out("a frame", config.timeout));
                    }
                    return Ok(Stop::Wait {
                        read: true,
                        at: *deadline,
                    });
                }
                let header = *header;
                let deadline = *deadline;
                let bytes = std::mem::take(bytes);
                st.phase = begin(st, header, &bytes, deadline, regions, config)?;
            }
            Phase::Payload { work, io } => {
                let before = io.len();
                let n = sockio::recv_some(fd, io, true)
                    .map_err(|e| format!("reading a WRITE payload: {e}"))?;
                moved += before - io.len();
                if !io.is_done() {
                    if n == 0 {
                        if now >= work.deadline {
                            return Err(timed_out("a WRITE payload", config.timeout));
                        }
                        return Ok(Stop::Wait {
                            read: true,
                            at: work.deadline,
                        });
                    }
                    continue;
                }
                let Phase::Payload { work, .. } = std::mem::replace(&mut st.phase, waiting())
                else {
                    return Err("a payload's state was lost (a bug)".into());
                };
                st.phase = respond(&mut st.session, work, false, config.timeout, false);
            }
            Phase::Tagged {
                work,
                segs,
                seg,
                io,
                scratch,
                mac,
                tag,
            } => {
                let before = io.len();
                let n = sockio::recv_some(fd, io, true)
                    .map_err(|e| format!("reading a WRITE payload: {e}"))?;
                moved += before - io.len();
                if !io.is_done() {
                    if n == 0 {
                        if now >= work.deadline {
                            return Err(timed_out("a WRITE payload", config.timeout));
                        }
                        return Ok(Stop::Wait {
                            read: true,
                            at: work.deadline,
                        });
                    }
                    continue;
                }
                // A piece (or the tag) has arrived whole: hash it, queue
                // the next.
                if *seg < segs.len() {
                    let m = mac.as_mut().ok_or("a payload without its hash")?;
                    match segs[*seg] {
                        Seg::Pinned(i, j) => {
                            for d in &work.descs[i..j] {
                                // SAFETY: the range lies inside a registered
                                // region that its pin keeps registered; the
                                // bytes were just received there.
                                m.update(unsafe {
                                    std::slice::from_raw_parts(d.addr as *const u8, d.len as usize)
                                });
                            }
                        }
                        Seg::Refused(n) => m.update(&scratch[..n]),
                    }
                    *seg += 1;
                    *io = IoSlices::new();
                    match segs.get(*seg) {
                        Some(Seg::Pinned(i, j)) => {
                            for d in &work.descs[*i..*j] {
                                io.push(d.addr as *const u8, d.len as usize);
                            }
                        }
                        Some(Seg::Refused(n)) => io.push(scratch.as_mut_ptr(), *n),
                        None => io.push(tag.as_mut_ptr(), TAG_LEN),
                    }
                    continue;
                }
                let Phase::Tagged { work, mac, tag, .. } =
                    std::mem::replace(&mut st.phase, waiting())
                else {
                    return Err("a payload's state was lost (a bug)".into());
                };
                let mut work = work;
                if let Err(e) = mac.ok_or("a payload without its hash")?.verify(&tag[..]) {
                    // Its bytes have landed, unproven: the initiator learns
                    // why its requests failed, then the connection closes.
                    work.statuses.fill(sys::FERRY_ERR_PROTOCOL);
                    let mut reply = respond(&mut st.session, work, false, config.timeout, true);
                    if let Phase::Respond { then_close, .. } = &mut reply {
                        *then_close = Some(format!("WRITE payload: {e}"));
                    }
                    st.phase = reply;
                    continue;
                }
                st.phase = respond(&mut st.session, work, false, config.timeout, false);
            }
            Phase::Respond {
                io,
                deadline,
                then_close,
                ..
            } => {
                let before = io.len();
                let n = sockio::send_some(fd, io, true)
                    .map_err(|e| format!("sending a response: {e}"))?;
                moved += before - io.len();
                if !io.is_done() {
                    if n == 0 {
                        if now >= *deadline {
                            return Err(timed_out("sending a response", config.timeout));
                        }
                        return Ok(Stop::Wait {
                            read: false,
                            at: *deadline,
                        });
                    }
                    continue;
                }
                if let Some(why) = then_close.take() {
                    return Err(why);
                }
                st.phase = waiting();
                st.last_frame = Instant::now();
                return Ok(Stop::Answered);
            }
        }
    }
}

/// A frame's descriptors have arrived whole: check the tag, pin the
/// ranges, and choose what comes next.
fn begin(
    st: &mut State,
    header: Header,
    bytes: &[u8],
    deadline: Instant,
    regions: &Regions,
    config: &ServeConfig,
) -> Result<Phase, String> {
    let (desc_bytes, tag) = bytes.split_at(bytes.len() - TAG_LEN);
    // Nothing in the frame is acted on before its tag passed.
    st.session
        .recv
        .open(&[&header.encode(), desc_bytes], tag)
        .map_err(|e| e.to_string())?;
    if config.require_payload_tag && !header.payload_tagged() {
        return Err(
            "the peer sent a frame without a payload tag, and this target requires \
                    them (FERRY_INTEGRITY=payload); set it on the peer too"
                .into(),
        );
    }
    let descs = wire::decode_descs(&header, desc_bytes).map_err(|e| e.0)?;
    let (pins, statuses) = regions.pin_all(descs.iter().map(|d| (d.addr, d.len)));
    let work = Work {
        header,
        descs,
        pins,
        statuses,
        deadline,
    };
    match header.kind {
        Kind::Write if header.payload_tagged() => Ok(tagged(work, &st.session)),
        Kind::Write => {
            let mut io = IoSlices::new();
            for (d, st) in work.descs.iter().zip(&work.statuses) {
                if *st == sys::FERRY_OK {
                    io.push(d.addr as *const u8, d.len as usize);
                } else {
                    let mut left = d.len;
                    while left > 0 {
                        let n = left.min(SINK_LEN as u64) as usize;
                        io.push(*SINK as *const u8, n);
                        left -= n as u64;
                    }
                }
            }
            if io.is_done() {
                return Ok(respond(&mut st.session, work, false, config.timeout, false));
            }
            Ok(Phase::Payload { work, io })
        }
        Kind::Read => Ok(respond(&mut st.session, work, true, config.timeout, false)),
        Kind::Response => Err("a peer sent a response frame as a request".into()),
    }
}

/// The pieces of a tagged WRITE payload and the first one's slices.
fn tagged(work: Work, session: &Session) -> Phase {
    let mut segs = Vec::new();
    let mut i = 0;
    let mut largest_refused = 0usize;
    while i < work.descs.len() {
        if work.statuses[i] == sys::FERRY_OK {
            let mut j = i;
            while j < work.descs.len() && work.statuses[j] == sys::FERRY_OK {
                j += 1;
            }
            segs.push(Seg::Pinned(i, j));
            i = j;
        } else {
            let mut left = work.descs[i].len;
            while left > 0 {
                let n = left.min(SINK_LEN as u64) as usize;
                segs.push(Seg::Refused(n));
                largest_refused = largest_refused.max(n);
                left -= n as u64;
            }
            i += 1;
        }
    }
    let mut scratch = vec![0u8; largest_refused];
    let mut tag = Box::new([0u8; TAG_LEN]);
    let mut io = IoSlices::new();
    match segs.first() {
        Some(Seg::Pinned(i, j)) => {
            for d in &work.descs[*i..*j] {
                io.push(d.addr as *const u8, d.len as usize);
            }
        }
        Some(Seg::Refused(n)) => io.push(scratch.as_mut_ptr(), *n),
        None => io.push(tag.as_mut_ptr(), TAG_LEN),
    }
    let mac = Some(Box::new(session.recv.payload(work.header.seq)));
    Phase::Tagged {
        work,
        segs,
        seg: 0,
        io,
        scratch,
        mac,
        tag,
    }
}

/// The response to a frame: statuses, and for a READ its payload (and the
/// payload's tag when the request asked for one).
fn respond(
    session: &mut Session,
    work: Work,
    read: bool,
    timeout: Duration,
    integrity_failed: bool,
) -> Phase {
    let Work {
        header: request,
        descs,
        pins,
        statuses,
        ..
    } = work;
    let payload_len: u64 = if read {
        descs
            .iter()
            .zip(&statuses)
            .filter(|(_, s)| **s == sys::FERRY_OK)
            .map(|(d, _)| d.len)
            .sum()
    } else {
        0
    };
    let header = Header {
        kind: Kind::Response,
        flags: request.flags
            | if integrity_failed {
                wire::FLAG_INTEGRITY_FAILED
            } else {
                0
            },
        count: request.count,
        seq: request.seq,
        payload_len,
    };
    let tx = &mut session.send;
    let mut out =
        Vec::with_capacity(wire::HEADER_LEN + statuses.len() * wire::STATUS_LEN + TAG_LEN);
    out.extend_from_slice(&header.encode());
    wire::encode_statuses(&statuses, &mut out);
    let tag = tx.seal(&[&out]);
    out.extend_from_slice(&tag);
    let mut io = IoSlices::new();
    io.push(out.as_ptr(), out.len());
    let mut mac = request.payload_tagged().then(|| tx.payload(request.seq));
    if read {
        for (d, st) in descs.iter().zip(&statuses) {
            if *st == sys::FERRY_OK {
                io.push(d.addr as *const u8, d.len as usize);
                if let Some(m) = &mut mac {
                    // SAFETY: the range was pinned inside a registered
                    // region, and the pins stay with the response until it
                    // has left.
                    m.update(unsafe {
                        std::slice::from_raw_parts(d.addr as *const u8, d.len as usize)
                    });
                }
            }
        }
    }
    let tail: Vec<u8> = mac.map(|m| m.finish().to_vec()).unwrap_or_default();
    io.push(tail.as_ptr(), tail.len());
    // A WRITE's pins go now: its bytes have landed.
    let pins = if read { pins } else { Vec::new() };
    Phase::Respond {
        _out: out,
        _tail: tail,
        io,
        _pins: pins,
        deadline: Instant::now() + timeout,
        then_close: None,
    }
}
