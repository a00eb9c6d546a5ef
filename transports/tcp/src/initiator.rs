//! The initiator side's connections: a peer (peer.rs) is a set of them, and
//! packs its requests into frames (many small requests per frame, large
//! ones split across connections); here each frame is sent and its
//! response completes its requests.
//!
//! No thread per connection: each is driven by one of the instance's I/O
//! loops (reactor.rs), and the latency path avoids even those, since a
//! thread wake-up costs tens of microseconds on a VM, more than the whole
//! round trip. A submitting thread that finds its connection idle writes
//! the frame itself without blocking; only what does not fit in the socket
//! is left to the loop, which writes it as the socket drains. On the way
//! back, a thread waiting for its batch calls `progress`, which reads what
//! has arrived without blocking (response.rs). The loop reads for a frame
//! only once it has been in flight for [`ENGAGE_AFTER`] (long transfers, or
//! callers that do not wait), or at once for frames that move a lot, and
//! it alone detects dead peers and timeouts. Whoever reads holds the
//! connection's reader lock for a non-blocking step, and a frame leaves the
//! in-flight queue exactly once, so every request completes exactly once.

use crate::entries::{Entry, Inflight};
use crate::errors::{cancelled, connection_error, protocol, timed_out};
use crate::reactor::{self, Handler, Ready, Registration, Want};
use crate::response::{self, Reader};
use crate::sockio::{self, IoSlices};
use crate::wire::{self, Desc, Header, Kind, TAG_LEN};
use ferry_plugins_abi::sdk::auth::Direction;
use ferry_plugins_abi::sdk::{Completer, PluginError};
use ferry_plugins_abi::sys;
use ferry_plugins_abi::ErrorCode;
use std::collections::VecDeque;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Tunables, from the host's configuration.
#[derive(Clone, Debug)]
pub struct Settings {
    /// Connections per peer (tcp.connections).
    pub connections: usize,
    /// A frame is closed once it carries this many bytes (tcp.frame_bytes).
    pub frame_bytes: u64,
    /// Requests at least this large are split across connections
    /// (tcp.stripe_bytes).
    pub stripe_bytes: u64,
    pub timeout: Duration,
    pub connect_timeout: Duration,
    /// The target closes a connection idle this long; we drop ours after
    /// half of it and connect again when needed.
    pub idle_timeout: Duration,
    /// The cluster's token (`auth.token`), proven on every connection.
    pub token: Option<ferry_plugins_abi::sdk::auth::Token>,
    /// FERRY_INTEGRITY=payload: payloads are tagged too.
    pub payload_integrity: bool,
}

/// How long a frame may be in flight before the I/O loop starts reading
/// for it (a waiting caller usually completes it sooner).
pub const ENGAGE_AFTER: Duration = Duration::from_micros(200);
/// Frames up to this size are written by the submitting thread itself.
const DIRECT_SEND_MAX: usize = 64 * 1024;
/// Frames moving at least this much have the loop read for them at once.
const EAGER_BYTES: u64 = 64 * 1024;
/// A connection idle this long is checked (one poll) before it is reused:
/// the peer may have closed it.
const STALE_CHECK_AFTER: Duration = Duration::from_millis(500);
/// How often a submit retries a connection that was retired under it.
pub(crate) const RETIRED_RETRIES: usize = 4;

/// A frame on its way into the socket (the slices point into `_head`
/// and `_tail`, whose heap buffers do not move with the struct).
struct OutFrame {
    _head: Vec<u8>,
    _tail: Vec<u8>,
    io: IoSlices,
}

struct ConnState {
    next_seq: u64,
    /// This side's session keys: frames are tagged in the order they are
    /// queued, which is the order they go out.
    tx: Direction,
    inflight: VecDeque<Inflight>,
    queue: VecDeque<OutFrame>,
    /// A submitting thread is writing to the socket (the loop waits).
    sending: bool,
    /// When the frame at the head of the queue last moved.
    queue_moved: Instant,
    broken: Option<PluginError>,
    closing: bool,
    /// Closed because it sat idle (or its peer closed it while idle): a
    /// frame that finds it so goes to a new connection instead.
    retired: bool,
    /// When a response last completed (or the connection was made).
    last_progress: Instant,
}

pub(crate) struct Conn {
    stream: TcpStream,
    fd: RawFd,
    peer: String,
    state: Mutex<ConnState>,
    /// Held by whoever reads responses, for one non-blocking step.
    reader: Mutex<Reader>,
    /// Frames in flight, readable without the state lock.
    inflight_count: AtomicUsize,
    completer: Completer,
    settings: Arc<Settings>,
    reg: Registration,
}

impl Conn {
    /// A connection over `stream`, authenticated, with the session's keys
    /// (`keys`: to send, to check what comes back), driven by `reg`'s loop.
    pub(crate) fn start(
        stream: TcpStream,
        peer: String,
        keys: (Direction, Direction),
        completer: Completer,
        settings: Arc<Settings>,
        reg: Registration,
    ) -> Result<Arc<Conn>, PluginError> {
        stream.set_nonblocking(true).map_err(|e| {
            PluginError::new(ErrorCode::Io, format!("tcp: configuring a socket: {e}"))
        })?;
        let (tx, rx) = keys;
        let conn = Arc::new(Conn {
            fd: stream.as_raw_fd(),
            stream,
            peer,
            state: Mutex::new(ConnState {
                next_seq: 0,
                tx,
                inflight: VecDeque::new(),
                queue: VecDeque::new(),
                sending: false,
                queue_moved: Instant::now(),
                broken: None,
                closing: false,
                retired: false,
                last_progress: Instant::now(),
            }),
            reader: Mutex::new(Reader::new(rx)),
            inflight_count: AtomicUsize::new(0),
            completer,
            settings,
            reg,
        });
        conn.reg.start(conn.clone(), Want::default());
        Ok(conn)
    }

    /// Whether no frame is in flight on it.
    pub(crate) fn idle(&self) -> bool {
        self.inflight_count.load(Ordering::SeqCst) == 0
    }

    fn lock(&self) -> MutexGuard<'_, ConnState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub(crate) fn is_broken(&self) -> bool {
        let st = self.lock();
        st.broken.is_some() || st.closing
    }

    /// Fails everything in flight on this connection, once. The caller
    /// must not hold the reader lock.
    fn fail(&self, error: PluginError) {
        let inflight = {
            let mut st = self.lock();
            if st.broken.is_some() {
                return;
            }
            st.broken = Some(error.clone());
            st.queue.clear();
            self.inflight_count.store(0, Ordering::SeqCst);
            std::mem::take(&mut st.inflight)
        };
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        let reading = self
            .reader
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take_frame();
        for frame in inflight.into_iter().chain(reading) {
            for e in frame.entries {
                e.finish(&self.completer, Err(error.clone()));
            }
        }
        // The loop forgets it at its next look.
        self.reg.wake();
    }

    /// Fails a reading step's error: the frame being read, then the rest.
    fn fail_reading(&self, mut reader: MutexGuard<'_, Reader>, error: PluginError) {
        let frame = reader.take_frame();
        drop(reader);
        if let Some(frame) = frame {
            for e in frame.entries {
                e.finish(&self.completer, Err(error.clone()));
            }
        }
        self.fail(error);
    }

    /// Closes it: in-flight requests fail, and its loop forgets it.
    pub(crate) fn close(&self) {
        self.lock().closing = true;
        self.fail(cancelled(&self.peer));
        self.reg.remove();
    }

    /// Retires the connection when it has nothing in flight and either sat
    /// idle for half the idle timeout (the target closes it after the
    /// whole) or was closed by the peer meanwhile. Returns whether it did;
    /// the caller then connects again, transparently.
    pub(crate) fn retire_if_stale(&self) -> bool {
        if self.inflight_count.load(Ordering::SeqCst) != 0 {
            return false;
        }
        // Nobody may be reading a response: its bytes would look like input.
        let Ok(reader) = self.reader.try_lock() else {
            return false;
        };
        if reader.busy() {
            return false;
        }
        let mut st = self.lock();
        let idle_for = st.last_progress.elapsed();
        if idle_for < STALE_CHECK_AFTER
            || st.broken.is_some()
            || st.closing
            || st.sending
            || !st.inflight.is_empty()
            || !st.queue.is_empty()
        {
            return false;
        }
        if idle_for < self.settings.idle_timeout / 2
            && !ferry_plugins_abi::sdk::deadline::idle_connection_is_dead(&self.stream)
        {
            return false;
        }
        st.closing = true;
        st.retired = true;
        true
    }

    /// Queues a frame, writing it directly when the connection is idle.
    /// A retired connection hands the entries back with `true`: the caller
    /// sends them on a new connection.
    pub(crate) fn enqueue(
        self: &Arc<Self>,
        kind: Kind,
        descs: &[Desc],
        payload: &[(u64, u64)],
        entries: Vec<Entry>,
    ) -> Result<(), (PluginError, Vec<Entry>, bool)> {
        let payload_len: u64 = payload.iter().map(|(_, l)| *l).sum();
        let mut st = self.lock();
        if st.retired {
            return Err((cancelled(&self.peer), entries, true));
        }
        if let Some(e) = &st.broken {
            return Err((e.clone(), entries, false));
        }
        if st.closing {
            return Err((cancelled(&self.peer), entries, false));
        }
        let seq = st.next_seq;
        st.next_seq += 1;
        let tagged = self.settings.payload_integrity;
        let header = Header {
            kind,
            flags: if tagged { wire::FLAG_PAYLOAD_TAG } else { 0 },
            count: descs.len() as u32,
            seq,
            payload_len,
        };
        let mut head =
            Vec::with_capacity(wire::HEADER_LEN + descs.len() * wire::DESC_LEN + TAG_LEN);
        head.extend_from_slice(&header.encode());
        wire::encode_descs(descs, &mut head);
        let tag = st.tx.seal(&[&head]);
        head.extend_from_slice(&tag);
        let mut io = IoSlices::new();
        io.push(head.as_ptr(), head.len());
        // A request carries a payload tag only with a payload (a WRITE).
        let mut mac = (tagged && kind == Kind::Write).then(|| st.tx.payload(seq));
        for (addr, len) in payload {
            io.push(*addr as *const u8, *len as usize);
            if let Some(m) = &mut mac {
                // SAFETY: a registered local buffer the engine keeps valid
                // while its request is in flight (the same bytes are sent).
                m.update(unsafe { std::slice::from_raw_parts(*addr as *const u8, *len as usize) });
            }
        }
        let tail: Vec<u8> = mac.map(|m| m.finish().to_vec()).unwrap_or_default();
        if !tail.is_empty() {
            io.push(tail.as_ptr(), tail.len());
        }
        let mut frame = OutFrame {
            _head: head,
            _tail: tail,
            io,
        };
        let moved: u64 = descs.iter().map(|d| d.len).sum();
        let eager = moved >= EAGER_BYTES;
        st.inflight.push_back(Inflight {
            seq,
            kind,
            entries,
            enqueued: Instant::now(),
            eager,
        });
        self.inflight_count.fetch_add(1, Ordering::SeqCst);
        // Only small frames are written by the submitting thread: a large
        // one would keep the caller busy for as long as it takes.
        if st.sending || !st.queue.is_empty() || frame.io.len() > DIRECT_SEND_MAX {
            if st.queue.is_empty() {
                st.queue_moved = Instant::now();
            }
            st.queue.push_back(frame);
            drop(st);
            self.reg.wake();
            return Ok(());
        }
        st.sending = true;
        drop(st);
        // Fast path: as much as the socket takes now, without blocking.
        let mut failed = None;
        while !frame.io.is_done() {
            match sockio::send_some(self.fd, &mut frame.io, true) {
                Ok(0) => break,
                Ok(_) => {}
                Err(e) => {
                    failed = Some(e);
                    break;
                }
            }
        }
        let mut st = self.lock();
        st.sending = false;
        if let Some(e) = failed {
            drop(st);
            self.fail(connection_error(&self.peer, "sending to", &e.to_string()));
            return Ok(());
        }
        let queued = !frame.io.is_done();
        if queued {
            st.queue_moved = Instant::now();
            st.queue.push_front(frame);
        }
        drop(st);
        if queued || eager {
            self.reg.wake();
        } else {
            // The loop looks at it lazily, in case no caller waits for it.
            self.reg.poke();
        }
        Ok(())
    }

    /// Completes, without blocking, the responses that have arrived.
    /// Returns the number of requests completed.
    pub(crate) fn try_progress(&self) -> usize {
        if self.inflight_count.load(Ordering::SeqCst) == 0 {
            return 0;
        }
        let Ok(mut reader) = self.reader.try_lock() else {
            return 0;
        };
        match reader.advance(self) {
            Ok(n) => n,
            Err(e) => {
                self.fail_reading(reader, e);
                0
            }
        }
    }

    /// The loop writes what the submitting threads left in the queue.
    fn flush(&self) -> Result<(), PluginError> {
        let mut st = self.lock();
        if st.sending {
            return Ok(());
        }
        while let Some(front) = st.queue.front_mut() {
            let n = sockio::send_some(self.fd, &mut front.io, true)
                .map_err(|e| connection_error(&self.peer, "sending to", &e.to_string()))?;
            let done = front.io.is_done();
            if n > 0 {
                st.queue_moved = Instant::now();
            }
            if done {
                st.queue.pop_front();
            } else if n == 0 {
                break;
            }
        }
        if !st.queue.is_empty() && st.queue_moved.elapsed() > self.settings.timeout {
            return Err(timed_out(
                &self.peer,
                "did not take a frame",
                self.settings.timeout.as_millis(),
            ));
        }
        Ok(())
    }

    /// The loop's turn: write, read what is due, and say what to wait for.
    fn turn(&self) -> Result<Want, PluginError> {
        if self.is_broken() {
            return Ok(Want::close());
        }
        self.flush()?;
        let now = Instant::now();
        let mut want = Want::default();
        let mut at: Option<Instant> = None;
        let mut soon = |t: Instant| at = Some(at.map_or(t, |a: Instant| a.min(t)));
        // Read when the oldest frame is due, or a response is partly read.
        let engaged = {
            let st = self.lock();
            st.inflight
                .front()
                .map(|f| f.eager || now.duration_since(f.enqueued) >= ENGAGE_AFTER)
        };
        match self.reader.try_lock() {
            Ok(mut reader) => {
                if engaged == Some(true) || reader.busy() {
                    if let Err(e) = reader.advance(self) {
                        self.fail_reading(reader, e);
                        return Ok(Want::close());
                    }
                }
                if reader.busy() {
                    want.read = true;
                    let stall = reader.last_bytes + self.settings.timeout;
                    if now >= stall {
                        drop(reader);
                        return Err(timed_out(
                            &self.peer,
                            "stopped sending a response",
                            self.settings.timeout.as_millis(),
                        ));
                    }
                    soon(stall);
                }
            }
            // A caller is reading: look again shortly.
            Err(_) => soon(now + reactor::LAZY_POLL),
        }
        let st = self.lock();
        if st.sending {
            soon(now + reactor::LAZY_POLL);
        } else if !st.queue.is_empty() {
            want.write = true;
            soon(st.queue_moved + self.settings.timeout);
        }
        if let Some(front) = st.inflight.front() {
            if front.eager || now.duration_since(front.enqueued) >= ENGAGE_AFTER {
                want.read = true;
            } else {
                soon(front.enqueued + ENGAGE_AFTER);
            }
            let since = st.last_progress.max(front.enqueued);
            if now.duration_since(since) > self.settings.timeout {
                return Err(timed_out(
                    &self.peer,
                    "did not answer",
                    self.settings.timeout.as_millis(),
                ));
            }
            soon(since + self.settings.timeout);
        }
        want.at = at;
        Ok(want)
    }
}

impl Handler for Conn {
    fn fd(&self) -> RawFd {
        self.fd
    }

    fn ready(&self, _why: Ready) -> Want {
        match self.turn() {
            Ok(want) => want,
            Err(e) => {
                self.fail(e);
                Want::close()
            }
        }
    }
}

impl response::Conn for Conn {
    fn fd(&self) -> RawFd {
        self.fd
    }

    fn peer(&self) -> &str {
        &self.peer
    }

    fn oldest_count(&self) -> Option<usize> {
        if self.inflight_count.load(Ordering::SeqCst) == 0 {
            return None;
        }
        self.lock().inflight.front().map(|f| f.entries.len())
    }

    fn take_oldest(&self, header: &Header) -> Result<Inflight, PluginError> {
        let mut st = self.lock();
        let matches = st
            .inflight
            .front()
            .is_some_and(|f| f.seq == header.seq && f.entries.len() == header.count as usize);
        if !matches {
            return Err(protocol(
                &self.peer,
                &format!(
                    "response {} does not match the oldest request in flight",
                    header.seq
                ),
            ));
        }
        let frame = st
            .inflight
            .pop_front()
            .ok_or_else(|| protocol(&self.peer, "nothing in flight"))?;
        self.inflight_count.fetch_sub(1, Ordering::SeqCst);
        Ok(frame)
    }

    fn complete(&self, frame: Inflight, statuses: Vec<i32>) -> usize {
        let n = frame.entries.len();
        self.lock().last_progress = Instant::now();
        for (e, status) in frame.entries.into_iter().zip(statuses) {
            let result = if status == sys::FERRY_OK {
                Ok(())
            } else {
                Err(refused(&self.peer, &e, status))
            };
            e.finish(&self.completer, result);
        }
        n
    }

    fn payload_integrity(&self) -> bool {
        self.settings.payload_integrity
    }
}

fn refused(peer: &str, e: &Entry, status: i32) -> PluginError {
    let code = ErrorCode::from_raw(status).unwrap_or(ErrorCode::Protocol);
    let why = match code {
        ErrorCode::OutOfBounds => "not inside memory it registered".to_string(),
        other => other.to_string(),
    };
    PluginError::new(
        code,
        format!("tcp: {peer} refused [{:#x}, +{}): {why}", e.remote, e.len),
    )
}
