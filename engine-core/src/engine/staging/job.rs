//! A staging job: staged requests cut into chunks, each moved through its
//! phases (device copy, host transfer, the peer's device copy), up to
//! `depth` chunks in flight.
//!
//! Small device-to-device requests to one peer are packed: many of them
//! share one chunk (a packed run in one slot), gathered by one list copy
//! on the local device, sent as one host transfer, and scattered by one
//! list copy on the peer's (StageCopyList); reads the other way round.

use super::initiator::StagingLease;
use super::protocol::{CopyListRequest, ListPiece, MAX_LIST_PIECES};
use super::slots::{slot_geometry, LocalSlot, Piece, SlotPool, Space};
use crate::batch::{Batch, BatchId};
use crate::device::Stream;
use crate::engine::plan::StagedItem;
use crate::engine::request::{Op, Request, SegmentId};
use crate::engine::segments::RemoteSegment;
use crate::engine::shared::Shared;
use crate::error::{Error, ErrorCode, Result};
use crate::location::Location;
use crate::memory::LocalBuffer;
use ferry_plugins_abi::sys::ferry_device_copy_t;
use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;
use std::time::Instant;

/// Most chunks of one job in flight (small requests share slots).
const MAX_INFLIGHT: usize = 64;
/// Where each request starts in a packed run: aligned for the copy
/// kernel's wide loads and stores.
const PACK_ALIGN: u64 = 256;

/// One whole small request in a packed run: `len` bytes of item `item`,
/// at `at` in the run.
#[derive(Clone, Copy, Debug)]
struct Part {
    item: usize,
    len: u64,
    at: u64,
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
    /// The requests of a packed run (two or more); empty for a chunk of
    /// one request, [off, off + len) of `item`.
    parts: Vec<Part>,
    /// The peer refused the packed run's list as outside its registered
    /// memory: its requests go again one by one, so only the bad ones fail.
    alone: bool,
    local_slot: Option<LocalSlot>,
    /// Room in the peer's slots, in the job's session.
    remote_slot: Option<Piece>,
    stream: Option<(usize, u32, Stream)>,
    phase: Phase,
}

impl Shared {
    /// Runs staged requests to the end and completes their groups.
    ///
    /// Up to `depth` chunks are in flight, each at its own phase: while the
    /// oldest chunk's host transfer runs, the next chunks' device copies
    /// run on their own streams and the peer copies the previous chunks
    /// into device memory. The thread blocks only when no chunk can move.
    pub(crate) fn run_staged(self: Arc<Self>, batch: Arc<Batch>, items: Vec<StagedItem>) {
        let chunk = self.staging.chunk;
        let mut job = Job {
            items: &items,
            errors: (0..items.len()).map(|_| None).collect(),
            remaining: items.iter().map(|i| i.length.div_ceil(chunk)).collect(),
            said_alone: false,
            batch: &batch,
            leases: HashMap::new(),
            free_remote: HashMap::new(),
            awaiting: HashMap::new(),
            replies: HashMap::new(),
            alone: HashSet::new(),
            no_session: HashMap::new(),
            requeue: Vec::new(),
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
                let parts = match self.pack(&mut job, &pending) {
                    Ok(parts) => parts,
                    Err(e) => {
                        pending.pop_front();
                        job.finish(i, Err(e));
                        continue;
                    }
                };
                let taken = parts.len().max(1);
                let items: Vec<usize> = pending.iter().take(taken).map(|&(i, _)| i).collect();
                match self.admit(&mut job, pool.as_ref(), i, off, parts, inflight.is_empty()) {
                    Ok(Some(c)) => {
                        pending.drain(..taken);
                        inflight.push_back(c);
                    }
                    Ok(None) => break,
                    Err(e) => {
                        pending.drain(..taken);
                        for i in items {
                            job.finish(i, Err(e.clone()));
                        }
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
            for i in job.requeue.drain(..).rev() {
                pending.push_front((i, 0));
            }
        }
    }

    /// The requests at the front of `pending` that go as one packed run:
    /// two or more whole small device-to-device requests to one peer that
    /// takes lists, from one local device, in one direction, that fit a
    /// chunk together. Empty when the front request goes alone.
    fn pack(&self, job: &mut Job<'_>, pending: &VecDeque<(usize, u64)>) -> Result<Vec<Part>> {
        let chunk = self.staging.chunk;
        let packable = |job: &Job<'_>, i: usize, off: u64| {
            let it = &job.items[i];
            off == 0
                && it.length < chunk
                && it.local.device.is_some()
                && it.remote_on_device
                && job.errors[i].is_none()
                && !job.alone.contains(&i)
        };
        let Some(&(first, off)) = pending.front() else {
            return Ok(Vec::new());
        };
        if !packable(job, first, off) {
            return Ok(Vec::new());
        }
        let lead = &job.items[first];
        if !job.lease(self, &lead.segment)?.copy_list() {
            return Ok(Vec::new());
        }
        let same = |it: &StagedItem| {
            it.segment.id == lead.segment.id
                && it.op == lead.op
                && it.local.device == lead.local.device
                && it.local.location == lead.local.location
        };
        let mut parts = Vec::new();
        let mut end = 0u64;
        for &(i, off) in pending.iter().take(MAX_LIST_PIECES) {
            if !packable(job, i, off) || !same(&job.items[i]) {
                break;
            }
            let at = end.next_multiple_of(PACK_ALIGN);
            let len = job.items[i].length;
            if at + len > chunk {
                break;
            }
            parts.push(Part { item: i, len, at });
            end = at + len;
        }
        if parts.len() < 2 {
            parts.clear();
        }
        Ok(parts)
    }

    /// Starts one chunk: takes its slots and queues its first step. None
    /// when a slot is not free and `may_wait` is false.
    fn admit(
        self: &Arc<Self>,
        job: &mut Job<'_>,
        pool: Option<&Arc<SlotPool>>,
        i: usize,
        off: u64,
        parts: Vec<Part>,
        may_wait: bool,
    ) -> Result<Option<Chunk>> {
        let it = &job.items[i];
        let len = match parts.last() {
            Some(p) => p.at + p.len,
            None => self.staging.chunk.min(it.length - off),
        };
        let local_slot = match (it.local.device, pool) {
            (Some(_), Some(p)) => match p.take(len, may_wait) {
                Some(s) => Some(s),
                None => return Ok(None),
            },
            _ => None,
        };
        let remote_slot = if it.remote_on_device {
            let seg = it.segment.id;
            job.lease(self, &it.segment)?;
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
            parts,
            alone: false,
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
                        let queued = if c.parts.is_empty() {
                            stream.2.copy(s.addr, it.local_addr + off, len)
                        } else {
                            stream.2.copy_list(&job.local_copies(&c, s.addr, true))
                        };
                        c.stream = Some(stream);
                        queued?;
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
        // Host memory on both sides: planned and dispatched, never staged.
        let started = self
            .planner()
            .plan(std::slice::from_ref(&r), view.as_ref())
            .and_then(|plan| {
                if !plan.staged.is_empty() {
                    return Err(Error::new(
                        ErrorCode::Internal,
                        "the host leg of a staged chunk would itself need staging",
                    ));
                }
                self.dispatch(&b, plan).map(|_| ())
            });
        match started {
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
                            let queued = if c.parts.is_empty() {
                                stream.2.copy(it.local_addr + c.off, s.addr, c.len)
                            } else {
                                stream.2.copy_list(&job.local_copies(c, s.addr, false))
                            };
                            c.stream = Some(stream);
                            queued?;
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
                    if let Err(e) = &r {
                        if c.parts.len() > 1 && e.code == ErrorCode::OutOfBounds {
                            // Refused whole, nothing touched: each request
                            // goes again alone, so only the bad ones fail.
                            if !job.said_alone {
                                job.said_alone = true;
                                log::info!(
                                    "{}: the peer refused a packed staging run ({e}); its {} \
                                     requests are sent again one by one",
                                    it.segment.name,
                                    c.parts.len()
                                );
                            }
                            c.alone = true;
                            return Ok(true);
                        }
                    }
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
                for i in c.items() {
                    job.errors[i].get_or_insert(e.clone());
                }
                c.phase = Phase::Done;
                true
            }
        }
    }

    /// Gives a finished chunk's slots back and counts it.
    fn retire(&self, job: &mut Job<'_>, c: Chunk, result: Result<()>) {
        let items: Vec<usize> = c.items().collect();
        let alone = c.alone;
        self.release_chunk(job, c);
        for i in items {
            if alone {
                job.alone.insert(i);
                job.requeue.push(i);
            } else {
                job.finish(i, result.clone());
            }
        }
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
    /// Requests that go alone, never packed (their packed run was refused).
    alone: HashSet<usize>,
    /// Peers this job could not open a staging session with, and why.
    no_session: HashMap<SegmentId, Error>,
    /// Requests to send again, alone, at the front of the queue.
    requeue: Vec<usize>,
    said_alone: bool,
}

impl Chunk {
    /// The requests this chunk carries (one, or a packed run's).
    fn items(&self) -> impl Iterator<Item = usize> + '_ {
        let single = self.parts.is_empty().then_some(self.item);
        single.into_iter().chain(self.parts.iter().map(|p| p.item))
    }
}

impl Job<'_> {
    /// The session with `segment`'s peer for this job, opened on first use.
    fn lease(&mut self, shared: &Shared, segment: &Arc<RemoteSegment>) -> Result<&StagingLease> {
        let seg = segment.id;
        if let Some(e) = self.no_session.get(&seg) {
            // Asked once per job: thousands of small requests to a peer
            // that is down must not each wait out a connection attempt.
            return Err(e.clone());
        }
        if !self.leases.contains_key(&seg) {
            let lease = shared.remote_staging(segment).inspect_err(|e| {
                self.no_session.insert(seg, e.clone());
            })?;
            let (unit, _) = slot_geometry(shared.staging.chunk);
            self.free_remote
                .insert(seg, Space::new(lease.view().buffers.len(), unit));
            self.leases.insert(seg, lease);
        }
        self.leases
            .get(&seg)
            .ok_or_else(|| Error::new(ErrorCode::Internal, "a staging session vanished"))
    }

    /// A packed run's copies between local device memory and the local
    /// slot at `slot`: the gather (`into_slot`) or the scatter.
    fn local_copies(&self, c: &Chunk, slot: u64, into_slot: bool) -> Vec<ferry_device_copy_t> {
        c.parts
            .iter()
            .map(|p| {
                let device = self.items[p.item].local_addr;
                let (src, dst) = if into_slot {
                    (device, slot + p.at)
                } else {
                    (slot + p.at, device)
                };
                ferry_device_copy_t {
                    src,
                    dst,
                    len: p.len,
                }
            })
            .collect()
    }

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
        if c.parts.is_empty() {
            lease.send_copy(to_device, slot, c.len, it.remote_addr + c.off)?;
        } else {
            let pieces = c
                .parts
                .iter()
                .map(|p| ListPiece {
                    slot_offset: slot.offset + p.at,
                    device_addr: self.items[p.item].remote_addr,
                    len: p.len,
                })
                .collect();
            lease.send_copy_list(&CopyListRequest {
                to_device,
                slot: slot.slot,
                pieces,
            })?;
        }
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
