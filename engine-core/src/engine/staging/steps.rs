//! The rules of a staging job, with no I/O: the legs a chunk takes, which
//! small requests share a packed run, when a request is complete, and
//! which chunk a peer's in-order reply belongs to. job.rs runs them
//! against streams, transports and the peer; the tests here check them
//! alone.

use crate::engine::request::{Op, SegmentId};
use crate::error::{Error, ErrorCode, Result};
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
    let mut parts = Vec::new();
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

/// Per request, its chunks still to finish and its first error; a request
/// completes when its last chunk does, with that error if any.
pub(super) struct Tally {
    remaining: Vec<u64>,
    errors: Vec<Option<Error>>,
}

impl Tally {
    /// `chunks[i]`: how many chunks request `i` is cut into.
    pub(super) fn new(chunks: impl IntoIterator<Item = u64>) -> Tally {
        let remaining: Vec<u64> = chunks.into_iter().collect();
        let errors = remaining.iter().map(|_| None).collect();
        Tally { remaining, errors }
    }

    /// How many chunks request `i` has left.
    pub(super) fn remaining(&self, i: usize) -> u64 {
        self.remaining[i]
    }

    /// Whether request `i` has failed already (its later chunks need not
    /// move).
    pub(super) fn failed(&self, i: usize) -> bool {
        self.errors[i].is_some()
    }

    /// Records that request `i` failed, unless it had already.
    pub(super) fn fail(&mut self, i: usize, e: Error) {
        self.errors[i].get_or_insert(e);
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
        (self.remaining[i] == 0).then(|| self.errors[i].take().map_or(Ok(()), Err))
    }
}

/// A peer answers copy requests in the order it got them; chunks look for
/// their replies in any order. `K` names a chunk.
pub(super) struct Replies<K> {
    /// Per peer, the chunks whose requests await replies, oldest first.
    awaiting: HashMap<SegmentId, VecDeque<K>>,
    /// Replies read for chunks that were not being looked at.
    ready: HashMap<K, Result<()>>,
}

impl<K: std::hash::Hash + Eq + Copy> Replies<K> {
    pub(super) fn new() -> Replies<K> {
        Replies {
            awaiting: HashMap::new(),
            ready: HashMap::new(),
        }
    }

    /// Chunk `key` sent a request to `peer`.
    pub(super) fn sent(&mut self, peer: SegmentId, key: K) {
        self.awaiting.entry(peer).or_default().push_back(key);
    }

    /// Whether any chunk awaits a reply from `peer`.
    pub(super) fn awaiting(&self, peer: SegmentId) -> bool {
        self.awaiting.get(&peer).is_some_and(|q| !q.is_empty())
    }

    /// Chunk `key`'s reply, if it was read.
    pub(super) fn take(&mut self, key: K) -> Option<Result<()>> {
        self.ready.remove(&key)
    }

    /// The next reply from `peer` was read: it is the oldest awaiting
    /// chunk's. When the connection `broke`, no later reply will come:
    /// every chunk still awaiting one gets the same error.
    pub(super) fn read(&mut self, peer: SegmentId, r: Result<()>, broke: bool) -> Result<()> {
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
    /// Packing requests into runs and taking slots.
    pub(super) admit: Duration,
    /// Waiting for local device copies (gathers and scatters).
    pub(super) device: Duration,
    /// Waiting for host legs.
    pub(super) host: Duration,
    /// Waiting for the peer's device copies.
    pub(super) peer: Duration,
    /// Completing requests and giving slots back.
    pub(super) retire: Duration,
    pub(super) chunks: usize,
}

impl Spent {
    /// The line: `requests` requests of `bytes` in `total`.
    pub(super) fn describe(&self, requests: usize, bytes: u64, total: Duration) -> String {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let named = self.admit + self.device + self.host + self.peer + self.retire;
        format!(
            "staging job: {requests} requests, {bytes} bytes in {} chunks, {:.2} ms: packing \
             {:.2} ms, waiting for local device copies {:.2} ms, for host legs {:.2} ms, for \
             the peer's device copies {:.2} ms, completions {:.2} ms, polling {:.2} ms",
            self.chunks,
            ms(total),
            ms(self.admit),
            ms(self.device),
            ms(self.host),
            ms(self.peer),
            ms(self.retire),
            ms(total.saturating_sub(named)),
        )
    }
}

#[cfg(test)]
#[path = "steps_tests.rs"]
mod tests;
