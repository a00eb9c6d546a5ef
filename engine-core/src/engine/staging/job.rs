//! A staging job: staged requests cut into chunks, each moved through its
//! phases (device copy, host transfer, the peer's device copy), up to
//! `depth` chunks in flight.
//!
//! Small device-to-device requests to one peer are packed: many of them
//! share one chunk (a packed run in one slot), gathered by one list copy
//! on the local device, sent as one host transfer, and scattered by one
//! list copy on the peer's (StageCopyList); reads the other way round.
//!
//! Reaches in Shared: `batches`, `config`, `staging`.

use super::initiator::{StagingLease, SESSIONS};
use super::mover::{self, Mover};
use super::protocol::{CopyListRequest, ListPiece, MAX_LIST_PIECES};
use super::slots::{slot_geometry, LocalSlot, Piece, SlotPool, Space};
use super::steps::{self, pack_key, Groups, Leg, Legs, Part, Replies, Spent, Tally};
use crate::batch::{Batch, BatchId};
use crate::device::Stream;
use crate::engine::plan::StagedWork;
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
/// A job's session with a peer: the peer's segment, and which session.
type Session = (SegmentId, usize);
/// What a chunk's current leg is doing.
enum Phase {
    /// A copy between device memory and the local slot is queued.
    Copying,
    /// The host transfer runs in this internal batch, dispatched on the
    /// job's thread (0) or as the mover's leg of this number.
    Moving(BatchId, u64),
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
    /// Room in the peer's slots, in the job's session `session`.
    remote_slot: Option<Piece>,
    session: usize,
    stream: Option<(usize, u32, Stream)>,
    /// Its legs (steps::legs), and how many have started.
    legs: Legs,
    started: usize,
    phase: Phase,
}

impl Shared {
    /// Runs staged requests to the end and completes their groups.
    ///
    /// Up to `depth` chunks are in flight, each at its own phase: while the
    /// oldest chunk's host transfer runs, the next chunks' device copies
    /// run on their own streams and the peer copies the previous chunks
    /// into device memory. The thread blocks only when no chunk can move.
    ///
    /// Host legs of a job of more than one chunk are dispatched on a
    /// thread of the job's own (mover.rs); those of a one-chunk job, which
    /// have nothing to overlap, and any where that thread cannot start,
    /// on this one.
    pub(crate) fn run_staged(self: Arc<Self>, batch: Arc<Batch>, items: StagedWork) {
        let bytes: u64 = items.blocks.iter().map(|b| b.length).sum();
        if bytes <= self.staging.chunk {
            return self.run_job(&batch, (&items, bytes), None);
        }
        let (mover, legs) = Mover::new();
        std::thread::scope(|s| {
            let spawned = std::thread::Builder::new()
                .name("ferry-stage-legs".into())
                .spawn_scoped(s, || mover.run(&self, legs));
            if let Err(e) = &spawned {
                log::debug!("staging host legs run on the job's thread: {e}");
            }
            self.run_job(&batch, (&items, bytes), spawned.is_ok().then_some(&mover));
            mover.close();
        });
    }

    /// `bytes`: what `items` move in all.
    fn run_job(
        self: &Arc<Self>,
        batch: &Batch,
        (items, bytes): (&StagedWork, u64),
        mover: Option<&Mover>,
    ) {
        let chunk = self.staging.chunk;
        let mut job = Job {
            items,
            mover,
            tally: Tally::new(items.blocks.iter().map(|b| b.length.div_ceil(chunk))),
            groups: Groups::new(items.blocks.iter().map(|b| b.group)),
            said_alone: false,
            batch,
            bytes,
            leases: HashMap::new(),
            sessions: HashMap::new(),
            next_session: 0,
            free_remote: HashMap::new(),
            replies: Replies::new(),
            alone: HashSet::new(),
            no_session: HashMap::new(),
            requeue: Vec::new(),
            spent: Spent::default(),
        };
        let began = Instant::now();
        let mut pending = items
            .blocks
            .iter()
            .enumerate()
            .flat_map(|(i, it)| steps::chunk_offsets(it.length, chunk).map(move |off| (i, off)))
            .collect::<VecDeque<_>>();
        let mut inflight: VecDeque<Chunk> = VecDeque::new();
        let mut idle_since: Option<Instant> = None;
        // The packed run at the front of `pending` that found no free slot,
        // kept until a slot frees, so 512 blocks are not packed again on
        // every turn of the loop. Chunks moving do not change it: a packed
        // request has one chunk, still pending, so nothing in flight can
        // fail it or send it alone; only requests put back at the front
        // (requeue) make the front another run.
        let mut packed: Option<Vec<Part>> = None;
        let pool = if items.ends.iter().any(|e| e.local.device.is_some()) {
            match self.local_slots() {
                Ok(p) => Some(p),
                Err(e) => {
                    for i in 0..items.blocks.len() {
                        for _ in 0..job.tally.remaining(i) {
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
            let admitting = Instant::now();
            while inflight.len() < MAX_INFLIGHT {
                let Some(&(i, off)) = pending.front() else {
                    break;
                };
                if job.tally.failed(i) {
                    packed = None;
                    pending.pop_front();
                    job.finish(i, Ok(()));
                    continue;
                }
                let mut parts = match packed.take() {
                    Some(parts) => parts,
                    None => {
                        let packing = Instant::now();
                        let parts = self.pack(&mut job, &pending);
                        job.spent.pack += packing.elapsed();
                        match parts {
                            Ok(parts) => parts,
                            Err(e) => {
                                pending.pop_front();
                                job.finish(i, Err(e));
                                continue;
                            }
                        }
                    }
                };
                let taken = parts.len().max(1);
                match self.admit(
                    &mut job,
                    pool.as_ref(),
                    i,
                    off,
                    &mut parts,
                    inflight.is_empty(),
                ) {
                    Ok(Some(c)) => {
                        pending.drain(..taken);
                        inflight.push_back(c);
                        job.spent.chunks += 1;
                    }
                    Ok(None) => {
                        packed = Some(parts);
                        break;
                    }
                    Err(e) => {
                        for (i, _) in pending.drain(..taken) {
                            job.finish(i, Err(e.clone()));
                        }
                    }
                }
            }
            job.spent.admit += admitting.elapsed();
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
            let retiring = Instant::now();
            while let Some(pos) = inflight.iter().position(|c| matches!(c.phase, Phase::Done)) {
                if let Some(c) = inflight.remove(pos) {
                    self.retire(&mut job, c, Ok(()));
                }
            }
            job.spent.retire += retiring.elapsed();
            for i in job.requeue.drain(..).rev() {
                packed = None;
                pending.push_front((i, 0));
            }
        }
        if log::log_enabled!(log::Level::Debug) {
            log::debug!(
                "{}",
                job.spent
                    .describe(items.blocks.len(), bytes, began.elapsed())
            );
        }
    }

    /// The requests at the front of `pending` that go as one packed run:
    /// two or more whole small device-to-device requests to one peer that
    /// takes lists, from one local device, in one direction, that fit a
    /// chunk together (steps::pack). Empty when the front request goes
    /// alone.
    fn pack(&self, job: &mut Job<'_>, pending: &VecDeque<(usize, u64)>) -> Result<Vec<Part>> {
        let chunk = self.staging.chunk;
        let items = job.items;
        let packable = |job: &Job<'_>, i: usize, off: u64| {
            let (b, e) = items.get(i);
            off == 0
                && b.length < chunk
                && e.local.device.is_some()
                && e.remote_on_device
                && !job.tally.failed(i)
                && (job.alone.is_empty() || !job.alone.contains(&i))
        };
        let Some(&(first, off)) = pending.front() else {
            return Ok(Vec::new());
        };
        if !packable(job, first, off)
            || !job.lease(self, &items.ends_of(first).segment)?.copy_list()
        {
            return Ok(Vec::new());
        }
        let lead_ends = items.blocks[first].ends;
        let lead_key = pack_key(items.ends_of(first));
        Ok(steps::pack(
            pending.iter().copied(),
            chunk,
            MAX_LIST_PIECES,
            |i, off| {
                let (b, e) = items.get(i);
                // The blocks of one run share their ends: nothing to
                // compare field by field (the front's own key is true).
                packable(job, i, off)
                    .then(|| (b.ends == lead_ends || pack_key(e) == lead_key, b.length))
            },
        ))
    }

    /// Starts one chunk: takes its slots and queues its first step. None
    /// when a slot is not free and `may_wait` is false.
    fn admit(
        self: &Arc<Self>,
        job: &mut Job<'_>,
        pool: Option<&Arc<SlotPool>>,
        i: usize,
        off: u64,
        parts: &mut Vec<Part>,
        may_wait: bool,
    ) -> Result<Option<Chunk>> {
        let items = job.items;
        let (b, it) = items.get(i);
        let len = match parts.last() {
            Some(p) => p.at + p.len,
            None => self.staging.chunk.min(b.length - off),
        };
        let local_slot = match (it.local.device, pool) {
            (Some(_), Some(p)) => match p.take(len, may_wait) {
                Some(s) => Some(s),
                None => return Ok(None),
            },
            _ => None,
        };
        let (remote_slot, session) = if it.remote_on_device {
            job.lease(self, &it.segment)?;
            match job.take_remote(it.segment.id, len) {
                Some((piece, session)) => (Some(piece), session),
                None => return Ok(None),
            }
        } else {
            (None, 0)
        };
        let mut c = Chunk {
            item: i,
            off,
            len,
            parts: std::mem::take(parts),
            alone: false,
            legs: steps::legs(it.op, local_slot.is_some(), remote_slot.is_some()),
            started: 0,
            local_slot,
            remote_slot,
            session,
            stream: None,
            phase: Phase::Done,
        };
        match self.start_leg(job, &mut c) {
            Ok(()) => Ok(Some(c)),
            Err(e) => {
                self.release_chunk(job, c);
                Err(e)
            }
        }
    }

    /// Starts the chunk's next leg; Done after its last.
    fn start_leg(self: &Arc<Self>, job: &mut Job<'_>, c: &mut Chunk) -> Result<()> {
        let t = Instant::now();
        let started = self.start_next_leg(job, c);
        job.spent.start += t.elapsed();
        started
    }

    fn start_next_leg(self: &Arc<Self>, job: &mut Job<'_>, c: &mut Chunk) -> Result<()> {
        let Some(&leg) = c.legs.get(c.started) else {
            c.phase = Phase::Done;
            return Ok(());
        };
        c.started += 1;
        let items = job.items;
        let (b, it) = items.get(c.item);
        let outward = it.op == Op::Write;
        c.phase = match leg {
            Leg::LocalCopy => {
                let slot = c.local_slot.as_ref().map(|s| s.addr).ok_or_else(|| {
                    Error::new(ErrorCode::Internal, "a staged chunk without a local slot")
                })?;
                let mut stream = self.stream_for(&it.local)?;
                let t = Instant::now();
                let queued = if c.parts.is_empty() {
                    let device = b.local_addr + c.off;
                    let (dst, src) = if outward {
                        (slot, device)
                    } else {
                        (device, slot)
                    };
                    stream.2.copy(dst, src, c.len)
                } else {
                    stream.2.copy_list(&job.local_copies(c, slot, outward))
                };
                job.spent.queue_local += t.elapsed();
                c.stream = Some(stream);
                queued?;
                Phase::Copying
            }
            Leg::Host => {
                let (id, leg) = self.start_move(job, c)?;
                Phase::Moving(id, leg)
            }
            Leg::PeerCopy => {
                job.send_copy(c, outward)?;
                Phase::Remote
            }
        };
        Ok(())
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
    /// Its batch, and its number on the mover (0: dispatched here).
    fn start_move(self: &Arc<Self>, job: &Job<'_>, c: &Chunk) -> Result<(BatchId, u64)> {
        let (b, it) = job.items.get(c.item);
        let local = c
            .local_slot
            .as_ref()
            .map_or(b.local_addr + c.off, |s| s.addr);
        let (remote, view) = match c.remote_slot {
            Some(slot) => {
                let lease = job.leases.get(&(it.segment.id, c.session)).ok_or_else(|| {
                    Error::new(ErrorCode::Internal, "a staged chunk lost its session")
                })?;
                let view = lease.view().clone();
                (view.buffers[slot.slot].addr + slot.offset, Some(view))
            }
            None => (b.remote_addr + c.off, None),
        };
        let b = self.batches.allocate(1)?;
        let mut r = Request::new(it.op, local, it.segment.id, remote, c.len);
        r.transport = it.transport.clone();
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
                mover::start(self, job.mover, &b, plan)
            });
        match started {
            Ok(n) => Ok((b.id, n)),
            Err(e) => {
                let _ = self.batches.free(b.id);
                Err(e)
            }
        }
    }

    /// Moves a chunk one phase on. Without `block`, only when that needs no
    /// waiting. Returns whether it moved.
    fn advance(self: &Arc<Self>, job: &mut Job<'_>, c: &mut Chunk, block: bool) -> bool {
        let step = (|| -> Result<bool> {
            match c.phase {
                Phase::Copying => {
                    // Polled while other chunks can move (a gather in
                    // flight must not hold up the host legs and the
                    // peer's copies around it); waited for otherwise.
                    if let Some(s) = c.stream.as_mut() {
                        let t = Instant::now();
                        let finished = match block {
                            true => s.2.sync().map(|()| true),
                            false => s.2.query(),
                        };
                        job.spent.device += t.elapsed();
                        if !finished? {
                            return Ok(false);
                        }
                    }
                    if let Some(s) = c.stream.take() {
                        self.give_stream(s);
                    }
                }
                Phase::Moving(id, leg) => {
                    let b = self.batches.get(id)?;
                    let t = Instant::now();
                    let waited = mover::leg_status(self, job.mover, &b, leg, block);
                    if block {
                        job.spent.host += t.elapsed();
                    }
                    let status = match waited {
                        Ok(Some(status)) => status,
                        Ok(None) => return Ok(false),
                        Err(e) => {
                            let _ = self.batches.free(id);
                            c.phase = Phase::Done;
                            return Err(e);
                        }
                    };
                    let _ = self.batches.free(id);
                    c.phase = Phase::Done;
                    if let Some((_, e)) = status.first_error {
                        return Err(e);
                    }
                }
                Phase::Remote => {
                    let t = block.then(Instant::now);
                    let reply = job.reply_for(c, block);
                    if let Some(t) = t {
                        job.spent.peer += t.elapsed();
                    }
                    let Some(r) = reply else {
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
                                    job.items.ends_of(c.item).segment.name,
                                    c.parts.len()
                                );
                            }
                            c.alone = true;
                            return Ok(true);
                        }
                    }
                    r?;
                }
                Phase::Done => return Ok(false),
            }
            self.start_leg(job, c)?;
            Ok(true)
        })();
        match step {
            Ok(moved) => moved,
            Err(e) => {
                for i in c.items() {
                    job.tally.fail(i, e.clone());
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
            let seg = job.items.ends_of(c.item).segment.id;
            if let Some(f) = job.free_remote.get_mut(&(seg, c.session)) {
                f.give(slot);
            }
        }
    }
}

/// The state of one staging job (one thread).
struct Job<'a> {
    items: &'a StagedWork,
    /// Where host legs are dispatched, when not on the job's thread.
    mover: Option<&'a Mover>,
    /// Per request, chunks left and its first error.
    tally: Tally,
    /// The requests' completion groups (shared by a staged run's).
    groups: Groups,
    batch: &'a Batch,
    /// Bytes the whole job moves.
    bytes: u64,
    /// The sessions used with each peer, for the whole job.
    leases: HashMap<Session, StagingLease>,
    /// How many sessions each peer lent this job (SESSIONS, or fewer).
    sessions: HashMap<SegmentId, usize>,
    /// The session the next chunk tries first (chunks alternate).
    next_session: usize,
    free_remote: HashMap<Session, Space>,
    /// The peers' replies to copy requests, matched to chunks.
    replies: Replies<Session, (usize, u64)>,
    /// Requests that go alone, never packed (their packed run was refused).
    alone: HashSet<usize>,
    /// Peers this job could not open a staging session with, and why.
    no_session: HashMap<SegmentId, Error>,
    /// Requests to send again, alone, at the front of the queue.
    requeue: Vec<usize>,
    said_alone: bool,
    spent: Spent,
}

impl Chunk {
    /// The requests this chunk carries (one, or a packed run's).
    fn items(&self) -> impl Iterator<Item = usize> + '_ {
        let single = self.parts.is_empty().then_some(self.item);
        single.into_iter().chain(self.parts.iter().map(|p| p.item))
    }
}

impl Job<'_> {
    /// The first session with `segment`'s peer for this job, its sessions
    /// opened on first use: SESSIONS for a job of SESSIONS windows or more
    /// (depth x chunk each), each lent its share of the depth's slots,
    /// else one lent them all (a peer that lends only the first of several
    /// serves the job on it alone).
    fn lease(&mut self, shared: &Shared, segment: &Arc<RemoteSegment>) -> Result<&StagingLease> {
        let seg = segment.id;
        if let Some(e) = self.no_session.get(&seg) {
            // Asked once per job: thousands of small requests to a peer
            // that is down must not each wait out a connection attempt.
            return Err(e.clone());
        }
        if !self.sessions.contains_key(&seg) {
            let (unit, _) = slot_geometry(shared.staging.chunk);
            let window = shared.staging.depth as u64 * shared.staging.chunk;
            let wanted = match self.bytes >= SESSIONS as u64 * window {
                true => SESSIONS,
                false => 1,
            };
            let slots = shared.staging.depth.div_ceil(wanted);
            let mut opened = 0;
            for k in 0..wanted {
                match shared.remote_staging_of(segment, slots) {
                    Ok(lease) => {
                        let space = Space::new(lease.view().buffers.len(), unit);
                        self.free_remote.insert((seg, k), space);
                        self.leases.insert((seg, k), lease);
                        opened += 1;
                    }
                    Err(e) if k == 0 => {
                        self.no_session.insert(seg, e.clone());
                        return Err(e);
                    }
                    Err(e) => {
                        log::debug!("{}: one staging session only ({e})", segment.name);
                        break;
                    }
                }
            }
            log::debug!(
                "{}: {opened} staging session(s) of {slots} slots for a job of {} bytes",
                segment.name,
                self.bytes
            );
            self.sessions.insert(seg, opened);
        }
        self.leases
            .get(&(seg, 0))
            .ok_or_else(|| Error::new(ErrorCode::Internal, "a staging session vanished"))
    }

    /// Room for `len` bytes in the peer's slots, in the session after the
    /// last one used that has it: the piece and its session.
    fn take_remote(&mut self, seg: SegmentId, len: u64) -> Option<(Piece, usize)> {
        let n = self.sessions.get(&seg).copied().unwrap_or(0);
        (0..n).find_map(|k| {
            let s = (self.next_session + k) % n;
            let piece = self.free_remote.get_mut(&(seg, s))?.take(len)?;
            self.next_session = s + 1;
            Some((piece, s))
        })
    }

    /// A packed run's copies between local device memory and the local
    /// slot at `slot`: the gather (`into_slot`) or the scatter.
    fn local_copies(&self, c: &Chunk, slot: u64, into_slot: bool) -> Vec<ferry_device_copy_t> {
        c.parts
            .iter()
            .map(|p| {
                let device = self.items.blocks[p.item].local_addr;
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
        let Some(result) = self.tally.finish(i, r) else {
            return;
        };
        let b = &self.items.blocks[i];
        // A block of a list fails its own requests; its group goes on.
        let result = match (result, b.requests) {
            (Err(e), (first, n)) if n > 0 => {
                let (first, n) = (first as usize, n as usize);
                self.batch.fail_within(b.group, first, n, b.length, e);
                Ok(())
            }
            (result, _) => result,
        };
        if let Some((group, result)) = self.groups.finish(i, result) {
            self.batch.complete_group(group, result);
        }
    }

    /// Asks the peer to copy between its slot and its device memory for
    /// chunk `c`.
    fn send_copy(&mut self, c: &Chunk, to_device: bool) -> Result<()> {
        let items = self.items;
        let (b, it) = items.get(c.item);
        let seg = it.segment.id;
        let slot = c
            .remote_slot
            .ok_or_else(|| Error::new(ErrorCode::Internal, "a staged chunk without a slot"))?;
        let lease = self
            .leases
            .get_mut(&(seg, c.session))
            .ok_or_else(|| Error::new(ErrorCode::Internal, "a staged chunk lost its session"))?;
        if c.parts.is_empty() {
            lease.send_copy(to_device, slot, c.len, b.remote_addr + c.off)?;
        } else {
            let pieces = c
                .parts
                .iter()
                .map(|p| ListPiece {
                    slot_offset: slot.offset + p.at,
                    device_addr: self.items.blocks[p.item].remote_addr,
                    len: p.len,
                })
                .collect();
            lease.send_copy_list(&CopyListRequest {
                to_device,
                slot: slot.slot,
                pieces,
            })?;
        }
        self.replies.sent((seg, c.session), (c.item, c.off));
        Ok(())
    }

    /// The reply to chunk `c`'s copy request, reading replies in order
    /// until it comes; None when `block` is false and none is ready.
    fn reply_for(&mut self, c: &Chunk, block: bool) -> Option<Result<()>> {
        let key = (c.item, c.off);
        let seg = (self.items.ends_of(c.item).segment.id, c.session);
        loop {
            if let Some(r) = self.replies.take(key) {
                return Some(r);
            }
            let Some(lease) = self.leases.get_mut(&seg) else {
                return Some(Err(Error::new(
                    ErrorCode::Internal,
                    "a staged chunk lost its session",
                )));
            };
            if !self.replies.awaiting(seg) {
                return Some(Err(Error::new(
                    ErrorCode::Internal,
                    "a staged chunk awaits a reply to nothing",
                )));
            }
            if !block && !lease.reply_ready() {
                return None;
            }
            let r = lease
                .recv_copy()
                .map(|done| self.spent.peer_reported(&done));
            if let Err(e) = self.replies.read(seg, r, lease.broken) {
                return Some(Err(e));
            }
        }
    }
}
