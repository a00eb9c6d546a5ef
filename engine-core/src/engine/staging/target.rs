//! The target side of staging: slots lent to a peer on its control
//! connection, and copies between them and device memory on request.
//!
//! Reaches in Shared: `devices`, `memory`, `staging`.

use super::protocol::{
    bad, decode_copy_list, decode_copy_request, decode_open_request, CopyDone, OpenReply,
};
use super::state::{Session, MAX_LENT};
use crate::control::MsgType;
use crate::descriptor::BufferDescriptor;
use crate::device::Stream;
use crate::engine::shared::Shared;
use crate::error::{Error, ErrorCode, Result};
use crate::location::Location;
use crate::memory::LocalBuffer;
use crate::memory::Visibility;
use ferry_plugins_abi::sys::ferry_device_copy_t;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

impl Shared {
    // ---- target side -----------------------------------------------------

    /// Lends slots to the peer on control connection `conn`.
    pub(crate) fn stage_open(&self, conn: u64, body: &[u8]) -> Result<(MsgType, Vec<u8>)> {
        let req = decode_open_request(body)?;
        if self.devices.plugins.is_empty() {
            return Err(Error::new(
                ErrorCode::Unsupported,
                "this engine has no device plugin, so it has no device memory to stage",
            ));
        }
        self.stage_close(conn);
        let bytes = req.slots as u64 * req.slot_len;
        {
            let mut lent = self.staging.lent.lock();
            if *lent + bytes > MAX_LENT {
                return Err(Error::new(
                    ErrorCode::NoMemory,
                    format!(
                        "staging capacity exhausted: {} bytes already lent to peers, at most {MAX_LENT}",
                        *lent
                    ),
                ));
            }
            *lent += bytes;
        }
        let mut slots = Vec::new();
        let mut descriptors = Vec::new();
        for _ in 0..req.slots {
            match self.allocate_hidden(req.slot_len) {
                Ok((addr, d)) => {
                    slots.push((addr, req.slot_len));
                    descriptors.push(d);
                }
                Err(e) => {
                    for (a, _) in slots {
                        self.release_slot(a);
                    }
                    *self.staging.lent.lock() -= bytes;
                    return Err(e);
                }
            }
        }
        // Slot indices are positions in address order, on both sides.
        let mut paired: Vec<((u64, u64), BufferDescriptor)> =
            slots.into_iter().zip(descriptors).collect();
        paired.sort_by_key(|((addr, _), _)| *addr);
        let (slots, descriptors): (Vec<_>, Vec<_>) = paired.into_iter().unzip();
        log::debug!(
            "lent {} staging slots of {} bytes on control connection {conn}",
            slots.len(),
            req.slot_len
        );
        self.staging.sessions.lock().insert(
            conn,
            Arc::new(Mutex::new(Session {
                slots,
                streams: HashMap::new(),
            })),
        );
        let reply = serde_json::to_vec(&OpenReply {
            slots: descriptors,
            copy_list: super::protocol::COPY_LIST_VERSION,
        })
        .map_err(|e| Error::new(ErrorCode::Internal, e.to_string()))?;
        Ok((MsgType::StageOpened, reply))
    }

    /// Host memory that peers can reach but that is announced to one peer
    /// only; pinned when a device can pin it.
    fn allocate_hidden(&self, len: u64) -> Result<(u64, BufferDescriptor)> {
        let addr = self.allocate(len, None, Visibility::Hidden)?;
        if let Some(d) = self.devices.first() {
            if let Err(e) = d.pin_host(addr, len) {
                log::debug!(
                    "{}: cannot pin a staging slot ({e}); copies use pageable memory",
                    d.name
                );
            }
        }
        let buffer = self
            .memory
            .find(addr, len)
            .ok_or_else(|| Error::new(ErrorCode::Internal, "a staging slot vanished"))?;
        Ok((addr, self.buffer_descriptor(&buffer, 0)))
    }

    fn release_slot(&self, addr: u64) {
        if let Some(d) = self.devices.first() {
            d.unpin_host(addr);
        }
        if let Err(e) = self.free_memory(addr) {
            log::warn!("releasing a staging slot: {e}");
        }
    }

    /// The published device buffer holding `[addr, +len)`: the only
    /// memory a peer's staged copy may touch here.
    fn published_device(&self, addr: u64, len: u64) -> Option<Arc<LocalBuffer>> {
        self.memory
            .find(addr, len)
            .filter(|b| b.visibility == Visibility::Published && b.device.is_some())
    }

    /// Copies between a lent slot and device memory this engine registered.
    pub(crate) fn stage_copy(&self, conn: u64, body: &[u8]) -> Result<(MsgType, Vec<u8>)> {
        let began = Instant::now();
        let req = decode_copy_request(body)?;
        let session = self
            .staging
            .sessions
            .lock()
            .get(&conn)
            .cloned()
            .ok_or_else(|| bad("no staging session on this connection"))?;
        let mut session = session.lock();
        let &(slot_addr, slot_len) = session
            .slots
            .get(req.slot)
            .ok_or_else(|| bad("no such slot"))?;
        let end = req
            .offset
            .checked_add(req.len)
            .ok_or_else(|| bad("range wraps"))?;
        if req.len == 0 || end > slot_len {
            return Err(bad("range outside the slot"));
        }
        let buffer = self
            .published_device(req.device_addr, req.len)
            .ok_or_else(|| {
                Error::new(
                    ErrorCode::OutOfBounds,
                    format!(
                        "[{:#x}, +{}) is not inside device memory registered here",
                        req.device_addr, req.len
                    ),
                )
            })?;
        let device = buffer
            .device
            .ok_or_else(|| Error::new(ErrorCode::Internal, "device memory without a device"))?;
        let ordinal = match buffer.location {
            Location::Cuda(o) | Location::Rocm(o) => o,
            Location::Cpu(_) => {
                return Err(Error::new(
                    ErrorCode::Internal,
                    "host memory as device memory",
                ))
            }
        };
        let stream = session_stream(self, &mut session, device, ordinal)?;
        let slot = slot_addr + req.offset;
        buffer
            .inflight
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let mut done = CopyDone {
            check_us: micros(began),
            ..CopyDone::default()
        };
        let queuing = Instant::now();
        let copied = if req.to_device {
            stream.copy(req.device_addr, slot, req.len)
        } else {
            stream.copy(slot, req.device_addr, req.len)
        }
        .and_then(|()| {
            done.queue_us = micros(queuing);
            let waiting = Instant::now();
            let synced = stream.sync();
            done.wait_us = micros(waiting);
            synced
        });
        buffer
            .inflight
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        copied?;
        Ok((MsgType::StageDone, done.encode()))
    }

    /// Copies many pieces between a lent slot and device memory this engine
    /// registered, one device operation per device (staging's scatter of a
    /// packed run, or its gather of one). Every piece is checked against
    /// the slot and a published device registration first: one bad piece
    /// refuses the whole list, and nothing is copied.
    pub(crate) fn stage_copy_list(&self, conn: u64, body: &[u8]) -> Result<(MsgType, Vec<u8>)> {
        let began = Instant::now();
        let req = decode_copy_list(body)?;
        let session = self
            .staging
            .sessions
            .lock()
            .get(&conn)
            .cloned()
            .ok_or_else(|| bad("no staging session on this connection"))?;
        let mut session = session.lock();
        let &(slot_addr, slot_len) = session
            .slots
            .get(req.slot)
            .ok_or_else(|| bad("no such slot"))?;
        // Checked whole before anything moves. A list's pieces lie mostly
        // in one buffer: the last one found is tried first, and no piece
        // takes a reference of its own (two atomic operations a piece).
        let mut buffers: Vec<(Arc<LocalBuffer>, (usize, u32))> = Vec::new();
        let mut last = 0;
        let mut groups: Vec<((usize, u32), Vec<ferry_device_copy_t>)> = Vec::new();
        for (i, p) in req.pieces.iter().enumerate() {
            // decode_copy_list checked that neither side wraps.
            if p.slot_offset + p.len > slot_len {
                return Err(bad(&format!("copy list piece {i} falls outside the slot")));
            }
            let inside = |(b, _): &(Arc<LocalBuffer>, (usize, u32))| {
                b.addr <= p.device_addr && p.device_addr + p.len <= b.end()
            };
            if !buffers.get(last).is_some_and(inside) {
                last = match buffers.iter().rposition(inside) {
                    Some(k) => k,
                    None => {
                        let b = self.published_device(p.device_addr, p.len).ok_or_else(|| {
                            Error::new(
                                ErrorCode::OutOfBounds,
                                format!(
                                    "copy list piece {i}: [{:#x}, +{}) is not inside device \
                                     memory registered here; the list was refused whole",
                                    p.device_addr, p.len
                                ),
                            )
                        })?;
                        let key = device_of(&b)?;
                        buffers.push((b, key));
                        buffers.len() - 1
                    }
                };
            }
            let key = buffers[last].1;
            let slot = slot_addr + p.slot_offset;
            let copy = if req.to_device {
                ferry_device_copy_t {
                    src: slot,
                    dst: p.device_addr,
                    len: p.len,
                }
            } else {
                ferry_device_copy_t {
                    src: p.device_addr,
                    dst: slot,
                    len: p.len,
                }
            };
            match groups.iter_mut().find(|(k, _)| *k == key) {
                Some((_, list)) => list.push(copy),
                None => {
                    // Mostly one device: room for every piece left at once.
                    let mut list = Vec::with_capacity(req.pieces.len() - i);
                    list.push(copy);
                    groups.push((key, list));
                }
            }
        }
        for (b, _) in &buffers {
            b.inflight.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        let mut done = CopyDone {
            check_us: micros(began),
            ..CopyDone::default()
        };
        let copied = (|| -> Result<()> {
            let queuing = Instant::now();
            for ((device, ordinal), list) in &groups {
                let stream = session_stream(self, &mut session, *device, *ordinal)?;
                stream.copy_list(list)?;
            }
            done.queue_us = micros(queuing);
            // Every list queued; wait for all of them.
            let waiting = Instant::now();
            for (key, _) in &groups {
                if let Some(stream) = session.streams.get_mut(key) {
                    stream.sync()?;
                }
            }
            done.wait_us = micros(waiting);
            Ok(())
        })();
        if copied.is_err() {
            // A list that failed midway may have left copies queued: let
            // them end before the slot is reused or the buffers go.
            for (key, _) in &groups {
                if let Some(stream) = session.streams.get_mut(key) {
                    let _ = stream.sync();
                }
            }
        }
        for (b, _) in &buffers {
            b.inflight.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        }
        copied?;
        Ok((MsgType::StageDone, done.encode()))
    }

    /// Takes back the slots lent on a connection that closed.
    pub(crate) fn stage_close(&self, conn: u64) {
        let session = self.staging.sessions.lock().remove(&conn);
        if let Some(s) = session {
            // A copy running on this session finishes before we free.
            let mut s = s.lock();
            s.streams.clear();
            let bytes: u64 = s.slots.iter().map(|(_, len)| len).sum();
            for (addr, _) in s.slots.drain(..) {
                self.release_slot(addr);
            }
            *self.staging.lent.lock() -= bytes;
        }
    }

    pub(crate) fn staging_connections(&self) -> Vec<u64> {
        self.staging.sessions.lock().keys().copied().collect()
    }
}

/// Microseconds since `t`, for a StageDone reply.
fn micros(t: Instant) -> u64 {
    u64::try_from(t.elapsed().as_micros()).unwrap_or(u64::MAX)
}

/// The device plugin and ordinal of a registered device buffer.
fn device_of(buffer: &LocalBuffer) -> Result<(usize, u32)> {
    let device = buffer
        .device
        .ok_or_else(|| Error::new(ErrorCode::Internal, "device memory without a device"))?;
    match buffer.location {
        Location::Cuda(o) | Location::Rocm(o) => Ok((device, o)),
        Location::Cpu(_) => Err(Error::new(
            ErrorCode::Internal,
            "host memory as device memory",
        )),
    }
}

/// The session's copy stream of (device, ordinal), made on first use.
fn session_stream<'a>(
    shared: &Shared,
    session: &'a mut Session,
    device: usize,
    ordinal: u32,
) -> Result<&'a mut Stream> {
    Ok(match session.streams.entry((device, ordinal)) {
        std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
        std::collections::hash_map::Entry::Vacant(e) => {
            e.insert(shared.devices.plugins[device].stream(ordinal)?)
        }
    })
}
