//! The initiator side's connections: a peer (peer.rs) is a set of them, and
//! packs its requests into frames (many small requests per frame, large
//! ones split across connections); here each frame is sent and its
//! response completes its requests.
//!
//! Each connection has a sender thread and a receiver thread, but the
//! latency path avoids both: a thread wake-up costs tens of microseconds on
//! a VM, more than the whole round trip. A submitting thread that finds its
//! connection idle writes the frame itself without blocking; only what does
//! not fit in the socket goes to the sender thread. On the way back, a
//! thread waiting for its batch calls `progress`, which reads any response
//! that has fully arrived, without blocking. The receiver thread steps in
//! only when a frame has been in flight for [`ENGAGE_AFTER`] (long transfers,
//! or callers that do not wait), and it alone detects dead peers and
//! timeouts. Whoever reads a response holds the connection's reader lock for
//! the whole frame, and a frame leaves the in-flight queue exactly once, so
//! every request is completed exactly once.

use crate::sockio::{self, Deadline, IoSlices};
use crate::wire::{self, Desc, Header, Kind, TAG_LEN};
use ferry_plugins_abi::sdk::auth::Direction;
use ferry_plugins_abi::sdk::{Completer, PluginError};
use ferry_plugins_abi::sys;
use ferry_plugins_abi::ErrorCode;
use std::collections::VecDeque;
use std::net::TcpStream;
use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
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

/// Completion of one request split into parts: the last part reports.
pub(crate) struct Split {
    pub(crate) token: u64,
    pub(crate) remaining: AtomicUsize,
    pub(crate) error: Mutex<Option<PluginError>>,
}

pub(crate) enum Done {
    Token(u64),
    Part(Arc<Split>),
}

pub(crate) struct Entry {
    pub(crate) local: u64,
    pub(crate) remote: u64,
    pub(crate) len: u64,
    pub(crate) done: Done,
}

impl Entry {
    pub(crate) fn finish(self, completer: &Completer, result: Result<(), PluginError>) {
        match self.done {
            Done::Token(t) => completer.complete(t, result.as_ref().map(|_| ())),
            Done::Part(split) => {
                if let Err(e) = result {
                    let mut slot = split.error.lock().unwrap_or_else(|p| p.into_inner());
                    slot.get_or_insert(e);
                }
                if split.remaining.fetch_sub(1, Ordering::SeqCst) == 1 {
                    let err = split.error.lock().unwrap_or_else(|p| p.into_inner()).take();
                    completer.complete(split.token, err.as_ref().map_or(Ok(()), Err));
                }
            }
        }
    }
}

struct Inflight {
    seq: u64,
    kind: Kind,
    entries: Vec<Entry>,
    enqueued: Instant,
}

/// How long a frame may be in flight before the receiver thread starts
/// reading for it (a waiting caller usually completes it sooner).
pub const ENGAGE_AFTER: Duration = Duration::from_micros(200);
/// Frames up to this size are written by the submitting thread itself.
const DIRECT_SEND_MAX: usize = 64 * 1024;
/// Frames moving at least this much wake the receiver thread at once.
const RECEIVER_READY_BYTES: u64 = 64 * 1024;
/// How often an idle receiver looks for new work while recently active.
const IDLE_POLL: Duration = Duration::from_millis(1);
/// After this long without traffic the receiver sleeps until woken.
const DEEP_SLEEP_AFTER: Duration = Duration::from_secs(1);
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
    sending: bool,
    broken: Option<PluginError>,
    closing: bool,
    /// Closed because it sat idle (or its peer closed it while idle): a
    /// frame that finds it so goes to a new connection instead.
    retired: bool,
    /// When a response last completed (or the connection was made).
    last_progress: Instant,
    /// The receiver sleeps until notified (set after a long idle spell).
    deep_sleep: bool,
    /// A waiting caller already woke the receiver for the oldest frame.
    receiver_nudged: bool,
}

impl ConnState {
    fn new(tx: Direction) -> Self {
        ConnState {
            next_seq: 0,
            tx,
            inflight: VecDeque::new(),
            queue: VecDeque::new(),
            sending: false,
            broken: None,
            closing: false,
            retired: false,
            last_progress: Instant::now(),
            deep_sleep: false,
            receiver_nudged: false,
        }
    }
}

pub(crate) struct Conn {
    stream: TcpStream,
    fd: RawFd,
    peer: String,
    state: Mutex<ConnState>,
    wake_sender: Condvar,
    wake_receiver: Condvar,
    /// Held by whoever reads a response frame, for the whole frame; it
    /// holds the keys that check responses, in order.
    reader: Mutex<Direction>,
    /// Frames in flight, readable without the state lock.
    inflight_count: AtomicUsize,
    threads: Mutex<Vec<JoinHandle<()>>>,
    completer: Completer,
    settings: Arc<Settings>,
}

impl Conn {
    /// A connection over `stream`, authenticated, with the session's keys
    /// (`keys`: to send, to check what comes back), and its sender and
    /// receiver threads running.
    pub(crate) fn start(
        stream: TcpStream,
        peer: String,
        keys: (Direction, Direction),
        completer: Completer,
        settings: Arc<Settings>,
    ) -> Result<Arc<Conn>, PluginError> {
        let (tx, rx) = keys;
        let conn = Arc::new(Conn {
            fd: stream.as_raw_fd(),
            stream,
            peer,
            state: Mutex::new(ConnState::new(tx)),
            wake_sender: Condvar::new(),
            wake_receiver: Condvar::new(),
            reader: Mutex::new(rx),
            inflight_count: AtomicUsize::new(0),
            threads: Mutex::new(Vec::new()),
            completer,
            settings,
        });
        let (a, b) = (conn.clone(), conn.clone());
        let sender = std::thread::Builder::new()
            .name("ferry-tcp-send".into())
            .spawn(move || a.clone().guarded(|| a.sender_loop()));
        let receiver = std::thread::Builder::new()
            .name("ferry-tcp-recv".into())
            .spawn(move || b.clone().guarded(|| b.receiver_loop()));
        match (sender, receiver) {
            (Ok(s), Ok(r)) => conn
                .threads
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .extend([s, r]),
            (s, r) => {
                conn.lock().closing = true;
                let _ = conn.stream.shutdown(std::net::Shutdown::Both);
                for t in [s, r].into_iter().flatten() {
                    let _ = t.join();
                }
                return Err(PluginError::new(
                    ErrorCode::NoMemory,
                    "tcp: cannot start connection threads",
                ));
            }
        }
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

    /// Fails everything in flight on this connection, once.
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
        self.wake_sender.notify_all();
        self.wake_receiver.notify_all();
        for frame in inflight {
            for e in frame.entries {
                e.finish(&self.completer, Err(error.clone()));
            }
        }
    }

    /// Runs a connection thread's loop; should it panic (a bug), the
    /// connection fails everything in flight instead of leaving it hanging.
    fn guarded(self: Arc<Self>, body: impl FnOnce()) {
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(body)).is_err() {
            self.fail(PluginError::new(
                ErrorCode::Internal,
                format!(
                    "tcp: a connection thread for {} failed unexpectedly (a bug; please \
                     report it)",
                    self.peer
                ),
            ));
        }
    }

    /// Stops both threads and waits for them; in-flight requests fail.
    pub(crate) fn close(&self) {
        self.lock().closing = true;
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        self.wake_sender.notify_all();
        self.wake_receiver.notify_all();
        let threads = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|p| p.into_inner()));
        for t in threads {
            let _ = t.join();
        }
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
        let Ok(_reader) = self.reader.try_lock() else {
            return false;
        };
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
        st.inflight.push_back(Inflight {
            seq,
            kind,
            entries,
            enqueued: Instant::now(),
        });
        self.inflight_count.fetch_add(1, Ordering::SeqCst);
        // A frame that will take a while to come back gets the receiver
        // thread ready; small ones are left to the waiting caller.
        let moved: u64 = descs.iter().map(|d| d.len).sum();
        if st.deep_sleep || moved >= RECEIVER_READY_BYTES {
            st.deep_sleep = false;
            self.wake_receiver.notify_one();
        }
        // Only small frames are written by the submitting thread: a large
        // one would keep the caller busy for as long as it takes.
        if st.sending || !st.queue.is_empty() || frame.io.len() > DIRECT_SEND_MAX {
            st.queue.push_back(frame);
            drop(st);
            self.wake_sender.notify_one();
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
            self.fail(connection_error(&self.peer, "sending", &e.to_string()));
            return Ok(());
        }
        if !frame.io.is_done() {
            st.queue.push_front(frame);
        }
        let wake = !st.queue.is_empty();
        drop(st);
        if wake {
            self.wake_sender.notify_one();
        }
        Ok(())
    }

    fn sender_loop(self: Arc<Self>) {
        loop {
            let mut frame = {
                let mut st = self.lock();
                loop {
                    if st.broken.is_some() || st.closing {
                        return;
                    }
                    if !st.sending && !st.queue.is_empty() {
                        break;
                    }
                    st = self
                        .wake_sender
                        .wait_timeout(st, sockio::TICK)
                        .map(|(g, _)| g)
                        .unwrap_or_else(|p| p.into_inner().0);
                }
                st.sending = true;
                match st.queue.pop_front() {
                    Some(f) => f,
                    None => {
                        st.sending = false;
                        continue;
                    }
                }
            };
            let deadline = Instant::now() + self.settings.timeout;
            let result = sockio::send_all(self.fd, &mut frame.io, deadline, || !self.is_broken());
            self.lock().sending = false;
            if let Err(e) = result {
                let err = if e.is_timeout() {
                    PluginError::new(
                        ErrorCode::Timeout,
                        format!(
                            "tcp: {} did not take a frame within {} ms; connection dropped",
                            self.peer,
                            self.settings.timeout.as_millis()
                        ),
                    )
                } else {
                    connection_error(&self.peer, "sending", &e.describe())
                };
                self.fail(err);
                return;
            }
        }
    }

    /// Reads, checks and completes one response frame whose header is in
    /// `hb`. The caller holds the reader lock.
    /// `statuses_read` says the statuses are already in `statuses_buf`.
    fn process_response(
        &self,
        hb: &[u8; wire::HEADER_LEN],
        statuses_buf: &mut Vec<u8>,
        statuses_read: bool,
        rx: &mut Direction,
    ) -> Result<usize, PluginError> {
        let (header, frame) = self.accept_response(hb)?;
        match self.finish_response(&header, &frame, statuses_buf, statuses_read, rx) {
            Ok(statuses) => {
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
                Ok(n)
            }
            Err(err) => {
                for e in frame.entries {
                    e.finish(&self.completer, Err(err.clone()));
                }
                Err(err)
            }
        }
    }

    /// Completes, without blocking, the responses that have fully arrived.
    /// Returns the number of requests completed.
    pub(crate) fn try_progress(&self, statuses_buf: &mut Vec<u8>) -> usize {
        if self.inflight_count.load(Ordering::SeqCst) == 0 {
            return 0;
        }
        self.nudge_receiver_if_slow();
        let Ok(mut rx) = self.reader.try_lock() else {
            return 0;
        };
        let mut done = 0;
        while self.inflight_count.load(Ordering::SeqCst) != 0 {
            let mut hb = [0u8; wire::HEADER_LEN];
            // SAFETY: hb is writable for its length; MSG_PEEK leaves the
            // bytes in the socket.
            let n = unsafe {
                libc::recv(
                    self.fd,
                    hb.as_mut_ptr().cast(),
                    hb.len(),
                    libc::MSG_PEEK | libc::MSG_DONTWAIT,
                )
            };
            if n != wire::HEADER_LEN as isize {
                break;
            }
            // A malformed header is left for the receiver thread to report.
            let Ok(header) = Header::decode(&hb) else {
                break;
            };
            let frame_len = wire::HEADER_LEN as u64 + header.response_rest();
            let mut avail: libc::c_int = 0;
            // SAFETY: FIONREAD writes one int.
            if unsafe { libc::ioctl(self.fd, libc::FIONREAD, &mut avail) } != 0 {
                break;
            }
            if (avail.max(0) as u64) < frame_len {
                // Larger than the socket holds: the receiver thread, which
                // may block, takes it.
                self.wake_receiver.notify_one();
                break;
            }
            // The whole frame is in the socket: none of these reads block.
            // Header, statuses and tag come in one call (the tag is kept
            // after the statuses in the buffer).
            let status_len = header.count as usize * wire::STATUS_LEN;
            statuses_buf.clear();
            statuses_buf.resize(status_len + TAG_LEN, 0);
            let mut s = IoSlices::new();
            s.push(hb.as_mut_ptr(), hb.len());
            s.push(statuses_buf.as_mut_ptr(), status_len + TAG_LEN);
            if sockio::recv_some(self.fd, &mut s, true).ok()
                != Some(wire::HEADER_LEN + status_len + TAG_LEN)
            {
                // Not what FIONREAD promised: let the receiver thread sort it out.
                self.fail(protocol(&self.peer, "short read of a response"));
                break;
            }
            match self.process_response(&hb, statuses_buf, true, &mut rx) {
                Ok(n) => done += n,
                Err(e) => {
                    self.fail(e);
                    break;
                }
            }
        }
        done
    }

    /// A caller waiting for a response that is slow to come will soon stop
    /// polling and sleep; make sure the receiver thread is awake to take
    /// over by ENGAGE_AFTER (it may be in a long idle sleep), once per frame.
    fn nudge_receiver_if_slow(&self) {
        let Ok(mut st) = self.state.try_lock() else {
            return;
        };
        let slow = st
            .inflight
            .front()
            .is_some_and(|f| f.enqueued.elapsed() >= ENGAGE_AFTER / 2);
        if slow && !st.receiver_nudged {
            st.receiver_nudged = true;
            self.wake_receiver.notify_one();
        }
    }

    /// Waits until a frame has been in flight for ENGAGE_AFTER; false when
    /// the connection is going away.
    fn wait_for_work(&self) -> Result<(), PluginError> {
        let mut st = self.lock();
        loop {
            if st.closing {
                return Err(cancelled(&self.peer));
            }
            if let Some(e) = &st.broken {
                return Err(e.clone());
            }
            let pause = match st.inflight.front() {
                Some(f) => match ENGAGE_AFTER.checked_sub(f.enqueued.elapsed()) {
                    None | Some(Duration::ZERO) => {
                        st.receiver_nudged = false;
                        return Ok(());
                    }
                    Some(rest) => rest,
                },
                None if st.last_progress.elapsed() > DEEP_SLEEP_AFTER => {
                    st.deep_sleep = true;
                    sockio::TICK
                }
                None => IDLE_POLL,
            };
            st = self
                .wake_receiver
                .wait_timeout(st, pause)
                .map(|(g, _)| g)
                .unwrap_or_else(|p| p.into_inner().0);
            st.deep_sleep = false;
        }
    }

    /// Fails the connection when something has been in flight for the
    /// timeout without a response.
    fn check_timeout(&self) -> Result<(), PluginError> {
        let st = self.lock();
        let Some(front) = st.inflight.front() else {
            return Ok(());
        };
        let since = st.last_progress.max(front.enqueued);
        if since.elapsed() > self.settings.timeout {
            return Err(PluginError::new(
                ErrorCode::Timeout,
                format!(
                    "tcp: {} did not answer for {} ms",
                    self.peer,
                    self.settings.timeout.as_millis()
                ),
            ));
        }
        Ok(())
    }

    fn receiver_loop(self: Arc<Self>) {
        let mut statuses_buf: Vec<u8> = Vec::new();
        loop {
            if let Err(e) = self.wait_for_work() {
                self.fail(e);
                return;
            }
            // Engaged: wait for bytes (a tick at a time), then read one
            // whole frame unless a waiting caller already took it.
            let mut pfd = libc::pollfd {
                fd: self.fd,
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd for the duration of the call.
            let ready = unsafe { libc::poll(&mut pfd, 1, sockio::TICK.as_millis() as i32) };
            if ready <= 0 {
                if let Err(e) = self.check_timeout() {
                    self.fail(e);
                    return;
                }
                continue;
            }
            let mut reader = self.reader.lock().unwrap_or_else(|p| p.into_inner());
            let mut hb = [0u8; wire::HEADER_LEN];
            let mut s = IoSlices::new();
            s.push(hb.as_mut_ptr(), hb.len());
            match sockio::recv_some(self.fd, &mut s, true) {
                Ok(0) => continue,
                Ok(_) => {}
                Err(e) => {
                    drop(reader);
                    self.fail(connection_error(&self.peer, "receiving", &e.to_string()));
                    return;
                }
            }
            let deadline = Instant::now() + self.settings.timeout;
            let rest = sockio::recv_all(self.fd, &mut s, Deadline::At(deadline), || {
                !self.lock().closing
            });
            let result = match rest {
                Ok(()) => self
                    .process_response(&hb, &mut statuses_buf, false, &mut reader)
                    .map(|_| ()),
                Err(e) => Err(connection_error(&self.peer, "receiving", &e.describe())),
            };
            drop(reader);
            if let Err(e) = result {
                self.fail(e);
                return;
            }
        }
    }

    /// Checks a response header against the oldest frame in flight and
    /// takes that frame: from here on this thread owns its completion.
    fn accept_response(
        &self,
        hb: &[u8; wire::HEADER_LEN],
    ) -> Result<(Header, Inflight), PluginError> {
        let header = Header::decode(hb).map_err(|e| protocol(&self.peer, &e.0))?;
        if header.kind != Kind::Response {
            return Err(protocol(&self.peer, "expected a response frame"));
        }
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
        Ok((header, frame))
    }

    /// Reads statuses and, for reads, the payload straight into local memory.
    fn finish_response(
        &self,
        header: &Header,
        frame: &Inflight,
        buf: &mut Vec<u8>,
        statuses_read: bool,
        rx: &mut Direction,
    ) -> Result<Vec<i32>, PluginError> {
        let deadline = Instant::now() + self.settings.timeout;
        let keep_going = || !self.lock().closing;
        let status_len = frame.entries.len() * wire::STATUS_LEN;
        if !statuses_read {
            buf.clear();
            buf.resize(status_len + TAG_LEN, 0);
            let mut s = IoSlices::new();
            s.push(buf.as_mut_ptr(), buf.len());
            sockio::recv_all(self.fd, &mut s, Deadline::At(deadline), keep_going)
                .map_err(|e| connection_error(&self.peer, "receiving statuses", &e.describe()))?;
        }
        // Nothing in the response is believed before its tag passed.
        let (status_bytes, tag) = buf.split_at(status_len);
        rx.open(&[&header.encode(), status_bytes], tag)
            .map_err(|e| integrity(&self.peer, &e))?;
        if header.payload_tagged() != self.settings.payload_integrity {
            return Err(protocol(
                &self.peer,
                "the response's payload tagging differs from the request's",
            ));
        }
        let statuses = wire::decode_statuses(status_bytes);
        let expected: u64 = match frame.kind {
            Kind::Read => frame
                .entries
                .iter()
                .zip(&statuses)
                .filter(|(_, s)| **s == sys::FERRY_OK)
                .map(|(e, _)| e.len)
                .sum(),
            _ => 0,
        };
        if header.payload_len != expected {
            return Err(protocol(
                &self.peer,
                &format!(
                    "response carries {} payload bytes, {expected} expected",
                    header.payload_len
                ),
            ));
        }
        if expected > 0 {
            let mut s = IoSlices::new();
            for (e, st) in frame.entries.iter().zip(&statuses) {
                if *st == sys::FERRY_OK {
                    s.push(e.local as *const u8, e.len as usize);
                }
            }
            let deadline = Instant::now() + self.settings.timeout;
            sockio::recv_all(self.fd, &mut s, Deadline::At(deadline), keep_going)
                .map_err(|e| connection_error(&self.peer, "receiving data", &e.describe()))?;
        }
        if header.payload_tagged() {
            let mut tag = [0u8; TAG_LEN];
            let mut s = IoSlices::new();
            s.push(tag.as_mut_ptr(), TAG_LEN);
            sockio::recv_all(self.fd, &mut s, Deadline::At(deadline), keep_going)
                .map_err(|e| connection_error(&self.peer, "receiving a tag", &e.describe()))?;
            let mut mac = rx.payload(header.seq);
            for (e, st) in frame.entries.iter().zip(&statuses) {
                if *st == sys::FERRY_OK && frame.kind == Kind::Read {
                    // SAFETY: a registered local buffer the engine keeps
                    // valid while its request is in flight; its bytes were
                    // just received.
                    mac.update(unsafe {
                        std::slice::from_raw_parts(e.local as *const u8, e.len as usize)
                    });
                }
            }
            mac.verify(&tag).map_err(|e| integrity(&self.peer, &e))?;
        }
        Ok(statuses)
    }
}

fn cancelled(peer: &str) -> PluginError {
    PluginError::new(
        ErrorCode::Cancelled,
        format!("tcp: the connection to {peer} was closed locally"),
    )
}

pub(crate) fn connection_error(peer: &str, what: &str, detail: &str) -> PluginError {
    PluginError::new(
        ErrorCode::Connection,
        format!("tcp: {what} {peer}: {detail} (the peer died or dropped the connection?)"),
    )
}

pub(crate) fn integrity(
    peer: &str,
    e: &ferry_plugins_abi::sdk::auth::IntegrityError,
) -> PluginError {
    PluginError::new(ErrorCode::Protocol, format!("tcp: {peer}: {e}"))
}

pub(crate) fn protocol(peer: &str, detail: &str) -> PluginError {
    PluginError::new(
        ErrorCode::Protocol,
        format!("tcp: {peer} broke the protocol: {detail}"),
    )
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
