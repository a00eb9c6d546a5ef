//! The control listener: accepts connections, authenticates them, and
//! serves their requests (frames and the client side are in `control`).
//!
//! Connections still authenticating have their own small pool
//! (`sdk::admission`) and a short deadline, apart from the
//! [`MAX_CONNECTIONS`] authenticated ones, which they can never crowd out.
//! Every refusal is counted by kind ([`REFUSALS`]) and logged at most once
//! per interval.

use crate::control::{read_sealed, write_sealed, BodyBudget, ErrorBody, Link, MsgType};
use crate::descriptor::SegmentDescriptor;
use crate::error::{Error, ErrorCode, Result};
use ferry_plugins_abi::sdk::admission::{PreAuthPool, Refusal, Refusals, Source};
use ferry_plugins_abi::sdk::auth::{self, AuthError, Direction, Session};
use ferry_plugins_abi::sdk::deadline::{self, DeadlineStream};
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Weak};
use std::thread::JoinHandle;
use std::time::Duration;

/// Authenticated control connections served at once; more are refused
/// with BUSY.
pub const MAX_CONNECTIONS: usize = 128;
/// Refused or failed authentications on control listeners, process-wide
/// (for tests and reports).
pub static AUTH_REFUSED: AtomicUsize = AtomicUsize::new(0);

/// Every refusal by control listeners of this process, by kind.
pub static REFUSALS: LazyLock<Refusals> = LazyLock::new(|| Refusals::new("control"));

fn refuse(kind: Refusal, detail: impl FnOnce() -> String) {
    if matches!(kind, Refusal::Auth | Refusal::Timeout) {
        AUTH_REFUSED.fetch_add(1, Ordering::SeqCst);
    }
    REFUSALS.record(kind, detail, |line| log::warn!("{line}"));
}

/// What the control server serves; the engine implements it.
pub trait ControlHandler: Send + Sync + 'static {
    fn descriptor(&self) -> SegmentDescriptor;
    /// Any other request on connection `conn`: the reply's type and body.
    fn request(&self, conn: u64, kind: MsgType, body: &[u8]) -> Result<(MsgType, Vec<u8>)>;
    /// Connection `conn` is gone: drop what belonged to it.
    fn connection_closed(&self, conn: u64);
}

/// The engine's control listener. Dropping it stops the listener and waits
/// for its accept thread.
pub struct ControlServer {
    addr: SocketAddr,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl ControlServer {
    /// Binds the control listener ("127.0.0.1:0", "0.0.0.0:7000") without
    /// serving yet, so the engine knows its port before it starts plugins.
    pub fn bind(listen: &str) -> Result<TcpListener> {
        TcpListener::bind(listen).map_err(|e| {
            let code = if e.kind() == io::ErrorKind::AddrInUse {
                ErrorCode::Busy
            } else {
                ErrorCode::Io
            };
            Error::new(
                code,
                format!("cannot listen on {listen} for control connections: {e}"),
            )
        })
    }

    /// Serves `listener` until dropped.
    pub fn start(
        listener: TcpListener,
        handler: Weak<dyn ControlHandler>,
        link: &Link,
    ) -> Result<ControlServer> {
        let link = link.clone();
        let addr = listener.local_addr().map_err(|e| {
            Error::new(ErrorCode::Io, format!("cannot read the bound address: {e}"))
        })?;
        listener.set_nonblocking(true).map_err(|e| {
            Error::new(
                ErrorCode::Io,
                format!("cannot make the listener non-blocking: {e}"),
            )
        })?;
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = stop.clone();
        let thread = std::thread::Builder::new()
            .name("ferry-control".into())
            .spawn(move || accept_loop(listener, handler, stop2, link))
            .map_err(|e| Error::new(ErrorCode::NoMemory, format!("cannot start a thread: {e}")))?;
        Ok(ControlServer {
            addr,
            stop,
            thread: Some(thread),
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for ControlServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn accept_loop(
    listener: TcpListener,
    handler: Weak<dyn ControlHandler>,
    stop: Arc<AtomicBool>,
    link: Link,
) {
    // Authenticated connections; those still proving themselves are in
    // `pending`, a pool of their own.
    let active = Arc::new(AtomicUsize::new(0));
    let pending = PreAuthPool::new(link.max_pending, link.max_pending_per_source);
    let budget = BodyBudget::default();
    let mut next_conn: u64 = 0;
    let fd = std::os::fd::AsRawFd::as_raw_fd(&listener);
    while !stop.load(Ordering::SeqCst) {
        // Wait for a connection or 100 ms, then look at the stop flag again.
        let mut pfd = libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut pfd, 1, 100) };
        let (stream, peer) = match listener.accept() {
            Ok(s) => s,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => {
                log::debug!("control accept failed: {e}");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        let _ = stream.set_nonblocking(false);
        let _ = stream.set_nodelay(true);
        let slot = match pending.enter(Source::ip(peer.ip())) {
            Ok(slot) => slot,
            Err(why) => {
                auth::refuse_busy(&mut DeadlineStream::new(
                    &stream,
                    Duration::from_millis(100),
                ));
                refuse(why, || {
                    format!("{peer}: {} connections are being set up", pending.pending())
                });
                continue;
            }
        };
        next_conn += 1;
        let conn = next_conn;
        let handler = handler.clone();
        let active2 = active.clone();
        let stop2 = stop.clone();
        let link = link.clone();
        let budget = budget.clone();
        let _ = std::thread::Builder::new()
            .name("ferry-control-conn".into())
            .spawn(move || {
                // Nothing the peer sends is parsed before it proved itself,
                // and the whole exchange has the (short) auth deadline.
                let mut proving = DeadlineStream::new(&stream, link.auth_timeout);
                let proved = auth::accept(&mut proving, link.token.as_ref(), "control");
                drop(slot);
                match proved {
                    Ok(mut session) => {
                        if active2.fetch_add(1, Ordering::SeqCst) >= MAX_CONNECTIONS {
                            let _ = reply_error(
                                &stream,
                                link.io_timeout,
                                &mut session.send,
                                ErrorCode::Busy,
                                "too many control connections; try again",
                            );
                            refuse(Refusal::Full, || {
                                format!("{peer}: {MAX_CONNECTIONS} served")
                            });
                        } else {
                            serve_connection(
                                &stream, peer, conn, &handler, &stop2, &link, session, &budget,
                            );
                        }
                        active2.fetch_sub(1, Ordering::SeqCst);
                    }
                    Err(e) => {
                        let kind = match &e {
                            AuthError::Protocol(m)
                                if m.contains("deadline") || m.contains("timed out") =>
                            {
                                Refusal::Timeout
                            }
                            AuthError::Protocol(_) | AuthError::Busy(_) => Refusal::Protocol,
                            AuthError::Refused(_) => Refusal::Auth,
                        };
                        refuse(kind, || format!("{peer}: {e}"));
                    }
                }
                let _ = stream.shutdown(Shutdown::Both);
                if let Some(h) = handler.upgrade() {
                    h.connection_closed(conn);
                }
            });
    }
}

fn reply_error(
    stream: &TcpStream,
    timeout: Duration,
    tx: &mut Direction,
    code: ErrorCode,
    message: &str,
) -> Result<()> {
    let body = serde_json::to_vec(&ErrorBody {
        code: code.as_raw(),
        message: message.to_string(),
    })
    .unwrap_or_default();
    write_sealed(stream, "peer", timeout, tx, MsgType::Error, &body)
}

/// Serves requests until the peer leaves, breaks the protocol, stays
/// silent for the idle timeout, or takes longer than the I/O deadline to
/// send a frame or to read a reply.
#[allow(clippy::too_many_arguments)]
fn serve_connection(
    stream: &TcpStream,
    peer: SocketAddr,
    conn: u64,
    handler: &Weak<dyn ControlHandler>,
    stop: &AtomicBool,
    link: &Link,
    mut session: Session,
    budget: &BodyBudget,
) {
    use std::os::fd::AsRawFd;
    let peer_s = peer.to_string();
    let io_timeout = link.io_timeout;
    let mut idle_since = std::time::Instant::now();
    while !stop.load(Ordering::SeqCst) {
        // Wait for the next request a tick at a time (to see `stop`).
        if !deadline::wait_readable(stream.as_raw_fd(), Duration::from_millis(100)) {
            if idle_since.elapsed() >= link.idle_timeout {
                log::debug!(
                    "control connection from {peer}: idle for {} s; closing it",
                    link.idle_timeout.as_secs()
                );
                break;
            }
            continue;
        }
        let (kind, body) =
            match read_sealed(stream, &peer_s, io_timeout, &mut session.recv, Some(budget)) {
                Ok(f) => f,
                Err(e) => {
                    if e.message.contains("integrity check failed") {
                        refuse(Refusal::Integrity, || format!("{peer}: {}", e.message));
                    } else if matches!(e.code, ErrorCode::Protocol | ErrorCode::Busy) {
                        log::debug!("control connection from {peer}: {}", e.message);
                        let _ =
                            reply_error(stream, io_timeout, &mut session.send, e.code, &e.message);
                    }
                    break;
                }
            };
        let Some(handler) = handler.upgrade() else {
            break;
        };
        let tx = &mut session.send;
        let result = match kind {
            MsgType::GetDescriptor => {
                let d = handler.descriptor();
                write_sealed(
                    stream,
                    &peer_s,
                    io_timeout,
                    tx,
                    MsgType::Descriptor,
                    &d.to_json(),
                )
            }
            k if k.is_request() => match handler.request(conn, k, &body) {
                Ok((reply, body)) => write_sealed(stream, &peer_s, io_timeout, tx, reply, &body),
                Err(e) => reply_error(stream, io_timeout, tx, e.code, &e.message),
            },
            _ => reply_error(
                stream,
                io_timeout,
                tx,
                ErrorCode::Protocol,
                "unexpected message type for a request",
            ),
        };
        if result.is_err() {
            break;
        }
        idle_since = std::time::Instant::now();
    }
}
