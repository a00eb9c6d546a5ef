//! The target side of staging: slots lent to a peer on its control
//! connection, and copies between them and device memory on request.

use super::protocol::{bad, decode_copy_request, decode_open_request, OpenReply};
use super::state::{Session, MAX_LENT};
use crate::control::MsgType;
use crate::descriptor::BufferDescriptor;
use crate::engine::shared::Shared;
use crate::error::{Error, ErrorCode, Result};
use crate::location::Location;
use crate::memory::Visibility;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

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
        let reply = serde_json::to_vec(&OpenReply { slots: descriptors })
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

    /// Copies between a lent slot and device memory this engine registered.
    pub(crate) fn stage_copy(&self, conn: u64, body: &[u8]) -> Result<(MsgType, Vec<u8>)> {
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
            .memory
            .find(req.device_addr, req.len)
            .filter(|b| b.visibility == Visibility::Published && b.device.is_some())
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
        let stream = match session.streams.entry(device) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(self.devices.plugins[device].stream(ordinal)?)
            }
        };
        let slot = slot_addr + req.offset;
        buffer
            .inflight
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let copied = if req.to_device {
            stream.copy(req.device_addr, slot, req.len)
        } else {
            stream.copy(slot, req.device_addr, req.len)
        }
        .and_then(|()| stream.sync());
        buffer
            .inflight
            .fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
        copied?;
        Ok((MsgType::StageDone, b"{}".to_vec()))
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
