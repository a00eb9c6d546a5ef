//! The initiator side of staging: this engine's own pinned slots, the
//! sessions peers lend it (leased one job at a time), and copy streams.
//!
//! Reaches in Shared: `devices`, `memory`, `node`, `staging`.

use super::protocol::{
    decode_open_reply, CopyDone, CopyListRequest, CopyRequest, OpenRequest, COPY_LIST_VERSION,
};
use super::slots::{slot_geometry, Piece, SlotPool, Space};
use crate::control::{ControlClient, MsgType};
use crate::device::Stream;
use crate::engine::segments::{RemoteSegment, RemoteStaging, RemoteView};
use crate::engine::shared::Shared;
use crate::error::{Error, ErrorCode, Result};
use crate::memory::{LocalBuffer, Visibility};
use parking_lot::{Condvar, Mutex};
use std::sync::Arc;

/// Staging sessions a large job opens with each peer, the depth's slots
/// shared out among them. The peer answers a session's copy requests one
/// at a time (waiting for its GPU before it replies), on one control
/// worker each: with two, one list's checks and launch overlap the
/// other's device copy, and a job's chunks alternate between them. A job
/// that fills fewer than SESSIONS windows (depth x chunk each) opens one:
/// every session holds a control connection, and a host's are capped.
pub(crate) const SESSIONS: usize = 2;

/// A session borrowed from a segment's idle sessions; given back when
/// dropped unless its connection broke.
pub(crate) struct StagingLease {
    pub(crate) segment: Arc<RemoteSegment>,
    pub(crate) session: Option<Arc<RemoteStaging>>,
    pub(crate) broken: bool,
}

impl StagingLease {
    pub(crate) fn view(&self) -> &Arc<RemoteView> {
        &self.session().view
    }

    fn session(&self) -> &RemoteStaging {
        self.session
            .as_deref()
            .expect("a lease holds its session until dropped")
    }

    pub(crate) fn send_copy(
        &mut self,
        to_device: bool,
        at: Piece,
        len: u64,
        device_addr: u64,
    ) -> Result<()> {
        let body = serde_json::to_vec(&CopyRequest {
            to_device,
            slot: at.slot,
            offset: at.offset,
            len,
            device_addr,
        })
        .map_err(|e| Error::new(ErrorCode::Internal, e.to_string()))?;
        let sent = self.session().client.lock().send(MsgType::StageCopy, &body);
        self.broken |= sent.is_err();
        sent
    }

    /// Whether the peer takes lists of copies (StageCopyList).
    pub(crate) fn copy_list(&self) -> bool {
        self.session().copy_list
    }

    /// Asks the peer for many copies between one slot and its device
    /// memory as one device operation; answered as send_copy is.
    pub(crate) fn send_copy_list(&mut self, list: &CopyListRequest) -> Result<()> {
        let sent = self
            .session()
            .client
            .lock()
            .send(MsgType::StageCopyList, &list.encode());
        self.broken |= sent.is_err();
        sent
    }

    /// Whether a reply has arrived (or the connection ended).
    pub(crate) fn reply_ready(&self) -> bool {
        self.session().client.lock().reply_ready()
    }

    /// The peer's answer to the oldest copy request: what its copy took.
    pub(crate) fn recv_copy(&mut self) -> Result<CopyDone> {
        let reply = self.session().client.lock().recv_reply();
        match reply {
            Ok(Ok((MsgType::StageDone, body))) => Ok(CopyDone::decode(&body)),
            Ok(Ok(_)) => {
                self.broken = true;
                Err(Error::new(
                    ErrorCode::Protocol,
                    "unexpected reply to a staging copy",
                ))
            }
            Ok(Err(refused)) => Err(refused),
            Err(e) => {
                self.broken = true;
                Err(e)
            }
        }
    }
}

impl Drop for StagingLease {
    fn drop(&mut self) {
        if let Some(s) = self.session.take() {
            if !self.broken {
                self.segment.staging.lock().push(s);
            }
        }
    }
}

impl Shared {
    /// Unregisters and frees this engine's own slots (at shutdown).
    pub(crate) fn release_local_slots(&self) {
        self.staging.streams.lock().clear();
        let Some(pool) = self.staging.local.lock().take() else {
            return;
        };
        let Some(device) = self.devices.first() else {
            return;
        };
        for &addr in &pool.bases {
            let _ = self.unregister_memory(addr);
            device.free_pinned(addr);
        }
    }

    /// This engine's pinned slots (made on first use), registered as local
    /// sources and destinations only.
    pub(crate) fn local_slots(&self) -> Result<Arc<SlotPool>> {
        let mut local = self.staging.local.lock();
        if let Some(p) = local.as_ref() {
            return Ok(p.clone());
        }
        let device = self
            .devices
            .first()
            .ok_or_else(|| Error::new(ErrorCode::Unsupported, "staging needs a device plugin"))?;
        let (unit, len) = slot_geometry(self.staging.chunk);
        let mut free = Vec::new();
        for _ in 0..self.staging.depth * 2 {
            let made = device.alloc_pinned(len).and_then(|addr| {
                self.register(addr, len, None, Visibility::LocalOnly)
                    .map(|_| addr)
                    .inspect_err(|_| device.free_pinned(addr))
            });
            match made {
                Ok(addr) => free.push(addr),
                Err(e) => {
                    for addr in free {
                        let _ = self.unregister_memory(addr);
                        device.free_pinned(addr);
                    }
                    return Err(e);
                }
            }
        }
        let pool = Arc::new(SlotPool {
            space: Mutex::new(Space::new(free.len(), unit)),
            bases: free,
            available: Condvar::new(),
        });
        *local = Some(pool.clone());
        Ok(pool)
    }

    /// One of this engine's pinned slots, as a registered buffer (to route
    /// the host leg of staged transfers).
    pub(crate) fn local_slot_buffer(&self) -> Result<Arc<LocalBuffer>> {
        let pool = self.local_slots()?;
        let addr = pool.bases.first().copied().unwrap_or(0);
        self.memory
            .find(addr, 1)
            .ok_or_else(|| Error::new(ErrorCode::Internal, "a staging slot is not registered"))
    }

    /// A staging session with a peer: an idle one, or a new one lent the
    /// depth's slots.
    pub(crate) fn remote_staging(&self, seg: &Arc<RemoteSegment>) -> Result<StagingLease> {
        self.remote_staging_of(seg, self.staging.depth)
    }

    /// A staging session with a peer: an idle one, or a new one lent
    /// `slots` slots (a job of SESSIONS sessions asks each for its share).
    pub(crate) fn remote_staging_of(
        &self,
        seg: &Arc<RemoteSegment>,
        slots: usize,
    ) -> Result<StagingLease> {
        // An idle session whose connection the peer closed (or is about to
        // close: FERRY_IDLE_TIMEOUT_S) is dropped, and its slots with it.
        loop {
            let Some(s) = seg.staging.lock().pop() else {
                break;
            };
            if s.client.lock().reusable() {
                return Ok(StagingLease {
                    segment: seg.clone(),
                    session: Some(s),
                    broken: false,
                });
            }
        }
        let control = seg.view.read().descriptor.control_addr().to_string();
        let mut client = ControlClient::connect(&control, &self.node.link)?;
        let body = serde_json::to_vec(&OpenRequest {
            slots,
            slot_len: slot_geometry(self.staging.chunk).1,
        })
        .map_err(|e| Error::new(ErrorCode::Internal, e.to_string()))?;
        let (kind, reply) = client.call(MsgType::StageOpen, &body)?;
        if kind != MsgType::StageOpened {
            return Err(Error::new(
                ErrorCode::Protocol,
                "unexpected reply to a staging session",
            ));
        }
        let reply = decode_open_reply(&reply, slot_geometry(self.staging.chunk).1)?;
        // We send version 1 lists; a peer announcing it (or later) takes them.
        let copy_list = reply.copy_list >= COPY_LIST_VERSION;
        let main = seg.view.read().clone();
        let mut descriptor = main.descriptor.clone();
        descriptor.buffers = reply.slots;
        descriptor.validate()?;
        // Slot i is the i-th buffer, in address order.
        let view = Arc::new(RemoteView::new(descriptor));
        Ok(StagingLease {
            segment: seg.clone(),
            session: Some(Arc::new(RemoteStaging {
                client: Mutex::new(client),
                view,
                copy_list,
            })),
            broken: false,
        })
    }

    pub(crate) fn take_stream(&self, device: usize, ordinal: u32) -> Result<(usize, u32, Stream)> {
        let idle = self
            .staging
            .streams
            .lock()
            .get_mut(&(device, ordinal))
            .and_then(|v| v.pop());
        let stream = match idle {
            Some(s) => s,
            None => self.devices.plugins[device].stream(ordinal)?,
        };
        Ok((device, ordinal, stream))
    }

    pub(crate) fn give_stream(&self, (device, ordinal, stream): (usize, u32, Stream)) {
        self.staging
            .streams
            .lock()
            .entry((device, ordinal))
            .or_default()
            .push(stream);
    }
}
