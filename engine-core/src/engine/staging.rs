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

use super::{RemoteSegment, RemoteView, Request, SegmentId, Shared, Visibility};
use crate::batch::{Batch, BatchId};
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
use std::time::Instant;

/// Default for FERRY_STAGING_CHUNK: bytes per staged chunk.
pub const DEFAULT_CHUNK: u64 = 4 << 20;
/// Default for FERRY_STAGING_DEPTH: chunks in flight per staged job.
pub const DEFAULT_DEPTH: usize = 4;
const MAX_SLOTS: usize = 16;
/// Most chunks of one job in flight (small requests share slots).
const MAX_INFLIGHT: usize = 64;
const MAX_SLOT_LEN: u64 = 64 << 20;

/// Staging state of one engine: its configuration, the sessions peers
/// opened here, its own pool of local slots and of copy streams.
pub(crate) struct Staging {
    chunk: u64,
    depth: usize,
    sessions: Mutex<HashMap<u64, Arc<Mutex<Session>>>>,
    /// Bytes lent to peers, all sessions together.
    lent: Mutex<u64>,
    local: Mutex<Option<Arc<SlotPool>>>,
    streams: Mutex<HashMap<(usize, u32), Vec<Stream>>>,
}

/// Slots lent to one peer on one control connection.
struct Session {
    slots: Vec<(u64, u64)>,
    streams: HashMap<usize, Stream>,
}

/// A peer asks for a staging session: `slots` slots of `slot_len` bytes.
#[derive(Debug, Serialize, Deserialize)]
pub struct OpenRequest {
    pub slots: usize,
    pub slot_len: u64,
}

/// The lent slots, as buffers of a segment descriptor.
#[derive(Debug, Serialize, Deserialize)]
pub struct OpenReply {
    pub slots: Vec<BufferDescriptor>,
}

/// A peer asks for a copy between one of its lent slots and device memory.
#[derive(Debug, Serialize, Deserialize)]
pub struct CopyRequest {
    /// Slot to device memory when true, device memory to slot otherwise.
    pub to_device: bool,
    pub slot: usize,
    pub offset: u64,
    pub len: u64,
    pub device_addr: u64,
}

/// Decodes a peer's StageOpen body and checks its bounds.
pub fn decode_open_request(body: &[u8]) -> Result<OpenRequest> {
    let req: OpenRequest =
        serde_json::from_slice(body).map_err(|e| bad(&format!("not the expected JSON ({e})")))?;
    if req.slots == 0 || req.slots > MAX_SLOTS || req.slot_len == 0 || req.slot_len > MAX_SLOT_LEN {
        return Err(bad("slot count or size out of range"));
    }
    Ok(req)
}

/// Decodes a peer's StageCopy body: a non-empty range that does not wrap
/// (the caller checks it against the slot).
pub fn decode_copy_request(body: &[u8]) -> Result<CopyRequest> {
    let req: CopyRequest =
        serde_json::from_slice(body).map_err(|e| bad(&format!("not the expected JSON ({e})")))?;
    if req.len == 0
        || req.offset.checked_add(req.len).is_none()
        || req.device_addr.checked_add(req.len).is_none()
    {
        return Err(bad("empty or wrapping range"));
    }
    Ok(req)
}

/// Decodes the slots a peer lent (StageOpened): 1 to 16 of at least
/// `slot_len` bytes each (the caller validates them as a descriptor).
pub fn decode_open_reply(body: &[u8], slot_len: u64) -> Result<OpenReply> {
    let reply: OpenReply = serde_json::from_slice(body).map_err(|e| {
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
    if reply.slots.iter().any(|b| b.len < slot_len) {
        return Err(Error::new(
            ErrorCode::Protocol,
            "the peer lent staging slots smaller than asked",
        ));
    }
    Ok(reply)
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
            lent: Mutex::new(0),
            local: Mutex::new(None),
            streams: Mutex::new(HashMap::new()),
        }
    }
}

/// Units per slot: a chunk smaller than a slot takes only the units it
/// needs, so many small requests are in flight in the space of one chunk.
const UNITS: u32 = 16;

/// Space in a set of equal slots, in units, first fit.
struct Space {
    unit: u64,
    used: Vec<u32>,
}

/// A range of one slot: its index, byte offset and unit mask.
#[derive(Clone, Copy)]
struct Piece {
    slot: usize,
    offset: u64,
    mask: u32,
}

impl Space {
    fn new(slots: usize, unit: u64) -> Space {
        Space {
            unit,
            used: vec![0; slots],
        }
    }

    fn take(&mut self, len: u64) -> Option<Piece> {
        let n = len.div_ceil(self.unit).clamp(1, UNITS as u64) as u32;
        let run = if n == 32 { u32::MAX } else { (1u32 << n) - 1 };
        for (slot, used) in self.used.iter_mut().enumerate() {
            for first in 0..=(UNITS - n) {
                let mask = run << first;
                if *used & mask == 0 {
                    *used |= mask;
                    return Some(Piece {
                        slot,
                        offset: first as u64 * self.unit,
                        mask,
                    });
                }
            }
        }
        None
    }

    fn give(&mut self, p: Piece) {
        if let Some(used) = self.used.get_mut(p.slot) {
            *used &= !p.mask;
        }
    }
}

/// The unit and slot length that hold chunks of `chunk` bytes.
fn slot_geometry(chunk: u64) -> (u64, u64) {
    let unit = chunk.div_ceil(UNITS as u64).next_multiple_of(4096);
    (unit, unit * UNITS as u64)
}

/// Pinned host slots of this engine, used as local sources and destinations.
pub(crate) struct SlotPool {
    bases: Vec<u64>,
    space: Mutex<Space>,
    available: Condvar,
}

impl SlotPool {
    /// Room for `len` bytes; waits for it only when `wait` (a job that
    /// holds none must not wait on jobs that hold some, or jobs could
    /// deadlock).
    fn take(self: &Arc<Self>, len: u64, wait: bool) -> Option<LocalSlot> {
        let mut space = self.space.lock();
        loop {
            if let Some(piece) = space.take(len) {
                return Some(LocalSlot {
                    pool: self.clone(),
                    addr: self.bases[piece.slot] + piece.offset,
                    piece,
                });
            }
            if !wait {
                return None;
            }
            self.available.wait(&mut space);
        }
    }
}

struct LocalSlot {
    pool: Arc<SlotPool>,
    piece: Piece,
    addr: u64,
}

impl Drop for LocalSlot {
    fn drop(&mut self) {
        self.pool.space.lock().give(self.piece);
        self.pool.available.notify_all();
    }
}

/// A staging session a peer opened for us: a control connection of our own
/// and the slots lent on it. One job uses a session at a time, so requests
/// and replies on its connection never interleave with another job's.
pub(crate) struct RemoteStaging {
    client: Mutex<ControlClient>,
    /// The lent slots, as a view the router understands.
    pub(crate) view: Arc<RemoteView>,
}

/// A session borrowed from a segment's idle sessions; given back when
/// dropped unless its connection broke.
pub(crate) struct StagingLease {
    segment: Arc<RemoteSegment>,
    session: Option<Arc<RemoteStaging>>,
    broken: bool,
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

    fn send_copy(&mut self, to_device: bool, at: Piece, len: u64, device_addr: u64) -> Result<()> {
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

    /// Whether a reply has arrived (or the connection ended).
    fn reply_ready(&self) -> bool {
        self.session().client.lock().reply_ready()
    }

    fn recv_copy(&mut self) -> Result<()> {
        let reply = self.session().client.lock().recv_reply();
        match reply {
            Ok(Ok((MsgType::StageDone, _))) => Ok(()),
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

/// Where a chunk is on its way.
enum Phase {
    /// A copy between device memory and the local slot is queued.
    Copying,
    /// The host transfer runs in this internal batch.
    Moving(BatchId),
    /// The peer was asked to copy between its slot and device memory.
    Remote,
    Done,
}

/// One chunk of a staged request, between its start and its end.
struct Chunk {
    item: usize,
    off: u64,
    len: u64,
    local_slot: Option<LocalSlot>,
    /// Room in the peer's slots, in the job's session.
    remote_slot: Option<Piece>,
    stream: Option<(usize, u32, Stream)>,
    phase: Phase,
}

fn bad(msg: &str) -> Error {
    Error::new(ErrorCode::Protocol, format!("bad staging request: {msg}"))
}

/// Most bytes of slots one engine lends to all its peers together.
const MAX_LENT: u64 = 2 << 30;

impl Shared {
    // ---- target side -----------------------------------------------------

    /// Lends slots to the peer on control connection `conn`.
    pub(super) fn stage_open(&self, conn: u64, body: &[u8]) -> Result<(MsgType, Vec<u8>)> {
        let req = decode_open_request(body)?;
        if self.devices.is_empty() {
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
        Ok((addr, self.buffer_descriptor(&buffer)))
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
    pub(super) fn stage_copy(&self, conn: u64, body: &[u8]) -> Result<(MsgType, Vec<u8>)> {
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

    pub(super) fn staging_connections(&self) -> Vec<u64> {
        self.staging.sessions.lock().keys().copied().collect()
    }

    // ---- initiator side --------------------------------------------------

    /// Unregisters and frees this engine's own slots (at shutdown).
    pub(super) fn release_local_slots(&self) {
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
    fn local_slots(&self) -> Result<Arc<SlotPool>> {
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
    pub(super) fn local_slot_buffer(&self) -> Result<Arc<LocalBuffer>> {
        let pool = self.local_slots()?;
        let addr = pool.bases.first().copied().unwrap_or(0);
        self.memory
            .find(addr, 1)
            .ok_or_else(|| Error::new(ErrorCode::Internal, "a staging slot is not registered"))
    }

    /// A staging session with a peer: an idle one, or a new one.
    pub(super) fn remote_staging(&self, seg: &Arc<RemoteSegment>) -> Result<StagingLease> {
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
        let mut client = ControlClient::connect(&control, &self.link)?;
        let body = serde_json::to_vec(&OpenRequest {
            slots: self.staging.depth,
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
            })),
            broken: false,
        })
    }

    fn take_stream(&self, device: usize, ordinal: u32) -> Result<(usize, u32, Stream)> {
        let idle = self
            .staging
            .streams
            .lock()
            .get_mut(&(device, ordinal))
            .and_then(|v| v.pop());
        let stream = match idle {
            Some(s) => s,
            None => self.devices[device].stream(ordinal)?,
        };
        Ok((device, ordinal, stream))
    }

    fn give_stream(&self, (device, ordinal, stream): (usize, u32, Stream)) {
        self.staging
            .streams
            .lock()
            .entry((device, ordinal))
            .or_default()
            .push(stream);
    }

    /// Runs staged requests to the end and completes their groups.
    ///
    /// Up to `depth` chunks are in flight, each at its own phase: while the
    /// oldest chunk's host transfer runs, the next chunks' device copies
    /// run on their own streams and the peer copies the previous chunks
    /// into device memory. The thread blocks only when no chunk can move.
    pub(super) fn run_staged(self: Arc<Self>, batch: Arc<Batch>, items: Vec<StagedItem>) {
        let chunk = self.staging.chunk;
        let mut job = Job {
            items: &items,
            errors: (0..items.len()).map(|_| None).collect(),
            remaining: items.iter().map(|i| i.length.div_ceil(chunk)).collect(),
            batch: &batch,
            leases: HashMap::new(),
            free_remote: HashMap::new(),
            awaiting: HashMap::new(),
            replies: HashMap::new(),
        };
        let mut pending = items
            .iter()
            .enumerate()
            .flat_map(|(i, it)| (0..it.length.div_ceil(chunk)).map(move |k| (i, k * chunk)))
            .collect::<VecDeque<_>>();
        let mut inflight: VecDeque<Chunk> = VecDeque::new();
        let mut idle_since: Option<Instant> = None;
        let pool = if items.iter().any(|it| it.local.device.is_some()) {
            match self.local_slots() {
                Ok(p) => Some(p),
                Err(e) => {
                    for i in 0..items.len() {
                        for _ in 0..job.remaining[i] {
                            job.finish(i, Err(e.clone()));
                        }
                    }
                    return;
                }
            }
        } else {
            None
        };
        loop {
            // Admit chunks while the window and the slots allow.
            while inflight.len() < MAX_INFLIGHT {
                let Some(&(i, off)) = pending.front() else {
                    break;
                };
                if job.errors[i].is_some() {
                    pending.pop_front();
                    job.finish(i, Ok(()));
                    continue;
                }
                match self.admit(&mut job, pool.as_ref(), i, off, inflight.is_empty()) {
                    Ok(Some(c)) => {
                        pending.pop_front();
                        inflight.push_back(c);
                    }
                    Ok(None) => break,
                    Err(e) => {
                        pending.pop_front();
                        job.finish(i, Err(e));
                    }
                }
            }
            if inflight.is_empty() {
                if pending.is_empty() {
                    break;
                }
                continue;
            }
            // Move every chunk that can move without waiting; wait for the
            // oldest only when none could.
            self.progress();
            let mut moved = false;
            for c in inflight.iter_mut() {
                moved |= self.advance(&mut job, c, false);
            }
            if moved {
                idle_since = None;
            } else if idle_since.get_or_insert_with(Instant::now).elapsed() < self.config.spin {
                std::hint::spin_loop();
            } else if let Some(c) = inflight.front_mut() {
                idle_since = None;
                self.advance(&mut job, c, true);
            }
            while let Some(pos) = inflight.iter().position(|c| matches!(c.phase, Phase::Done)) {
                if let Some(c) = inflight.remove(pos) {
                    self.retire(&mut job, c, Ok(()));
                }
            }
        }
    }

    /// Starts one chunk: takes its slots and queues its first step. None
    /// when a slot is not free and `may_wait` is false.
    fn admit(
        self: &Arc<Self>,
        job: &mut Job<'_>,
        pool: Option<&Arc<SlotPool>>,
        i: usize,
        off: u64,
        may_wait: bool,
    ) -> Result<Option<Chunk>> {
        let it = &job.items[i];
        let len = self.staging.chunk.min(it.length - off);
        let local_slot = match (it.local.device, pool) {
            (Some(_), Some(p)) => match p.take(len, may_wait) {
                Some(s) => Some(s),
                None => return Ok(None),
            },
            _ => None,
        };
        let remote_slot = if it.remote_on_device {
            let seg = it.segment.id;
            if !job.leases.contains_key(&seg) {
                let lease = self.remote_staging(&it.segment)?;
                let (unit, _) = slot_geometry(self.staging.chunk);
                job.free_remote
                    .insert(seg, Space::new(lease.view().buffers.len(), unit));
                job.leases.insert(seg, lease);
            }
            match job.free_remote.get_mut(&seg).and_then(|f| f.take(len)) {
                Some(s) => Some(s),
                None => return Ok(None),
            }
        } else {
            None
        };
        let mut c = Chunk {
            item: i,
            off,
            len,
            local_slot,
            remote_slot,
            stream: None,
            phase: Phase::Done,
        };
        let started = (|| -> Result<()> {
            match it.op {
                Op::Write => match &c.local_slot {
                    Some(s) => {
                        let mut stream = self.stream_for(&it.local)?;
                        stream.2.copy(s.addr, it.local_addr + off, len)?;
                        c.stream = Some(stream);
                        c.phase = Phase::Copying;
                    }
                    None => c.phase = Phase::Moving(self.start_move(job, &c)?),
                },
                Op::Read => match c.remote_slot {
                    Some(_) => {
                        job.send_copy(&c, false)?;
                        c.phase = Phase::Remote;
                    }
                    None => c.phase = Phase::Moving(self.start_move(job, &c)?),
                },
            }
            Ok(())
        })();
        match started {
            Ok(()) => Ok(Some(c)),
            Err(e) => {
                self.release_chunk(job, c);
                Err(e)
            }
        }
    }

    fn stream_for(&self, buffer: &LocalBuffer) -> Result<(usize, u32, Stream)> {
        let device = buffer.device.ok_or_else(|| {
            Error::new(ErrorCode::Internal, "staging host memory as device memory")
        })?;
        let ordinal = match buffer.location {
            Location::Cuda(o) | Location::Rocm(o) => o,
            Location::Cpu(_) => 0,
        };
        self.take_stream(device, ordinal)
    }

    /// Submits the host leg of a chunk: between the local slot (or the
    /// local host buffer) and the peer's slot (or its host buffer).
    fn start_move(self: &Arc<Self>, job: &Job<'_>, c: &Chunk) -> Result<BatchId> {
        let it = &job.items[c.item];
        let local = c
            .local_slot
            .as_ref()
            .map_or(it.local_addr + c.off, |s| s.addr);
        let (remote, view) = match c.remote_slot {
            Some(slot) => {
                let lease = job.leases.get(&it.segment.id).ok_or_else(|| {
                    Error::new(ErrorCode::Internal, "a staged chunk lost its session")
                })?;
                let view = lease.view().clone();
                (view.buffers[slot.slot].addr + slot.offset, Some(view))
            }
            None => (it.remote_addr + c.off, None),
        };
        let b = self.batches.allocate(1)?;
        let r = Request::new(it.op, local, it.segment.id, remote, c.len);
        match self.submit_with(b.id, std::slice::from_ref(&r), view.as_ref()) {
            Ok(()) => Ok(b.id),
            Err(e) => {
                let _ = self.batches.free(b.id);
                Err(e)
            }
        }
    }

    /// Moves a chunk one phase on. Without `block`, only when that needs no
    /// waiting. Returns whether it moved.
    fn advance(self: &Arc<Self>, job: &mut Job<'_>, c: &mut Chunk, block: bool) -> bool {
        let it = &job.items[c.item];
        let step = (|| -> Result<bool> {
            match c.phase {
                Phase::Copying => {
                    // Device copies are fast next to host transfers: wait.
                    if let Some(s) = c.stream.as_mut() {
                        s.2.sync()?;
                    }
                    if let Some(s) = c.stream.take() {
                        self.give_stream(s);
                    }
                    c.phase = match it.op {
                        Op::Write => Phase::Moving(self.start_move(job, c)?),
                        Op::Read => Phase::Done,
                    };
                    Ok(true)
                }
                Phase::Moving(id) => {
                    let b = self.batches.get(id)?;
                    let status = if block {
                        self.wait(&b, self.config.timeout * 2)
                    } else {
                        b.status()
                    };
                    if !status.is_done() {
                        if block {
                            let _ = self.batches.free(id);
                            c.phase = Phase::Done;
                            return Err(Error::new(
                                ErrorCode::Timeout,
                                "a staged chunk did not finish in time",
                            ));
                        }
                        return Ok(false);
                    }
                    let _ = self.batches.free(id);
                    c.phase = Phase::Done;
                    if let Some((_, e)) = status.first_error {
                        return Err(e);
                    }
                    match (it.op, c.remote_slot, &c.local_slot) {
                        (Op::Write, Some(_), _) => {
                            job.send_copy(c, true)?;
                            c.phase = Phase::Remote;
                        }
                        (Op::Read, _, Some(s)) => {
                            let mut stream = self.stream_for(&it.local)?;
                            stream.2.copy(it.local_addr + c.off, s.addr, c.len)?;
                            c.stream = Some(stream);
                            c.phase = Phase::Copying;
                        }
                        _ => {}
                    }
                    Ok(true)
                }
                Phase::Remote => {
                    let Some(r) = job.reply_for(c, block) else {
                        return Ok(false);
                    };
                    c.phase = Phase::Done;
                    r?;
                    if it.op == Op::Read {
                        c.phase = Phase::Moving(self.start_move(job, c)?);
                    }
                    Ok(true)
                }
                Phase::Done => Ok(false),
            }
        })();
        match step {
            Ok(moved) => moved,
            Err(e) => {
                job.errors[c.item].get_or_insert(e);
                c.phase = Phase::Done;
                true
            }
        }
    }

    /// Gives a finished chunk's slots back and counts it.
    fn retire(&self, job: &mut Job<'_>, c: Chunk, result: Result<()>) {
        let i = c.item;
        self.release_chunk(job, c);
        job.finish(i, result);
    }

    fn release_chunk(&self, job: &mut Job<'_>, mut c: Chunk) {
        if let Some(mut s) = c.stream.take() {
            // A chunk that failed may have left a copy into its slot queued:
            // let it end before the slot is reused.
            let _ = s.2.sync();
        }
        if let Some(slot) = c.remote_slot {
            let seg = job.items[c.item].segment.id;
            if let Some(f) = job.free_remote.get_mut(&seg) {
                f.give(slot);
            }
        }
    }
}

/// The state of one staging job (one thread).
struct Job<'a> {
    items: &'a [StagedItem],
    errors: Vec<Option<Error>>,
    remaining: Vec<u64>,
    batch: &'a Batch,
    /// The session used with each peer, for the whole job.
    leases: HashMap<SegmentId, StagingLease>,
    free_remote: HashMap<SegmentId, Space>,
    /// Per peer, the chunks whose copy requests await replies, oldest first.
    awaiting: HashMap<SegmentId, VecDeque<(usize, u64)>>,
    /// Replies read for chunks that were not being looked at.
    replies: HashMap<(usize, u64), Result<()>>,
}

impl Job<'_> {
    fn finish(&mut self, i: usize, r: Result<()>) {
        if let Err(e) = r {
            self.errors[i].get_or_insert(e);
        }
        self.remaining[i] -= 1;
        if self.remaining[i] == 0 {
            let result = self.errors[i].take().map_or(Ok(()), Err);
            self.batch.complete_group(self.items[i].group, result);
        }
    }

    /// Asks the peer to copy between its slot and its device memory for
    /// chunk `c`.
    fn send_copy(&mut self, c: &Chunk, to_device: bool) -> Result<()> {
        let it = &self.items[c.item];
        let seg = it.segment.id;
        let slot = c
            .remote_slot
            .ok_or_else(|| Error::new(ErrorCode::Internal, "a staged chunk without a slot"))?;
        let lease = self
            .leases
            .get_mut(&seg)
            .ok_or_else(|| Error::new(ErrorCode::Internal, "a staged chunk lost its session"))?;
        lease.send_copy(to_device, slot, c.len, it.remote_addr + c.off)?;
        self.awaiting
            .entry(seg)
            .or_default()
            .push_back((c.item, c.off));
        Ok(())
    }

    /// The reply to chunk `c`'s copy request, reading replies in order
    /// until it comes; None when `block` is false and none is ready.
    fn reply_for(&mut self, c: &Chunk, block: bool) -> Option<Result<()>> {
        let key = (c.item, c.off);
        let seg = self.items[c.item].segment.id;
        loop {
            if let Some(r) = self.replies.remove(&key) {
                return Some(r);
            }
            let Some(lease) = self.leases.get_mut(&seg) else {
                return Some(Err(Error::new(
                    ErrorCode::Internal,
                    "a staged chunk lost its session",
                )));
            };
            if !block && !lease.reply_ready() {
                return None;
            }
            let queue = self.awaiting.entry(seg).or_default();
            let Some(front) = queue.pop_front() else {
                return Some(Err(Error::new(
                    ErrorCode::Internal,
                    "a staged chunk awaits a reply to nothing",
                )));
            };
            let r = lease.recv_copy();
            if let (Err(e), true) = (&r, lease.broken) {
                // The connection is out of step: every later reply is lost.
                for k in queue.drain(..) {
                    self.replies.insert(k, Err(e.clone()));
                }
            }
            self.replies.insert(front, r);
        }
    }
}
