//! One authenticated control connection as a state machine, fed by the
//! I/O loop (`control_serve`) whenever its socket is ready: frames are
//! parsed as their bytes come (header, body, tag; any split), each body's
//! bytes reserved in the listener's budget as they arrive, and each tag
//! checked with the session's key exactly as `control::read_sealed` does
//! (the wire format is the same). One request at a time: nothing more is
//! read until its reply has left, as before.
//!
//! It never blocks and never touches the engine: it says what happened
//! ([`Progress`]), and the loop decides.

use crate::control::{decode_header, encode_frame, error_body, MsgType, HEADER_LEN};
use crate::control_budget::Held;
use crate::error::{Error, ErrorCode};
use ferry_plugins_abi::sdk::admission::{Refusal, Source};
use ferry_plugins_abi::sdk::auth::{Session, TAG_LEN};
use std::io::{self, Read, Write};
use std::time::{Duration, Instant};

/// Body bytes reserved (and read) at a time.
const BODY_CHUNK: usize = 64 << 10;

/// Why a connection must close, and what to tell its peer first.
#[derive(Debug)]
pub(crate) struct Failure {
    /// Counted and logged as a refusal (None: an ordinary end, logged at
    /// debug).
    pub refusal: Option<Refusal>,
    pub error: Error,
    /// Sent to the peer as an Error frame before closing.
    pub tell: bool,
}

impl Failure {
    fn quiet(code: ErrorCode, message: String) -> Failure {
        Failure {
            refusal: None,
            error: Error::new(code, message),
            tell: false,
        }
    }

    fn refused(kind: Refusal, code: ErrorCode, message: String) -> Failure {
        Failure {
            refusal: Some(kind),
            error: Error::new(code, message),
            tell: kind != Refusal::Integrity,
        }
    }
}

/// What reading brought.
#[derive(Debug)]
pub(crate) enum Progress {
    /// Nothing more to read now (the socket is drained, or a request is
    /// still being answered).
    Wait,
    /// The frame's next bytes do not fit the budget: read no more of this
    /// connection until bytes are given back (back-pressure).
    Stalled,
    /// A whole frame with a good tag; its body's bytes stay reserved in
    /// the `Held` until it is dropped.
    Frame(MsgType, Vec<u8>, Held),
    /// The peer closed the connection between frames.
    Gone,
    Closed(Failure),
}

/// What the clock says about a connection.
#[derive(Debug)]
pub(crate) enum Due {
    Nothing,
    /// Idle for the idle timeout: close it (an ordinary end).
    Idle,
    Closed(Failure),
}

pub(crate) struct Conn {
    /// The peer in log words ("10.0.0.2:41234").
    pub peer: String,
    pub host: Source,
    session: Session,
    io_timeout: Duration,
    idle_timeout: Duration,
    header: [u8; HEADER_LEN],
    header_got: usize,
    kind: MsgType,
    len: usize,
    body: Vec<u8>,
    /// The current body's reservation: `body.len()` bytes between reads.
    held: Held,
    tag: [u8; TAG_LEN],
    tag_got: usize,
    /// When the current frame's first byte arrived.
    frame_started: Option<Instant>,
    stalled: bool,
    /// A request of this connection is being answered.
    busy: bool,
    out: Vec<u8>,
    out_sent: usize,
    write_started: Option<Instant>,
    idle_since: Instant,
}

impl Conn {
    pub(crate) fn new(
        peer: String,
        session: Session,
        held: Held,
        io_timeout: Duration,
        idle_timeout: Duration,
        now: Instant,
    ) -> Conn {
        Conn {
            peer,
            host: held.host(),
            session,
            io_timeout,
            idle_timeout,
            header: [0; HEADER_LEN],
            header_got: 0,
            kind: MsgType::Error,
            len: 0,
            body: Vec::new(),
            held,
            tag: [0; TAG_LEN],
            tag_got: 0,
            frame_started: None,
            stalled: false,
            busy: false,
            out: Vec::new(),
            out_sent: 0,
            write_started: None,
            idle_since: now,
        }
    }

    /// Whether the loop should wait for its socket to be readable.
    pub(crate) fn wants_read(&self) -> bool {
        !self.busy && !self.stalled && self.out.is_empty()
    }

    /// Whether the loop should wait for its socket to be writable.
    pub(crate) fn wants_write(&self) -> bool {
        self.out_sent < self.out.len()
    }

    /// Whether a request of it is being answered.
    pub(crate) fn busy(&self) -> bool {
        self.busy
    }

    /// Ends the request being answered without a reply (the connection is
    /// about to close).
    pub(crate) fn end_request(&mut self) {
        self.busy = false;
    }

    /// Whether it waits for the budget.
    pub(crate) fn stalled(&self) -> bool {
        self.stalled
    }

    /// How long it has been idle: no frame started, no request being
    /// answered, nothing to send. None while it is doing anything.
    pub(crate) fn idle_for(&self, now: Instant) -> Option<Duration> {
        (!self.busy && self.frame_started.is_none() && self.out.is_empty())
            .then(|| now.saturating_duration_since(self.idle_since))
    }

    /// Reads what the socket has, up to one whole frame.
    pub(crate) fn read_from(&mut self, src: &mut impl Read, now: Instant) -> Progress {
        if self.busy || !self.out.is_empty() {
            return Progress::Wait;
        }
        loop {
            let in_header = self.header_got < HEADER_LEN;
            let in_tag = !in_header && self.body.len() == self.len;
            let got = if in_header {
                src.read(&mut self.header[self.header_got..])
            } else if !in_tag {
                match self.read_body(src) {
                    Some(p) => return p,
                    None => continue,
                }
            } else if self.tag_got < TAG_LEN {
                src.read(&mut self.tag[self.tag_got..])
            } else {
                return self.finish_frame();
            };
            let n = match got {
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Progress::Wait,
                Err(e) => {
                    return Progress::Closed(Failure::quiet(
                        ErrorCode::Connection,
                        format!("reading from {}: {e}", self.peer),
                    ))
                }
            };
            if n == 0 {
                if self.frame_started.is_none() {
                    return Progress::Gone;
                }
                return Progress::Closed(Failure::quiet(
                    ErrorCode::Connection,
                    format!(
                        "reading from {}: the connection closed in the middle of a frame",
                        self.peer
                    ),
                ));
            }
            if self.frame_started.is_none() {
                self.frame_started = Some(now);
            }
            if in_header {
                self.header_got += n;
                if self.header_got == HEADER_LEN {
                    match decode_header(&self.header) {
                        Ok((kind, len)) => (self.kind, self.len) = (kind, len),
                        Err(e) => {
                            return Progress::Closed(Failure::refused(
                                Refusal::Protocol,
                                e.code,
                                format!("{}: {}", self.peer, e.message),
                            ))
                        }
                    }
                }
            } else if in_tag {
                self.tag_got += n;
            }
        }
    }

    /// Reads body bytes as far as the budget and the socket allow: None
    /// when all that was reserved came (read on), else what to report.
    fn read_body(&mut self, src: &mut impl Read) -> Option<Progress> {
        let start = self.body.len();
        let want = (self.len - start).min(BODY_CHUNK);
        if self.held.grow(want) == 0 {
            self.stalled = true;
            return Some(Progress::Stalled);
        }
        self.stalled = false;
        let end = self.held.bytes();
        if self.body.capacity() < end {
            // Doubling, never past the frame: the memory stays within twice
            // what is reserved, in few copies.
            let cap = (self.body.capacity() * 2).clamp(end, self.len);
            self.body.reserve_exact(cap - start);
        }
        let room = end - start;
        let r = (&mut *src).take(room as u64).read_to_end(&mut self.body);
        // Only what came stays reserved.
        self.held.shrink_to(self.body.len());
        let n = self.body.len() - start;
        match r {
            Ok(_) if n == room => None,
            Ok(_) => Some(Progress::Closed(Failure::quiet(
                ErrorCode::Connection,
                format!(
                    "reading from {}: the connection closed in the middle of a frame",
                    self.peer
                ),
            ))),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => Some(Progress::Wait),
            Err(e) => Some(Progress::Closed(Failure::quiet(
                ErrorCode::Connection,
                format!("reading from {}: {e}", self.peer),
            ))),
        }
    }

    fn finish_frame(&mut self) -> Progress {
        let checked = self
            .session
            .recv
            .open(&[&self.header, &self.body], &self.tag);
        if let Err(e) = checked {
            return Progress::Closed(Failure::refused(
                Refusal::Integrity,
                ErrorCode::Protocol,
                format!("control connection from {}: {e}", self.peer),
            ));
        }
        let body = std::mem::take(&mut self.body);
        let held = self.held.split_off();
        self.header_got = 0;
        self.tag_got = 0;
        self.len = 0;
        self.frame_started = None;
        self.busy = true;
        Progress::Frame(self.kind, body, held)
    }

    /// Queues a reply (sealed with the session's key) and ends the request.
    pub(crate) fn reply(&mut self, kind: MsgType, body: &[u8], now: Instant) {
        self.busy = false;
        let mut frame = encode_frame(kind, body);
        let tag = self.session.send.seal(&[&frame]);
        frame.extend_from_slice(&tag);
        if self.out.is_empty() {
            self.write_started = Some(now);
        }
        self.out.extend_from_slice(&frame);
    }

    /// Queues an Error frame.
    pub(crate) fn reply_error(&mut self, code: ErrorCode, message: &str, now: Instant) {
        self.reply(MsgType::Error, &error_body(code, message), now);
    }

    /// Writes what is queued; Ok(true) once all of it has left.
    pub(crate) fn write_to(&mut self, dst: &mut impl Write, now: Instant) -> Result<bool, Failure> {
        while self.out_sent < self.out.len() {
            match dst.write(&self.out[self.out_sent..]) {
                Ok(0) => {
                    return Err(Failure::quiet(
                        ErrorCode::Connection,
                        format!("writing to {}: the connection closed", self.peer),
                    ))
                }
                Ok(n) => self.out_sent += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
                Err(e) => {
                    return Err(Failure::quiet(
                        ErrorCode::Connection,
                        format!("writing to {}: {e}", self.peer),
                    ))
                }
            }
        }
        self.out.clear();
        self.out_sent = 0;
        self.write_started = None;
        self.idle_since = now;
        Ok(true)
    }

    /// The next time [`Conn::check`] has something to say.
    pub(crate) fn next_due(&self) -> Option<Instant> {
        if let Some(t) = self.write_started {
            return Some(t + self.io_timeout);
        }
        if let Some(t) = self.frame_started {
            return Some(t + self.io_timeout);
        }
        (!self.busy).then_some(self.idle_since + self.idle_timeout)
    }

    /// Deadlines: a frame must arrive whole, and a reply leave whole,
    /// within the I/O timeout; a connection idle for the idle timeout goes.
    pub(crate) fn check(&self, now: Instant) -> Due {
        let ms = self.io_timeout.as_millis();
        if self
            .write_started
            .is_some_and(|t| now >= t + self.io_timeout)
        {
            return Due::Closed(Failure::quiet(
                ErrorCode::Timeout,
                format!("{} did not read its reply within {ms} ms", self.peer),
            ));
        }
        if self
            .frame_started
            .is_some_and(|t| now >= t + self.io_timeout)
        {
            let f = if self.stalled {
                Failure::refused(
                    Refusal::Busy,
                    ErrorCode::Busy,
                    format!(
                        "{}: its control frame of {} bytes could not be received within {ms} \
                         ms: the frames being received hold this listener's budget; try again",
                        self.peer, self.len
                    ),
                )
            } else {
                Failure::refused(
                    Refusal::Protocol,
                    ErrorCode::Protocol,
                    format!(
                        "{}: did not send its whole control frame within {ms} ms ({} of {} \
                         body bytes came)",
                        self.peer,
                        self.body.len(),
                        self.len
                    ),
                )
            };
            return Due::Closed(f);
        }
        if self.idle_for(now).is_some_and(|d| d >= self.idle_timeout) {
            return Due::Idle;
        }
        Due::Nothing
    }
}

#[cfg(test)]
#[path = "control_conn_tests.rs"]
mod tests;
