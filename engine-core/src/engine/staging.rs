//! Staging: device memory moved by transports that can only move host
//! memory (TCP, shm), through pinned host bounce buffers, pipelined.
//!
//! On the initiator, device memory is copied to or from local pinned slots
//! (registered local-only). On the target, a peer opens a staging session on
//! a control connection: the target lends it a few pinned slots, reachable
//! by the host transports but announced to that peer only, and copies
//! between a slot and its device memory when asked (StageCopy). The session,
//! and its slots, end with the connection.
//!
//! A write of device memory to device memory, per chunk:
//! device -> local slot (copy), local slot -> remote slot (transport),
//! remote slot -> remote device (StageCopy). Up to `depth` chunks are in
//! flight, so the copy of chunk i+1 overlaps the transfer of chunk i.

use super::{RemoteSegment, RemoteView, Request, Shared, Visibility};
use crate::batch::Batch;
use crate::control::{ControlClient, MsgType};
use crate::descriptor::BufferDescriptor;
use crate::device::Stream;
use crate::engine::Op;
use crate::error::{Error, ErrorCode, Result};
use crate::location::Location;
use crate::memory::LocalBuffer;
use parking_lot::{Condvar, Mutex};
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// Default for FERRY_STAGING_CHUNK: bytes per staged chunk.
pub const DEFAULT_CHUNK: u64 = 4 << 20;
/// Default for FERRY_STAGING_DEPTH: chunks in flight per staged job.
pub const DEFAULT_DEPTH: usize = 4;
const MAX_SLOTS: usize = 16;
const MAX_SLOT_LEN: u64 = 64 << 20;

/// Staging state of one engine: its configuration, the sessions peers
/// opened here, and its own pool of local slots.
pub(crate) struct Staging {
    chunk: u64,
    depth: usize,
    sessions: Mutex<HashMap<u64, Session>>,
    local: Mutex<Option<Arc<SlotPool>>>,
}

/// Slots lent to one peer on one control connection.
struct Session {
    slots: Vec<(u64, u64)>,
    streams: HashMap<usize, Stream>,
}

#[derive(Serialize, Deserialize)]
struct OpenRequest {
    slots: usize,
    slot_len: u64,
}

#[derive(Serialize, Deserialize)]
struct OpenReply {
    slots: Vec<BufferDescriptor>,
}

#[derive(Serialize, Deserialize)]
struct CopyRequest {
    /// Slot to device memory when true, device memory to slot otherwise.
    to_device: bool,
    slot: usize,
    offset: u64,
    len: u64,
    device_addr: u64,
}

impl Staging {
    pub(crate) fn from_env() -> Staging {
        let num = |var: &str, default: u64| {
            std::env::var(var)
                .ok()
                .and_then(|v| crate::config::parse_size_text(&v))
                .unwrap_or(default)
        };
        Staging {
            chunk: num("FERRY_STAGING_CHUNK", DEFAULT_CHUNK).clamp(64 << 10, MAX_SLOT_LEN),
            depth: (num("FERRY_STAGING_DEPTH", DEFAULT_DEPTH as u64) as usize).clamp(1, MAX_SLOTS),
            sessions: Mutex::new(HashMap::new()),
            local: Mutex::new(None),
        }
    }
}

/// Pinned host slots of this engine, used as local sources and destinations.
pub(crate) struct SlotPool {
    free: Mutex<Vec<u64>>,
    available: Condvar,
}

impl SlotPool {
    fn take(self: &Arc<Self>) -> LocalSlot {
        let mut free = self.free.lock();
        loop {
            if let Some(addr) = free.pop() {
                return LocalSlot {
                    pool: self.clone(),
                    addr,
                };
            }
            self.available.wait(&mut free);
        }
    }
}

struct LocalSlot {
    pool: Arc<SlotPool>,
    addr: u64,
}

impl Drop for LocalSlot {
    fn drop(&mut self) {
        self.pool.free.lock().push(self.addr);
        self.pool.available.notify_one();
    }
}

/// A peer's staging session, as the initiator holds it.
pub(crate) struct RemoteStaging {
    client: Mutex<ControlClient>,
    /// The lent slots, as a view the router understands.
    pub(crate) view: Arc<RemoteView>,
    free: Mutex<Vec<usize>>,
    available: Condvar,
}

struct RemoteSlot {
    staging: Arc<RemoteStaging>,
    index: usize,
}

impl RemoteSlot {
    fn addr(&self) -> u64 {
        self.staging.view.buffers[self.index].addr
    }
}

impl Drop for RemoteSlot {
    fn drop(&mut self) {
        self.staging.free.lock().push(self.index);
        self.staging.available.notify_one();
    }
}

impl RemoteStaging {
    fn take(self: &Arc<Self>) -> RemoteSlot {
        let mut free = self.free.lock();
        loop {
            if let Some(index) = free.pop() {
                return RemoteSlot {
                    staging: self.clone(),
                    index,
                };
            }
            self.available.wait(&mut free);
        }
    }

    fn copy(&self, to_device: bool, slot: usize, len: u64, device_addr: u64) -> Result<()> {
        let body = serde_json::to_vec(&CopyRequest {
            to_device,
            slot,
            offset: 0,
            len,
            device_addr,
        })
        .map_err(|e| Error::new(ErrorCode::Internal, e.to_string()))?;
        let (kind, _) = self.client.lock().call(MsgType::StageCopy, &body)?;
        if kind != MsgType::StageDone {
            return Err(Error::new(
                ErrorCode::Protocol,
                "unexpected reply to a staging copy",
            ));
        }
        Ok(())
    }
}

/// One request that goes through staging.
pub(crate) struct StagedItem {
    pub(crate) group: usize,
    pub(crate) op: Op,
    pub(crate) local: Arc<LocalBuffer>,
    pub(crate) local_addr: u64,
    pub(crate) segment: Arc<RemoteSegment>,
    pub(crate) remote_addr: u64,
    pub(crate) remote_on_device: bool,
    pub(crate) length: u64,
}

/// A chunk between its start and its end.
struct InFlight {
    item: usize,
    off: u64,
    len: u64,
    local_slot: Option<LocalSlot>,
    remote_slot: Option<RemoteSlot>,
    batch: Result<u64>,
}

fn bad(msg: &str) -> Error {
    Error::new(ErrorCode::Protocol, format!("bad staging request: {msg}"))
}

impl Shared {
    // ---- target side -----------------------------------------------------

    /// Lends slots to the peer on control connection `conn`.
    pub(super) fn stage_open(&self, conn: u64, body: &[u8]) -> Result<(MsgType, Vec<u8>)> {
        let req: OpenRequest = serde_json::from_slice(body)
            .map_err(|e| bad(&format!("not the expected JSON ({e})")))?;
        if req.slots == 0
            || req.slots > MAX_SLOTS
            || req.slot_len == 0
            || req.slot_len > MAX_SLOT_LEN
        {
            return Err(bad("slot count or size out of range"));
        }
        if self.devices.is_empty() {
            return Err(Error::new(
                ErrorCode::Unsupported,
                "this engine has no device plugin, so it has no device memory to stage",
            ));
        }
        self.stage_close(conn);
        let mut slots = Vec::new();
        let mut descriptors = Vec::new();
        for _ in 0..req.slots {
            let made = self.allocate_hidden(req.slot_len);
            match made {
                Ok((addr, d)) => {
                    slots.push((addr, req.slot_len));
                    descriptors.push(d);
                }
                Err(e) => {
                    for (a, _) in slots {
                        let _ = self.free_memory(a);
                    }
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
            Session {
                slots,
                streams: HashMap::new(),
            },
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
        Ok((addr, self.buffer_descriptor(&buffer)))
    }

    /// Copies between a lent slot and device memory this engine registered.
    pub(super) fn stage_copy(&self, conn: u64, body: &[u8]) -> Result<(MsgType, Vec<u8>)> {
        let req: CopyRequest = serde_json::from_slice(body)
            .map_err(|e| bad(&format!("not the expected JSON ({e})")))?;
        let mut sessions = self.staging.sessions.lock();
        let session = sessions
            .get_mut(&conn)
            .ok_or_else(|| bad("no staging session on this connection"))?;
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
                e.insert(self.devices[device].stream(ordinal)?)
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
    pub(super) fn stage_close(&self, conn: u64) {
        let session = self.staging.sessions.lock().remove(&conn);
        if let Some(s) = session {
            drop(s.streams);
            for (addr, _) in s.slots {
                if let Some(d) = self.devices.first() {
                    d.unpin_host(addr);
                }
                if let Err(e) = self.free_memory(addr) {
                    log::warn!("releasing a staging slot: {e}");
                }
            }
        }
    }

    pub(super) fn staging_connections(&self) -> Vec<u64> {
        self.staging.sessions.lock().keys().copied().collect()
    }

    // ---- initiator side --------------------------------------------------

    /// Unregisters and frees this engine's own slots (at shutdown).
    pub(super) fn release_local_slots(&self) {
        let Some(pool) = self.staging.local.lock().take() else {
            return;
        };
        let Some(device) = self.devices.first() else {
            return;
        };
        for addr in pool.free.lock().drain(..) {
            let _ = self.unregister_memory(addr);
            device.free_pinned(addr);
        }
    }

    /// This engine's pinned slots (made on first use), registered as local
    /// sources and destinations only.
    fn local_slots(&self) -> Result<Arc<SlotPool>> {
        let mut local = self.staging.local.lock();
        if let Some(p) = local.as_ref() {
            return Ok(p.clone());
        }
        let device = self
            .devices
            .first()
            .ok_or_else(|| Error::new(ErrorCode::Unsupported, "staging needs a device plugin"))?;
        let len = self.staging.chunk;
        let mut free = Vec::new();
        for _ in 0..self.staging.depth * 2 {
            let addr = device.alloc_pinned(len)?;
            self.register(addr, len, None, Visibility::LocalOnly)?;
            free.push(addr);
        }
        let pool = Arc::new(SlotPool {
            free: Mutex::new(free),
            available: Condvar::new(),
        });
        *local = Some(pool.clone());
        Ok(pool)
    }

    /// One of this engine's pinned slots, as a registered buffer (to route
    /// the host leg of staged transfers).
    pub(super) fn local_slot_buffer(&self) -> Result<Arc<LocalBuffer>> {
        let pool = self.local_slots()?;
        let slot = pool.take();
        self.memory
            .find(slot.addr, 1)
            .ok_or_else(|| Error::new(ErrorCode::Internal, "a staging slot is not registered"))
    }

    /// The staging session with a peer (opened on first use).
    pub(super) fn remote_staging(&self, seg: &RemoteSegment) -> Result<Arc<RemoteStaging>> {
        let mut slot = seg.staging.lock();
        if let Some(s) = slot.as_ref() {
            return Ok(s.clone());
        }
        let mut client =
            ControlClient::connect(&seg.name, self.config.connect_timeout, self.config.timeout)?;
        let body = serde_json::to_vec(&OpenRequest {
            slots: self.staging.depth,
            slot_len: self.staging.chunk,
        })
        .map_err(|e| Error::new(ErrorCode::Internal, e.to_string()))?;
        let (kind, reply) = client.call(MsgType::StageOpen, &body)?;
        if kind != MsgType::StageOpened {
            return Err(Error::new(
                ErrorCode::Protocol,
                "unexpected reply to a staging session",
            ));
        }
        let reply: OpenReply = serde_json::from_slice(&reply).map_err(|e| {
            Error::new(
                ErrorCode::Protocol,
                format!("malformed staging slots ({e})"),
            )
        })?;
        if reply.slots.is_empty() || reply.slots.len() > MAX_SLOTS {
            return Err(Error::new(
                ErrorCode::Protocol,
                "the peer lent no usable staging slots",
            ));
        }
        let main = seg.view.read().clone();
        let mut descriptor = main.descriptor.clone();
        descriptor.buffers = reply.slots;
        descriptor.validate()?;
        let view = Arc::new(RemoteView::new(descriptor));
        let staging = Arc::new(RemoteStaging {
            client: Mutex::new(client),
            free: Mutex::new((0..view.buffers.len()).collect()),
            available: Condvar::new(),
            view,
        });
        *slot = Some(staging.clone());
        Ok(staging)
    }

    /// Runs staged requests to the end, `depth` chunks at a time, and
    /// completes their groups.
    pub(super) fn run_staged(self: Arc<Self>, batch: Arc<Batch>, items: Vec<StagedItem>) {
        let mut errors: Vec<Option<Error>> = (0..items.len()).map(|_| None).collect();
        let mut remaining: Vec<u64> = items
            .iter()
            .map(|i| i.length.div_ceil(self.staging.chunk))
            .collect();
        let mut streams: HashMap<(usize, u32), Stream> = HashMap::new();
        let chunk = self.staging.chunk;
        let mut chunks = items
            .iter()
            .enumerate()
            .flat_map(|(i, it)| (0..it.length.div_ceil(chunk)).map(move |k| (i, k * chunk)))
            .collect::<VecDeque<_>>();
        let mut inflight: VecDeque<InFlight> = VecDeque::new();
        let timeout = self.config.timeout * 2;
        let finish =
            |errors: &mut Vec<Option<Error>>, remaining: &mut Vec<u64>, i: usize, r: Result<()>| {
                if let Err(e) = r {
                    errors[i].get_or_insert(e);
                }
                remaining[i] -= 1;
                if remaining[i] == 0 {
                    let result = errors[i].take().map_or(Ok(()), Err);
                    batch.complete_group(items[i].group, result);
                }
            };
        loop {
            // Start chunks while slots allow.
            while inflight.len() < self.staging.depth {
                let Some((i, off)) = chunks.pop_front() else {
                    break;
                };
                let it = &items[i];
                let len = chunk.min(it.length - off);
                if errors[i].is_some() {
                    finish(&mut errors, &mut remaining, i, Ok(()));
                    continue;
                }
                let started = self.start_chunk(it, off, len, &mut streams);
                match started {
                    Ok(f) => inflight.push_back(InFlight { item: i, ..f }),
                    Err(e) => finish(&mut errors, &mut remaining, i, Err(e)),
                }
            }
            let Some(f) = inflight.pop_front() else { break };
            let it = &items[f.item];
            let result = self.end_chunk(it, f, timeout, &mut streams);
            let i = result.0;
            finish(&mut errors, &mut remaining, i, result.1);
        }
    }

    fn stream<'a>(
        &self,
        streams: &'a mut HashMap<(usize, u32), Stream>,
        buffer: &LocalBuffer,
    ) -> Result<&'a mut Stream> {
        let device = buffer.device.ok_or_else(|| {
            Error::new(ErrorCode::Internal, "staging host memory as device memory")
        })?;
        let ordinal = match buffer.location {
            Location::Cuda(o) | Location::Rocm(o) => o,
            Location::Cpu(_) => 0,
        };
        Ok(match streams.entry((device, ordinal)) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(self.devices[device].stream(ordinal)?)
            }
        })
    }

    /// Copies out of device memory where needed, then starts the host
    /// transfer of one chunk.
    fn start_chunk(
        self: &Arc<Self>,
        it: &StagedItem,
        off: u64,
        len: u64,
        streams: &mut HashMap<(usize, u32), Stream>,
    ) -> Result<InFlight> {
        let local_slot = match it.local.device {
            Some(_) => Some(self.local_slots()?.take()),
            None => None,
        };
        let remote_slot = if it.remote_on_device {
            Some(self.remote_staging(&it.segment)?.take())
        } else {
            None
        };
        let local = local_slot.as_ref().map_or(it.local_addr + off, |s| s.addr);
        let remote = remote_slot
            .as_ref()
            .map_or(it.remote_addr + off, |s| s.addr());
        match it.op {
            Op::Write => {
                if let Some(s) = &local_slot {
                    let stream = self.stream(streams, &it.local)?;
                    stream.copy(s.addr, it.local_addr + off, len)?;
                    stream.sync()?;
                }
            }
            Op::Read => {
                if let Some(s) = &remote_slot {
                    s.staging.copy(false, s.index, len, it.remote_addr + off)?;
                }
            }
        }
        let batch = self.batches.allocate(1).map(|b| b.id);
        let batch = batch.and_then(|id| {
            let r = Request::new(it.op, local, it.segment.id, remote, len);
            self.submit_internal(id, &r).map(|()| id)
        });
        Ok(InFlight {
            item: 0,
            off,
            len,
            local_slot,
            remote_slot,
            batch,
        })
    }

    /// Waits for a chunk's host transfer, then copies into device memory
    /// where needed. Returns the item and the chunk's result.
    fn end_chunk(
        &self,
        it: &StagedItem,
        f: InFlight,
        timeout: std::time::Duration,
        streams: &mut HashMap<(usize, u32), Stream>,
    ) -> (usize, Result<()>) {
        let item = f.item;
        let result = (|| -> Result<()> {
            let id = f.batch?;
            let batch = self.batches.get(id)?;
            let status = self.wait(&batch, timeout);
            let _ = self.batches.free(id);
            if !status.is_done() {
                return Err(Error::new(
                    ErrorCode::Timeout,
                    "a staged chunk did not finish in time",
                ));
            }
            if let Some((_, e)) = status.first_error {
                return Err(e);
            }
            match it.op {
                Op::Write => {
                    if let Some(s) = &f.remote_slot {
                        s.staging
                            .copy(true, s.index, f.len, it.remote_addr + f.off)?;
                    }
                }
                Op::Read => {
                    if let Some(s) = &f.local_slot {
                        let stream = self.stream(streams, &it.local)?;
                        stream.copy(it.local_addr + f.off, s.addr, f.len)?;
                        stream.sync()?;
                    }
                }
            }
            Ok(())
        })();
        (item, result)
    }
}
