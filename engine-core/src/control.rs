//! The control plane: a small TCP listener per engine that answers "what is
//! your segment descriptor?", and the client side that asks.
//!
//! Every frame is `magic "FRYC" | version u16 | type u16 | body length u32 |
//! reserved u32` (little endian) followed by a JSON body and, on an
//! authenticated connection, the 16-byte tag of header and body under the
//! session's key for that direction and the frame's (implicit) sequence
//! number (`sdk::auth`): a frame injected, replayed, reordered or altered by
//! a relay fails its tag and closes the connection. Frames are bounded in
//! size, and the bodies being read by one listener at once are bounded in
//! total ([`MAX_BODIES_IN_FLIGHT`]) and per host; a whole frame (not each read) must
//! arrive or leave within the I/O deadline, a connection idle for the idle
//! timeout is closed, and anything malformed closes the connection without
//! touching engine state.
//!
//! The listener is `control_server`.

use crate::descriptor::SegmentDescriptor;
use crate::error::{Error, ErrorCode, Result};
use ferry_plugins_abi::sdk::admission;
use ferry_plugins_abi::sdk::auth::{self, AuthError, Direction, Session, Token, TAG_LEN};
use ferry_plugins_abi::sdk::deadline::{self, DeadlineStream};
use serde::{Deserialize, Serialize};
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::time::Duration;

pub const CONTROL_MAGIC: [u8; 4] = *b"FRYC";
pub const CONTROL_VERSION: u16 = 1;
pub const HEADER_LEN: usize = 16;
/// Largest body accepted (a descriptor with ~100k buffers).
pub const MAX_BODY: usize = 16 << 20;
/// Bytes of frame bodies one listener holds at once, over all its
/// connections (8 maximal frames), reserved as they arrive
/// (`control_budget`, with a share per host): a frame whose next bytes do
/// not fit waits, and one that waits past the I/O deadline is answered
/// BUSY and its connection closed. This bounds what peers can make a
/// listener hold in received frames: 128 MiB.
pub const MAX_BODIES_IN_FLIGHT: usize = 8 * MAX_BODY;
/// Body bytes allocated before they arrive: a frame claiming 16 MiB costs
/// memory only as its bytes come in.
const BODY_CHUNK: usize = 64 << 10;

/// How this engine talks to peers' control planes: deadlines and the
/// cluster's auth token (every connection proves it knows it, both ways).
#[derive(Clone, Debug)]
pub struct Link {
    pub connect_timeout: Duration,
    /// A whole frame must be sent or received within this.
    pub io_timeout: Duration,
    /// A served connection with no request for this long is closed
    /// (FERRY_IDLE_TIMEOUT_S); a client drops a cached connection idle for
    /// half of it, so it never reuses one the server is about to close.
    pub idle_timeout: Duration,
    pub token: Option<Token>,
    /// A new connection to this listener must authenticate within this
    /// (FERRY_AUTH_TIMEOUT_MS).
    pub auth_timeout: Duration,
    /// Connections authenticating at once, in all and per source address
    /// (FERRY_AUTH_MAX_PENDING, FERRY_AUTH_MAX_PENDING_PER_HOST).
    pub max_pending: usize,
    pub max_pending_per_source: usize,
    /// Authenticated connections this listener serves from one host
    /// (FERRY_CONTROL_MAX_PER_HOST).
    pub max_per_host: usize,
}

impl Link {
    pub fn new(connect_timeout: Duration, io_timeout: Duration, token: Option<Token>) -> Link {
        Link {
            connect_timeout,
            io_timeout,
            idle_timeout: Duration::from_secs(crate::config::DEFAULT_IDLE_TIMEOUT_S),
            token,
            auth_timeout: Duration::from_millis(admission::DEFAULT_AUTH_TIMEOUT_MS),
            max_pending: admission::DEFAULT_MAX_PENDING,
            max_pending_per_source: admission::DEFAULT_MAX_PENDING_PER_SOURCE,
            max_per_host: crate::config::DEFAULT_CONTROL_MAX_PER_HOST,
        }
    }

    pub fn with_idle_timeout(mut self, idle: Duration) -> Link {
        self.idle_timeout = idle;
        self
    }
}

fn auth_error(peer: &str, e: AuthError) -> Error {
    match e {
        AuthError::Refused(m) => Error::new(ErrorCode::Permission, m),
        AuthError::Protocol(m) => Error::new(ErrorCode::Protocol, format!("{peer}: {m}")),
        AuthError::Busy(m) => Error::new(ErrorCode::Busy, m),
    }
}

fn integrity_error(peer: &str, e: auth::IntegrityError) -> Error {
    Error::new(
        ErrorCode::Protocol,
        format!("control connection to {peer}: {e}"),
    )
}

/// Connects to a peer's control plane and authenticates both ways. A peer
/// that answers BUSY is tried again, with backoff, until the connect
/// deadline.
fn open(name: &str, link: &Link) -> Result<(TcpStream, Session)> {
    let started = std::time::Instant::now();
    let mut pause = Duration::from_millis(10);
    loop {
        let stream = connect(name, link.connect_timeout)?;
        let _ = stream.set_nodelay(true);
        // The whole exchange must finish within the connect deadline.
        let left = link.connect_timeout.saturating_sub(started.elapsed());
        match auth::connect(
            &mut DeadlineStream::new(&stream, left.max(Duration::from_millis(100))),
            link.token.as_ref(),
            "control",
            name,
        ) {
            Ok(session) => return Ok((stream, session)),
            Err(AuthError::Busy(m)) if started.elapsed() + pause < link.connect_timeout => {
                log::debug!("{m}; trying again in {} ms", pause.as_millis());
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(250));
            }
            Err(AuthError::Busy(_)) => {
                return Err(Error::new(
                    ErrorCode::Busy,
                    format!(
                        "segment {name} is busy: it turned this engine away for {} ms (too many \
                         connections being set up); try again later",
                        started.elapsed().as_millis()
                    ),
                ))
            }
            Err(e) => return Err(auth_error(name, e)),
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u16)]
pub enum MsgType {
    GetDescriptor = 1,
    Descriptor = 2,
    Error = 3,
    /// Open a staging session on this connection (bounce buffers for a
    /// peer that moves device memory over a host-only transport).
    StageOpen = 4,
    StageOpened = 5,
    /// Copy between a staging buffer and device memory.
    StageCopy = 6,
    StageDone = 7,
    /// A transport plugin's message to the same-named transport here
    /// (plugin messaging: handshakes such as RDMA queue pair numbers).
    PluginRequest = 8,
    PluginReply = 9,
    /// A batch's notification, sent once the batch's data has landed
    /// (crate::notify has its wire form); answered NotifyAck, or an error
    /// (BUSY: the receiver's queue is full).
    Notify = 10,
    NotifyAck = 11,
    /// Many copies between one staging slot and device memory, as one
    /// device operation (staging/protocol.rs has its wire form); answered
    /// StageDone.
    StageCopyList = 12,
}

impl MsgType {
    fn from_raw(v: u16) -> Option<MsgType> {
        match v {
            1 => Some(MsgType::GetDescriptor),
            2 => Some(MsgType::Descriptor),
            3 => Some(MsgType::Error),
            4 => Some(MsgType::StageOpen),
            5 => Some(MsgType::StageOpened),
            6 => Some(MsgType::StageCopy),
            7 => Some(MsgType::StageDone),
            8 => Some(MsgType::PluginRequest),
            9 => Some(MsgType::PluginReply),
            10 => Some(MsgType::Notify),
            11 => Some(MsgType::NotifyAck),
            12 => Some(MsgType::StageCopyList),
            _ => None,
        }
    }

    pub(crate) fn is_request(self) -> bool {
        matches!(
            self,
            MsgType::GetDescriptor
                | MsgType::StageOpen
                | MsgType::StageCopy
                | MsgType::StageCopyList
                | MsgType::PluginRequest
                | MsgType::Notify
        )
    }
}

#[derive(Serialize, Deserialize)]
pub(crate) struct ErrorBody {
    pub(crate) code: i32,
    pub(crate) message: String,
}

/// An Error frame's body.
pub(crate) fn error_body(code: ErrorCode, message: &str) -> Vec<u8> {
    serde_json::to_vec(&ErrorBody {
        code: code.as_raw(),
        message: message.to_string(),
    })
    .unwrap_or_default()
}

/// What a control listener serves; the engine implements it.
pub trait ControlHandler: Send + Sync + 'static {
    fn descriptor(&self) -> SegmentDescriptor;
    /// Any other request on connection `conn`: the reply's type and body.
    /// It may block (building a descriptor, waiting on a lock).
    fn request(&self, conn: u64, kind: MsgType, body: &[u8]) -> Result<(MsgType, Vec<u8>)>;
    /// Connection `conn` is gone: drop what belonged to it. Called once per
    /// connection, never while a request of it is being answered.
    fn connection_closed(&self, conn: u64);
}

/// Encodes one frame.
pub fn encode_frame(kind: MsgType, body: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + body.len());
    out.extend_from_slice(&CONTROL_MAGIC);
    out.extend_from_slice(&CONTROL_VERSION.to_le_bytes());
    out.extend_from_slice(&(kind as u16).to_le_bytes());
    out.extend_from_slice(&(body.len() as u32).to_le_bytes());
    out.extend_from_slice(&0u32.to_le_bytes());
    out.extend_from_slice(body);
    out
}

/// A decoded header: the message type and the body length, both checked.
pub fn decode_header(h: &[u8; HEADER_LEN]) -> Result<(MsgType, usize)> {
    if h[..4] != CONTROL_MAGIC {
        return Err(Error::new(
            ErrorCode::Protocol,
            "not a Ferry control connection (bad magic)",
        ));
    }
    let version = u16::from_le_bytes([h[4], h[5]]);
    if version != CONTROL_VERSION {
        return Err(Error::new(
            ErrorCode::Protocol,
            format!(
                "control protocol version {version} is not supported (this Ferry speaks \
                 {CONTROL_VERSION})"
            ),
        ));
    }
    let kind = u16::from_le_bytes([h[6], h[7]]);
    let kind = MsgType::from_raw(kind)
        .ok_or_else(|| Error::new(ErrorCode::Protocol, format!("unknown message type {kind}")))?;
    let len = u32::from_le_bytes([h[8], h[9], h[10], h[11]]) as usize;
    if len > MAX_BODY {
        return Err(Error::new(
            ErrorCode::Protocol,
            format!("a control message of {len} bytes exceeds the {MAX_BODY}-byte limit"),
        ));
    }
    Ok((kind, len))
}

fn io_error(what: &str, peer: &str, e: &io::Error) -> Error {
    let code = match e.kind() {
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => ErrorCode::Timeout,
        _ => ErrorCode::Connection,
    };
    let detail = if code == ErrorCode::Timeout {
        "timed out".to_string()
    } else {
        e.to_string()
    };
    Error::new(code, format!("{what} {peer}: {detail}"))
}

/// Reads one whole frame. The body's memory grows as its bytes arrive, so
/// a frame that only claims a large size costs nothing.
#[cfg(any(test, feature = "testing"))]
pub fn read_frame(stream: &mut impl Read, peer: &str) -> Result<(MsgType, Vec<u8>)> {
    let mut header = [0u8; HEADER_LEN];
    stream
        .read_exact(&mut header)
        .map_err(|e| io_error("reading from", peer, &e))?;
    let (kind, len) = decode_header(&header)?;
    let mut body = Vec::with_capacity(len.min(BODY_CHUNK));
    stream
        .take(len as u64)
        .read_to_end(&mut body)
        .map_err(|e| io_error("reading from", peer, &e))?;
    if body.len() != len {
        return Err(Error::new(
            ErrorCode::Connection,
            format!("reading from {peer}: the connection closed in the middle of a frame"),
        ));
    }
    Ok((kind, body))
}

/// Reads one tagged frame that must arrive whole within `timeout` and
/// checks its tag (the client side; the listener parses the same frames
/// without blocking, in `control_conn`).
pub(crate) fn read_sealed(
    stream: &TcpStream,
    peer: &str,
    timeout: Duration,
    rx: &mut Direction,
) -> Result<(MsgType, Vec<u8>)> {
    let mut s = DeadlineStream::new(stream, timeout);
    let mut header = [0u8; HEADER_LEN];
    s.read_exact(&mut header)
        .map_err(|e| io_error("reading from", peer, &e))?;
    let (kind, len) = decode_header(&header)?;
    let mut body = Vec::with_capacity(len.min(BODY_CHUNK));
    (&mut s)
        .take(len as u64)
        .read_to_end(&mut body)
        .map_err(|e| io_error("reading from", peer, &e))?;
    let mut tag = [0u8; TAG_LEN];
    if body.len() != len || s.read_exact(&mut tag).is_err() {
        return Err(Error::new(
            ErrorCode::Connection,
            format!("reading from {peer}: the connection closed in the middle of a frame"),
        ));
    }
    rx.open(&[&header, &body], &tag)
        .map_err(|e| integrity_error(peer, e))?;
    Ok((kind, body))
}

/// Reads one tagged frame (for tools and tests that speak the protocol
/// themselves).
#[cfg(feature = "testing")]
pub fn read_frame_sealed(
    stream: &TcpStream,
    peer: &str,
    timeout: Duration,
    rx: &mut Direction,
) -> Result<(MsgType, Vec<u8>)> {
    read_sealed(stream, peer, timeout, rx)
}

/// Writes one tagged frame within `timeout`.
pub fn write_sealed(
    stream: &TcpStream,
    peer: &str,
    timeout: Duration,
    tx: &mut Direction,
    kind: MsgType,
    body: &[u8],
) -> Result<()> {
    let mut frame = encode_frame(kind, body);
    let tag = tx.seal(&[&frame]);
    frame.extend_from_slice(&tag);
    DeadlineStream::new(stream, timeout)
        .write_all(&frame)
        .map_err(|e| io_error("writing to", peer, &e))
}

/// Resolves "host:port" and connects within `timeout`, trying each address.
pub fn connect(name: &str, timeout: Duration) -> Result<TcpStream> {
    let addrs: Vec<SocketAddr> = name
        .to_socket_addrs()
        .map_err(|e| {
            Error::new(
                ErrorCode::NotFound,
                format!("segment {name:?}: cannot resolve it as host:port ({e})"),
            )
        })?
        .collect();
    let mut last = None;
    for addr in &addrs {
        match TcpStream::connect_timeout(addr, timeout) {
            Ok(s) => return Ok(s),
            Err(e) => last = Some(e),
        }
    }
    let e = last.unwrap_or_else(|| io::Error::new(io::ErrorKind::NotFound, "no address"));
    let code = match e.kind() {
        io::ErrorKind::TimedOut | io::ErrorKind::WouldBlock => ErrorCode::Timeout,
        _ => ErrorCode::Connection,
    };
    let hint = if e.kind() == io::ErrorKind::ConnectionRefused {
        " (no engine listens there: is the peer running?)"
    } else {
        ""
    };
    Err(Error::new(
        code,
        format!("cannot reach segment {name}: {e}{hint}"),
    ))
}

/// A persistent control connection to a peer, for requests that belong to
/// a session (staging).
pub struct ControlClient {
    name: String,
    stream: TcpStream,
    session: Session,
    io_timeout: Duration,
    idle_timeout: Duration,
    /// When the last reply arrived (or the connection was made).
    last_used: std::time::Instant,
}

impl ControlClient {
    pub fn connect(name: &str, link: &Link) -> Result<ControlClient> {
        let (stream, session) = open(name, link)?;
        Ok(ControlClient {
            name: name.to_string(),
            stream,
            session,
            io_timeout: link.io_timeout,
            idle_timeout: link.idle_timeout,
            last_used: std::time::Instant::now(),
        })
    }

    /// Whether a connection with nothing outstanding can be used again: the
    /// peer has not closed it, and it has been idle for less than half the
    /// idle timeout (the server closes it after the whole).
    pub fn reusable(&self) -> bool {
        self.last_used.elapsed() < self.idle_timeout / 2
            && !deadline::idle_connection_is_dead(&self.stream)
    }

    /// Sends a request and reads its reply; an Error frame becomes the error.
    pub fn call(&mut self, kind: MsgType, body: &[u8]) -> Result<(MsgType, Vec<u8>)> {
        self.send(kind, body)?;
        self.recv()
    }

    /// Sends a request without waiting; replies come back in order.
    pub fn send(&mut self, kind: MsgType, body: &[u8]) -> Result<()> {
        write_sealed(
            &self.stream,
            &self.name,
            self.io_timeout,
            &mut self.session.send,
            kind,
            body,
        )
    }

    /// Whether a reply (or the end of the connection) is waiting to be read.
    pub fn reply_ready(&self) -> bool {
        use std::os::fd::AsRawFd;
        let mut fd = libc::pollfd {
            fd: self.stream.as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, zero timeout.
        unsafe { libc::poll(&mut fd, 1, 0) > 0 }
    }

    /// Reads the reply to the oldest request sent.
    pub fn recv(&mut self) -> Result<(MsgType, Vec<u8>)> {
        self.recv_reply()?
    }

    /// Reads the reply to the oldest request sent. The outer error means
    /// the connection failed (and is out of step); the inner one is the
    /// peer refusing the request, after which the connection is still good.
    pub fn recv_reply(&mut self) -> Result<Result<(MsgType, Vec<u8>)>> {
        let (reply, body) = read_sealed(
            &self.stream,
            &self.name,
            self.io_timeout,
            &mut self.session.recv,
        )?;
        self.last_used = std::time::Instant::now();
        if reply == MsgType::Error {
            return Ok(Err(decode_error(&self.name, &body)));
        }
        Ok(Ok((reply, body)))
    }
}

/// The error a peer's Error frame carries (its message cut to 1 KiB); a
/// malformed body is a protocol error.
pub fn decode_error(name: &str, body: &[u8]) -> Error {
    match serde_json::from_slice::<ErrorBody>(body) {
        Ok(e) => {
            let code = ErrorCode::from_raw(e.code).unwrap_or(ErrorCode::Plugin);
            let msg: String = e.message.chars().take(1024).collect();
            Error::new(code, format!("segment {name} refused: {msg}"))
        }
        Err(_) => Error::new(
            ErrorCode::Protocol,
            format!("{name} sent a malformed error"),
        ),
    }
}

/// Fetches a peer's segment descriptor.
pub fn fetch_descriptor(name: &str, link: &Link) -> Result<SegmentDescriptor> {
    let (stream, mut session) = open(name, link)?;
    write_sealed(
        &stream,
        name,
        link.io_timeout,
        &mut session.send,
        MsgType::GetDescriptor,
        b"{}",
    )?;
    let (kind, body) = read_sealed(&stream, name, link.io_timeout, &mut session.recv)?;
    let _ = stream.shutdown(Shutdown::Both);
    match kind {
        MsgType::Descriptor => SegmentDescriptor::from_json(&body),
        MsgType::Error => Err(decode_error(name, &body)),
        _ => Err(Error::new(
            ErrorCode::Protocol,
            format!("{name} answered with an unexpected message"),
        )),
    }
}

/// Longest transport name and sender name in a plugin message.
const MAX_PLUGIN_NAME: usize = 64;
const MAX_SENDER_NAME: usize = 512;

/// A plugin message as it travels: `u16 transport name length | name |
/// u16 sender length | sender | payload` (little endian).
pub fn encode_plugin_request(transport: &str, from: &str, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(4 + transport.len() + from.len() + payload.len());
    for part in [transport.as_bytes(), from.as_bytes()] {
        out.extend_from_slice(&(part.len() as u16).to_le_bytes());
        out.extend_from_slice(part);
    }
    out.extend_from_slice(payload);
    out
}

/// The transport name, the sender and the payload of a plugin message;
/// every length is checked.
pub fn decode_plugin_request(body: &[u8]) -> Result<(String, String, &[u8])> {
    let bad = |what: &str| {
        Error::new(
            ErrorCode::Protocol,
            format!("malformed plugin message: {what}"),
        )
    };
    let mut rest = body;
    let mut take = |limit: usize, what: &str| -> Result<String> {
        if rest.len() < 2 {
            return Err(bad(what));
        }
        let n = u16::from_le_bytes([rest[0], rest[1]]) as usize;
        if n > limit || rest.len() < 2 + n {
            return Err(bad(what));
        }
        let s = std::str::from_utf8(&rest[2..2 + n])
            .map_err(|_| bad(what))?
            .to_string();
        rest = &rest[2 + n..];
        Ok(s)
    };
    let transport = take(MAX_PLUGIN_NAME, "transport name")?;
    let from = take(MAX_SENDER_NAME, "sender name")?;
    if transport.is_empty()
        || !transport
            .bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
    {
        return Err(bad("transport name"));
    }
    if rest.len() > ferry_plugins_abi::sys::FERRY_PEER_MSG_MAX {
        return Err(bad("payload over the plugin message limit"));
    }
    Ok((transport, from, rest))
}

/// Sends a plugin message to transport `transport` of the engine serving
/// `peer` and returns the reply's payload (one connection per message:
/// handshakes are rare).
pub fn plugin_request(
    peer: &str,
    transport: &str,
    from: &str,
    payload: &[u8],
    link: &Link,
) -> Result<Vec<u8>> {
    if payload.len() > ferry_plugins_abi::sys::FERRY_PEER_MSG_MAX {
        return Err(Error::new(
            ErrorCode::InvalidArgument,
            "plugin message over the size limit",
        ));
    }
    let mut client = ControlClient::connect(peer, link)?;
    let body = encode_plugin_request(transport, from, payload);
    let (kind, reply) = client.call(MsgType::PluginRequest, &body)?;
    let _ = client.stream.shutdown(Shutdown::Both);
    if kind != MsgType::PluginReply {
        return Err(Error::new(
            ErrorCode::Protocol,
            format!("{peer} answered a plugin message with an unexpected message"),
        ));
    }
    if reply.len() > ferry_plugins_abi::sys::FERRY_PEER_MSG_MAX {
        return Err(Error::new(
            ErrorCode::Protocol,
            format!("{peer} sent a plugin reply over the size limit"),
        ));
    }
    Ok(reply)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_are_checked() {
        let f = encode_frame(MsgType::GetDescriptor, b"{}");
        let h: [u8; HEADER_LEN] = f[..HEADER_LEN].try_into().unwrap();
        assert_eq!(decode_header(&h).unwrap(), (MsgType::GetDescriptor, 2));
        let mut bad = h;
        bad[0] = b'X';
        assert!(decode_header(&bad)
            .unwrap_err()
            .message
            .contains("bad magic"));
        let mut bad = h;
        bad[4] = 9;
        assert!(decode_header(&bad)
            .unwrap_err()
            .message
            .contains("version 9"));
        let mut bad = h;
        bad[6] = 77;
        assert!(decode_header(&bad).is_err());
        let mut bad = h;
        bad[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(decode_header(&bad).unwrap_err().message.contains("limit"));
    }

    #[test]
    fn plugin_messages_round_trip_and_reject_garbage() {
        let body = encode_plugin_request("rdma", "10.0.0.1:7000", b"payload");
        let (t, from, payload) = decode_plugin_request(&body).unwrap();
        assert_eq!(
            (t.as_str(), from.as_str(), payload),
            ("rdma", "10.0.0.1:7000", &b"payload"[..])
        );
        for bad in [
            &b""[..],
            &[4, 0, b'r'][..],
            &[255, 255, b'r', b'd'][..],
            &encode_plugin_request("RDMA", "x", b"")[..],
            &encode_plugin_request("", "x", b"")[..],
            &encode_plugin_request("rdma", &"x".repeat(600), b"")[..],
        ] {
            assert_eq!(
                decode_plugin_request(bad).unwrap_err().code,
                ErrorCode::Protocol
            );
        }
    }

    #[test]
    fn garbage_gets_no_descriptor() {
        let mut data: &[u8] = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
        assert_eq!(
            read_frame(&mut data, "test").unwrap_err().code,
            ErrorCode::Protocol
        );
    }
}
