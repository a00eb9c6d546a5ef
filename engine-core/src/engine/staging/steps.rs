//! The rules of a staging job, with no I/O: the legs a chunk takes, which
//! small requests share a packed run, when a request is complete, and
//! which chunk a peer's in-order reply belongs to. job.rs runs them
//! against streams, transports and the peer; the tests here check them
//! alone.

use super::protocol::CopyDone;
use crate::engine::plan::StagedEnds;
use crate::engine::request::{Op, SegmentId};
use crate::error::{Error, ErrorCode, Result};
use crate::location::Location;
use smallvec::SmallVec;
use std::collections::{HashMap, VecDeque};
use std::time::Duration;

/// Where each request starts in a packed run: aligned for the copy
/// kernel's wide loads and stores.
pub(super) const PACK_ALIGN: u64 = 256;

/// One leg of a chunk's way.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Leg {
    /// Between local device memory and the local slot, on a local stream.
    LocalCopy,
    /// Between the hosts, by a host transport (slot or host buffer at
    /// each end).
    Host,
    /// The peer copies between its slot and its device memory.
    PeerCopy,
}

/// A chunk's legs, in order.
pub(super) type Legs = SmallVec<[Leg; 3]>;

/// The legs of a chunk: a write leaves the local device first and reaches
/// the peer's device last; a read goes the other way round. A side whose
/// memory is host memory has no slot and no copy.
pub(super) fn legs(op: Op, local_slot: bool, peer_slot: bool) -> Legs {
    let mut legs = Legs::new();
    let (first, last) = match op {
        Op::Write => ((local_slot, Leg::LocalCopy), (peer_slot, Leg::PeerCopy)),
        Op::Read => ((peer_slot, Leg::PeerCopy), (local_slot, Leg::LocalCopy)),
    };
    if first.0 {
        legs.push(first.1);
    }
    legs.push(Leg::Host);
    if last.0 {
        legs.push(last.1);
    }
    legs
}

/// The chunks of a request of `length` bytes: their offsets.
pub(super) fn chunk_offsets(length: u64, chunk: u64) -> impl Iterator<Item = u64> {
    (0..length.div_ceil(chunk)).map(move |k| k * chunk)
}

/// One whole small request in a packed run: `len` bytes of item `item`,
/// at `at` in the run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Part {
    pub(super) item: usize,
    pub(super) len: u64,
    pub(super) at: u64,
}

/// The requests at the front of the queue that go as one packed run: at
/// most `max` whole requests, each `packable` (its length and a key: one
/// peer, one direction, one local device), all with the front one's key,
/// that fit `chunk` bytes together at [`PACK_ALIGN`]. Empty when fewer
/// than two would share it: the front request then goes alone.
pub(super) fn pack<K: PartialEq>(
    front: impl IntoIterator<Item = (usize, u64)>,
    chunk: u64,
    max: usize,
    packable: impl Fn(usize, u64) -> Option<(K, u64)>,
) -> Vec<Part> {
    let mut parts = Vec::with_capacity(max.min(1024));
    let mut lead = None;
    let mut end = 0u64;
    for (item, off) in front.into_iter().take(max) {
        let Some((key, len)) = packable(item, off) else {
            break;
        };
        if off != 0 || len >= chunk {
            break;
        }
        match &lead {
            None => lead = Some(key),
            Some(k) if *k != key => break,
            Some(_) => {}
        }
        let at = end.next_multiple_of(PACK_ALIGN);
        if at + len > chunk {
            break;
        }
        parts.push(Part { item, len, at });
        end = at + len;
    }
    if parts.len() < 2 {
        parts.clear();
    }
    parts
}

/// What the requests of one packed run share: one peer, one direction,
/// one local device and transport.
pub(super) fn pack_key(e: &StagedEnds) -> (SegmentId, Op, Option<usize>, Location, Option<&str>) {
    (
        e.segment.id,
        e.op,
        e.local.device,
        e.local.location,
        e.transport.as_deref(),
    )
}

/// Per request, its chunks still to finish and its first error; a request
/// completes when its last chunk does, with that error if any.
pub(super) struct Tally {
    remaining: Vec<u64>,
    /// First errors by request: few, so kept apart (an error per request
    /// of 16,384 would be half a megabyte to clear per job).
    errors: HashMap<usize, Error>,
}

impl Tally {
    /// `chunks[i]`: how many chunks request `i` is cut into.
    pub(super) fn new(chunks: impl IntoIterator<Item = u64>) -> Tally {
        Tally {
            remaining: chunks.into_iter().collect(),
            errors: HashMap::new(),
        }
    }

    /// How many chunks request `i` has left.
    pub(super) fn remaining(&self, i: usize) -> u64 {
        self.remaining[i]
    }

    /// Whether request `i` has failed already (its later chunks need not
    /// move).
    pub(super) fn failed(&self, i: usize) -> bool {
        !self.errors.is_empty() && self.errors.contains_key(&i)
    }

    /// Records that request `i` failed, unless it had already.
    pub(super) fn fail(&mut self, i: usize, e: Error) {
        self.errors.entry(i).or_insert(e);
    }

    /// One chunk of request `i` ended with `r`. The request's result once
    /// that was its last chunk; None while chunks remain (or after it
    /// completed: a chunk counted twice is not counted again).
    pub(super) fn finish(&mut self, i: usize, r: Result<()>) -> Option<Result<()>> {
        if let Err(e) = r {
            self.fail(i, e);
        }
        if self.remaining[i] == 0 {
            return None;
        }
        self.remaining[i] -= 1;
        if self.remaining[i] != 0 {
            return None;
        }
        // Hashing `i` costs more than the rest of a block's completion:
        // only when some request failed.
        Some(match self.errors.is_empty() {
            true => Ok(()),
            false => self.errors.remove(&i).map_or(Ok(()), Err),
        })
    }
}

/// The completion groups of a job's requests: many requests may share one
/// (a staged run by layouts completes once), which then completes once,
/// when its last request does, failed if any failed.
pub(super) struct Groups {
    /// Per group: its id in the batch, requests left, first error.
    groups: Vec<(usize, usize, Option<Error>)>,
    /// Per request, its group's index in `groups`.
    of: Vec<usize>,
}

impl Groups {
    /// The groups of requests whose groups are `ids`, in order (a run's
    /// requests are adjacent, so mostly no lookup is needed).
    pub(super) fn new(ids: impl ExactSizeIterator<Item = usize>) -> Groups {
        let mut groups: Vec<(usize, usize, Option<Error>)> = Vec::new();
        let mut of = Vec::with_capacity(ids.len());
        let mut index: HashMap<usize, usize> = HashMap::new();
        for id in ids {
            let k = match groups.last() {
                Some(g) if g.0 == id => groups.len() - 1,
                _ => *index.entry(id).or_insert_with(|| {
                    groups.push((id, 0, None));
                    groups.len() - 1
                }),
            };
            groups[k].1 += 1;
            of.push(k);
        }
        Groups { groups, of }
    }

    /// Request `i` ended with `r`: its group's id and result once that was
    /// the group's last request.
    pub(super) fn finish(&mut self, i: usize, r: Result<()>) -> Option<(usize, Result<()>)> {
        let g = self.groups.get_mut(*self.of.get(i)?)?;
        if let Err(e) = r {
            g.2.get_or_insert(e);
        }
        g.1 = g.1.checked_sub(1)?;
        (g.1 == 0).then(|| (g.0, g.2.take().map_or(Ok(()), Err)))
    }
}

/// A peer answers copy requests in the order it got them, on each of its
/// sessions; chunks look for their replies in any order. `P` names a
/// session with a peer, `K` a chunk.
pub(super) struct Replies<P, K> {
    /// Per session, the chunks whose requests await replies, oldest first.
    awaiting: HashMap<P, VecDeque<K>>,
    /// Replies read for chunks that were not being looked at.
    ready: HashMap<K, Result<()>>,
}

impl<P: std::hash::Hash + Eq + Copy, K: std::hash::Hash + Eq + Copy> Replies<P, K> {
    pub(super) fn new() -> Replies<P, K> {
        Replies {
            awaiting: HashMap::new(),
            ready: HashMap::new(),
        }
    }

    /// Chunk `key` sent a request to `peer`.
    pub(super) fn sent(&mut self, peer: P, key: K) {
        self.awaiting.entry(peer).or_default().push_back(key);
    }

    /// Whether any chunk awaits a reply from `peer`.
    pub(super) fn awaiting(&self, peer: P) -> bool {
        self.awaiting.get(&peer).is_some_and(|q| !q.is_empty())
    }

    /// Chunk `key`'s reply, if it was read.
    pub(super) fn take(&mut self, key: K) -> Option<Result<()>> {
        self.ready.remove(&key)
    }

    /// The next reply from `peer` was read: it is the oldest awaiting
    /// chunk's. When the connection `broke`, no later reply will come:
    /// every chunk still awaiting one gets the same error.
    pub(super) fn read(&mut self, peer: P, r: Result<()>, broke: bool) -> Result<()> {
        let queue = self.awaiting.entry(peer).or_default();
        let Some(front) = queue.pop_front() else {
            return Err(Error::new(
                ErrorCode::Internal,
                "a staging peer replied to nothing asked",
            ));
        };
        if let (Err(e), true) = (&r, broke) {
            for k in queue.drain(..) {
                self.ready.insert(k, Err(e.clone()));
            }
        }
        self.ready.insert(front, r);
        Ok(())
    }
}

/// Where a staging job's time went: one debug line at its end, so that an
/// operator (or a benchmark) sees which leg holds small blocks back.
#[derive(Debug, Default)]
pub(super) struct Spent {
    /// Admitting chunks: packing, taking slots, starting the first leg.
    pub(super) admit: Duration,
    /// Of which packing requests into runs.
    pub(super) pack: Duration,
    /// Waiting for local device copies (gathers and scatters).
    pub(super) device: Duration,
    /// Waiting for host legs.
    pub(super) host: Duration,
    /// Waiting for the peer's device copies.
    pub(super) peer: Duration,
    /// Completing requests and giving slots back.
    pub(super) retire: Duration,
    /// Starting legs (inside admitting for a chunk's first, else inside
    /// polling): queuing device copies, submitting host legs, sending
    /// the peer its copy requests.
    pub(super) start: Duration,
    /// Of which queuing local device copies (the device plugin's calls).
    pub(super) queue_local: Duration,
    pub(super) chunks: usize,
    /// What the peer said its copies took (StageDone): checking, queuing,
    /// waiting for its device.
    pub(super) peer_check: Duration,
    pub(super) peer_queue: Duration,
    pub(super) peer_wait: Duration,
}

impl Spent {
    /// Adds what the peer reported for one copy request.
    /// The peer's numbers are its own: summed saturating, so that no
    /// reply can make the account overflow.
    pub(super) fn peer_reported(&mut self, done: &CopyDone) {
        let us = Duration::from_micros;
        self.peer_check = self.peer_check.saturating_add(us(done.check_us));
        self.peer_queue = self.peer_queue.saturating_add(us(done.queue_us));
        self.peer_wait = self.peer_wait.saturating_add(us(done.wait_us));
    }

    /// The line: `requests` requests of `bytes` in `total`.
    pub(super) fn describe(&self, requests: usize, bytes: u64, total: Duration) -> String {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let named = self.admit + self.device + self.host + self.peer + self.retire;
        format!(
            "staging job: {requests} requests, {bytes} bytes in {} chunks, {:.2} ms: admitting \
             {:.2} ms (packing {:.2} ms), waiting for local device copies {:.2} ms, for host \
             legs {:.2} ms, for the peer's device copies {:.2} ms, completions {:.2} ms, \
             polling {:.2} ms; starting legs took {:.2} ms of these (queuing local device copies \
             {:.2} ms); the peer: checking {:.2} ms, queuing {:.2} ms, waiting for its device \
             {:.2} ms",
            self.chunks,
            ms(total),
            ms(self.admit),
            ms(self.pack),
            ms(self.device),
            ms(self.host),
            ms(self.peer),
            ms(self.retire),
            ms(total.saturating_sub(named)),
            ms(self.start),
            ms(self.queue_local),
            ms(self.peer_check),
            ms(self.peer_queue),
            ms(self.peer_wait),
        )
    }
}

#[cfg(test)]
#[path = "steps_tests.rs"]
mod tests;
