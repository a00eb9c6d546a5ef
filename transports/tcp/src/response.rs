//! Reading responses on the initiator side, a step at a time: whoever holds
//! a connection's reader (a caller waiting for its batch, or the I/O loop)
//! moves the response in progress as far as the socket allows without
//! blocking, and the next holder picks up where it stopped.
//!
//! A response is its header, its statuses and its tag (read together in
//! one call, sized from the oldest frame in flight), then for a READ the
//! payload straight into local memory, then the payload's tag when asked
//! for. Nothing in it is believed before its tag passed.

use crate::entries::Inflight;
use crate::errors::{connection_error, integrity, protocol};
use crate::sockio::{self, IoSlices};
use crate::wire::{self, Header, Kind, TAG_LEN};
use ferry_plugins_abi::sdk::auth::Direction;
use ferry_plugins_abi::sdk::PluginError;
use ferry_plugins_abi::sys;
use std::os::fd::RawFd;
use std::time::Instant;

/// What the reader needs of its connection.
pub(crate) trait Conn {
    fn fd(&self) -> RawFd;
    fn peer(&self) -> &str;
    /// Requests in the oldest frame in flight, if any.
    fn oldest_count(&self) -> Option<usize>;
    /// Takes the oldest frame in flight if `header` answers it.
    fn take_oldest(&self, header: &Header) -> Result<Inflight, PluginError>;
    /// Completes a frame's requests by their statuses; how many.
    fn complete(&self, frame: Inflight, statuses: Vec<i32>) -> usize;
    /// Payloads are tagged (FERRY_INTEGRITY=payload).
    fn payload_integrity(&self) -> bool;
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Stage {
    Idle,
    Head,
    Payload,
    PayloadTag,
}

/// A connection's reading side (behind its reader lock).
pub(crate) struct Reader {
    rx: Direction,
    stage: Stage,
    hb: [u8; wire::HEADER_LEN],
    /// Statuses, then the tag.
    buf: Vec<u8>,
    ptag: [u8; TAG_LEN],
    io: IoSlices,
    /// The frame whose response is being read (taken from the in-flight
    /// queue once its header checked out), with its statuses.
    frame: Option<(Header, Inflight, Vec<i32>)>,
    /// When a byte last arrived (a stalled response times out from here).
    pub(crate) last_bytes: Instant,
}

impl Reader {
    pub(crate) fn new(rx: Direction) -> Reader {
        Reader {
            rx,
            stage: Stage::Idle,
            hb: [0; wire::HEADER_LEN],
            buf: Vec::new(),
            ptag: [0; TAG_LEN],
            io: IoSlices::new(),
            frame: None,
            last_bytes: Instant::now(),
        }
    }

    /// A response is partly read.
    pub(crate) fn busy(&self) -> bool {
        self.stage != Stage::Idle
    }

    /// The frame being read, to fail it with its connection.
    pub(crate) fn take_frame(&mut self) -> Option<Inflight> {
        self.stage = Stage::Idle;
        self.io = IoSlices::new();
        self.frame.take().map(|(_, f, _)| f)
    }

    /// Reads and completes what has arrived; the number of requests
    /// completed. On an error the caller fails the connection (and the
    /// frame being read: `take_frame`).
    pub(crate) fn advance(&mut self, conn: &dyn Conn) -> Result<usize, PluginError> {
        let fd = conn.fd();
        let mut done = 0;
        loop {
            match self.stage {
                Stage::Idle => {
                    let Some(count) = conn.oldest_count() else {
                        return Ok(done);
                    };
                    self.buf.clear();
                    self.buf.resize(count * wire::STATUS_LEN + TAG_LEN, 0);
                    self.io = IoSlices::new();
                    self.io.push(self.hb.as_mut_ptr(), self.hb.len());
                    self.io.push(self.buf.as_mut_ptr(), self.buf.len());
                    self.stage = Stage::Head;
                }
                Stage::Head => {
                    if !self.receive(fd, conn)? {
                        return Ok(done);
                    }
                    self.check_head(conn)?;
                }
                Stage::Payload => {
                    if !self.receive(fd, conn)? {
                        return Ok(done);
                    }
                    self.after_payload();
                }
                Stage::PayloadTag => {
                    if !self.receive(fd, conn)? {
                        return Ok(done);
                    }
                    self.check_payload_tag(conn)?;
                    self.stage = Stage::Idle;
                }
            }
            if self.stage == Stage::Idle {
                if let Some((_, frame, statuses)) = self.frame.take() {
                    done += conn.complete(frame, statuses);
                }
            }
        }
    }

    /// Receives into the current slices; true once they are full.
    fn receive(&mut self, fd: i32, conn: &dyn Conn) -> Result<bool, PluginError> {
        let n = sockio::recv_some(fd, &mut self.io, true)
            .map_err(|e| connection_error(conn.peer(), "receiving from", &e.to_string()))?;
        if n > 0 {
            self.last_bytes = Instant::now();
        }
        Ok(self.io.is_done())
    }

    /// Header, statuses and tag are in: check them against the oldest frame
    /// in flight, take that frame, and set up its payload.
    fn check_head(&mut self, conn: &dyn Conn) -> Result<(), PluginError> {
        let peer = conn.peer();
        let header = Header::decode(&self.hb).map_err(|e| protocol(peer, &e.0))?;
        if header.kind != Kind::Response {
            return Err(protocol(peer, "expected a response frame"));
        }
        let status_len = header.count as usize * wire::STATUS_LEN;
        if status_len + TAG_LEN != self.buf.len() {
            return Err(protocol(
                peer,
                &format!(
                    "response {} does not match the oldest request in flight",
                    header.seq
                ),
            ));
        }
        let frame = conn.take_oldest(&header)?;
        let (status_bytes, tag) = self.buf.split_at(status_len);
        let checked = self
            .rx
            .open(&[&header.encode(), status_bytes], tag)
            .map_err(|e| integrity(peer, &e));
        let statuses = wire::decode_statuses(status_bytes);
        // From here the frame is ours: park it so an error fails it too.
        self.frame = Some((header, frame, statuses));
        checked?;
        if header.flags & wire::FLAG_INTEGRITY_FAILED != 0 {
            return Err(PluginError::new(
                ferry_plugins_abi::ErrorCode::Protocol,
                format!(
                    "tcp: {peer}: integrity check failed: the target found this request's                      payload altered on the way; connection dropped"
                ),
            ));
        }
        if header.payload_tagged() != conn.payload_integrity() {
            return Err(protocol(
                peer,
                "the response's payload tagging differs from the request's",
            ));
        }
        let Some((_, frame, statuses)) = &self.frame else {
            return Err(protocol(peer, "lost the frame being read"));
        };
        let expected: u64 = match frame.kind {
            Kind::Read => frame
                .entries
                .iter()
                .zip(statuses)
                .filter(|(_, s)| **s == sys::FERRY_OK)
                .map(|(e, _)| e.len)
                .sum(),
            _ => 0,
        };
        if header.payload_len != expected {
            return Err(protocol(
                peer,
                &format!(
                    "response carries {} payload bytes, {expected} expected",
                    header.payload_len
                ),
            ));
        }
        self.io = IoSlices::new();
        if expected > 0 {
            for (e, st) in frame.entries.iter().zip(statuses) {
                if *st == sys::FERRY_OK {
                    self.io.push(e.local as *const u8, e.len as usize);
                }
            }
            self.stage = Stage::Payload;
        } else {
            self.after_payload();
        }
        Ok(())
    }

    fn after_payload(&mut self) {
        let tagged = self
            .frame
            .as_ref()
            .is_some_and(|(h, _, _)| h.payload_tagged());
        if tagged {
            self.io = IoSlices::new();
            self.io.push(self.ptag.as_mut_ptr(), TAG_LEN);
            self.stage = Stage::PayloadTag;
        } else {
            self.stage = Stage::Idle;
        }
    }

    fn check_payload_tag(&mut self, conn: &dyn Conn) -> Result<(), PluginError> {
        let Some((header, frame, statuses)) = &self.frame else {
            return Err(protocol(conn.peer(), "lost the frame being read"));
        };
        let mut mac = self.rx.payload(header.seq);
        if frame.kind == Kind::Read {
            for (e, st) in frame.entries.iter().zip(statuses) {
                if *st == sys::FERRY_OK {
                    // SAFETY: a registered local buffer the engine keeps
                    // valid while its request is in flight; its bytes were
                    // just received.
                    mac.update(unsafe {
                        std::slice::from_raw_parts(e.local as *const u8, e.len as usize)
                    });
                }
            }
        }
        mac.verify(&self.ptag)
            .map_err(|e| integrity(conn.peer(), &e))
    }
}
