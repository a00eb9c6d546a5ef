//! A staging job: staged requests cut into chunks, each moved through its
//! phases (device copy, host transfer, the peer's device copy), up to
//! `depth` chunks in flight.

use super::initiator::StagingLease;
use super::slots::{slot_geometry, LocalSlot, Piece, SlotPool, Space};
use crate::batch::{Batch, BatchId};
use crate::device::Stream;
use crate::engine::plan::StagedItem;
use crate::engine::request::{Op, Request, SegmentId};
use crate::engine::shared::Shared;
use crate::error::{Error, ErrorCode, Result};
use crate::location::Location;
use crate::memory::LocalBuffer;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;
use std::time::Instant;

/// Most chunks of one job in flight (small requests share slots).
const MAX_INFLIGHT: usize = 64;

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
