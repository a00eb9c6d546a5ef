//! Planning a batch: every request checked against local and remote
//! registered memory and routed to a transport, adjacent requests
//! coalesced, and device memory that no transport moves directly set
//! aside for staging. Nothing is handed to a transport here (that is
//! dispatch); a plan either covers every request or is an error.

use super::measure::BANDWIDTH_MIN_BYTES;
use super::request::{Op, Request, SegmentId};
use super::route_memo::Kind;
use super::segments::{remote_out_of_bounds, RemoteSegment, RemoteView, Segments};
use super::select::{Candidate, Choice, Transports, Want};
use crate::error::{Error, ErrorCode, Result};
use crate::id_map::IdMap;
use crate::memory::{LocalBuffer, MemoryRegistry, Visibility};
use smallvec::SmallVec;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// What planning asks of the live engine: only an engine with connections
/// and devices can answer these (tests answer them from tables).
pub(crate) trait Peers {
    /// A local buffer standing for `[addr, addr + len)` of request `i`,
    /// memory not registered here: host memory, which the transports that
    /// need no local registration move as it is; or the error that says
    /// why not (device memory must be registered).
    fn unregistered_local(&self, i: usize, addr: u64, len: u64) -> Result<Arc<LocalBuffer>>;
    /// Re-reads a segment's descriptor (the peer may have restarted, or
    /// registered more memory).
    fn refresh(&self, seg: &RemoteSegment) -> Result<Arc<RemoteView>>;
    /// Whether transport `transport` serves the segment's buffer with
    /// `key` (connecting on first use, remembering the answer), from the
    /// local buffer the transport gave handle `local_mem`, if it did.
    fn accepts(
        &self,
        seg: &RemoteSegment,
        transport: usize,
        local_mem: Option<u64>,
        key: &[u8],
    ) -> std::result::Result<(), String>;
}

/// A group of adjacent requests for one transport and segment.
pub(crate) struct Pending {
    pub(crate) segment: Arc<RemoteSegment>,
    pub(crate) transport: usize,
    pub(crate) op: Op,
    /// Index of its first request in the submitted list.
    pub(crate) first: usize,
    /// How many requests it covers.
    pub(crate) count: usize,
    pub(crate) local: Arc<LocalBuffer>,
    pub(crate) local_addr: u64,
    pub(crate) remote_addr: u64,
    pub(crate) length: u64,
    pub(crate) remote_key: Arc<[u8]>,
}

/// One request that goes through staging.
pub(crate) struct StagedItem {
    /// Its completion group in the batch (set by dispatch).
    pub(crate) group: usize,
    pub(crate) ends: StagedEnds,
    pub(crate) local_addr: u64,
    pub(crate) remote_addr: u64,
    pub(crate) length: u64,
}

/// What the blocks of one staged request, or of a staged run, share.
#[derive(Clone)]
pub(crate) struct StagedEnds {
    pub(crate) op: Op,
    pub(crate) local: Arc<LocalBuffer>,
    pub(crate) segment: Arc<RemoteSegment>,
    pub(crate) remote_on_device: bool,
    /// The transport the caller asked for: it carries the host legs.
    pub(crate) transport: Option<Arc<str>>,
}

/// One staged request (or coalesced block) as a staging job moves it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct StagedBlock {
    /// Its completion group in the batch.
    pub(crate) group: usize,
    /// The requests it carries, (first, count), where it fails alone
    /// while its group goes on (a staged list of requests is one group:
    /// Batch::fail_within); count 0: a failure fails its group.
    pub(crate) requests: (u32, u32),
    /// What it shares with other blocks: an index into the work's `ends`.
    pub(crate) ends: usize,
    pub(crate) local_addr: u64,
    pub(crate) remote_addr: u64,
    pub(crate) length: u64,
}

/// A staging job's work: its blocks, and the buffers, peer, direction and
/// transport they share. A staged run's 16,384 blocks share one `ends`,
/// so that no block holds references of its own (counting them up and
/// down cost a millisecond a batch).
pub(crate) struct StagedWork {
    pub(crate) ends: Vec<StagedEnds>,
    pub(crate) blocks: Vec<StagedBlock>,
}

impl StagedWork {
    /// The planner's staged requests, each with its own ends.
    pub(crate) fn from_items(items: Vec<StagedItem>) -> StagedWork {
        let mut work = StagedWork {
            ends: Vec::with_capacity(items.len()),
            blocks: Vec::with_capacity(items.len()),
        };
        for it in items {
            work.blocks.push(StagedBlock {
                group: it.group,
                requests: (0, 0),
                ends: work.ends.len(),
                local_addr: it.local_addr,
                remote_addr: it.remote_addr,
                length: it.length,
            });
            work.ends.push(it.ends);
        }
        work
    }

    /// Block `i` and what it shares.
    pub(crate) fn get(&self, i: usize) -> (&StagedBlock, &StagedEnds) {
        let b = &self.blocks[i];
        (b, &self.ends[b.ends])
    }

    /// What block `i` shares.
    pub(crate) fn ends_of(&self, i: usize) -> &StagedEnds {
        &self.ends[self.blocks[i].ends]
    }
}

/// Every request of a submission, routed.
pub(crate) struct Plan {
    /// How many requests were submitted.
    pub(crate) requests: usize,
    /// Requests of length 0, by index: they move nothing and succeed.
    pub(crate) empty: Vec<usize>,
    /// Inline for one (a synchronous transfer allocates none).
    pub(crate) routed: SmallVec<[Pending; 1]>,
    /// Staged requests, each with its index in the submitted list.
    pub(crate) staged: Vec<(usize, StagedItem)>,
    /// Whether a request the peer refuses as outside its registered memory
    /// is retried with its descriptor read again (retry.rs): not when the
    /// remote addresses are staging slots the peer lent.
    pub(crate) retry: bool,
}

/// A segment as one plan sees it: its view, and whether it was re-read.
type SegState = (Arc<RemoteSegment>, Arc<RemoteView>, bool);

/// The segments a plan has looked up: a few inline (a batch mostly goes to
/// one peer), a map past those.
#[derive(Default)]
struct SegTable {
    few: SmallVec<[(SegmentId, SegState); 2]>,
    many: IdMap<SegmentId, SegState>,
}

impl SegTable {
    const FEW: usize = 8;

    fn get_or_insert(
        &mut self,
        id: SegmentId,
        make: impl FnOnce() -> Result<SegState>,
    ) -> Result<&mut SegState> {
        if let Some(i) = self.few.iter().position(|(k, _)| *k == id) {
            return Ok(&mut self.few[i].1);
        }
        if self.few.len() < Self::FEW {
            self.few.push((id, make()?));
            let last = self.few.len() - 1;
            return Ok(&mut self.few[last].1);
        }
        match self.many.entry(id) {
            std::collections::hash_map::Entry::Occupied(e) => Ok(e.into_mut()),
            std::collections::hash_map::Entry::Vacant(e) => Ok(e.insert(make()?)),
        }
    }
}

/// What a route depends on: segment, remote buffer, local buffer, hint.
type RouteMemo<'r> = (SegmentId, usize, *const LocalBuffer, Option<&'r str>);

/// The previous request's route: what it depended on, transport, remote key.
type LastRoute<'r> = (RouteMemo<'r>, usize, Arc<[u8]>);

/// Where one request goes: its segment, the view and buffer its remote
/// range lies in, and whether that buffer is device memory.
struct Target<'p> {
    seg: &'p RemoteSegment,
    view: &'p Arc<RemoteView>,
    remote: usize,
    remote_on_device: bool,
}

/// Plans requests over an engine's state (or a test's).
pub(crate) struct Planner<'a, T> {
    pub(crate) transports: &'a Transports<T>,
    pub(crate) memory: &'a MemoryRegistry,
    pub(crate) segments: &'a Segments,
    pub(crate) peers: &'a dyn Peers,
    /// Whether this engine has device plugins (for a log line only).
    pub(crate) has_devices: bool,
}

impl<T: Candidate> Planner<'_, T> {
    /// The registered local buffer holding `[addr, addr + len)`; for
    /// memory registered nowhere, a buffer standing for it that only the
    /// transports needing no local registration move. A range that
    /// straddles a registered buffer's end is an error.
    pub(crate) fn local_buffer(&self, i: usize, addr: u64, len: u64) -> Result<Arc<LocalBuffer>> {
        if let Some(b) = self.memory.find(addr, len) {
            return Ok(b);
        }
        if self.memory.check_free(addr, len).is_err() {
            return Err(Error::new(
                ErrorCode::OutOfBounds,
                format!(
                    "request {i}: local range [{addr:#x}, {:#x}) is not inside one buffer \
                     registered with this engine (it overlaps one and runs past its end)",
                    addr.saturating_add(len)
                ),
            ));
        }
        self.peers.unregistered_local(i, addr, len)
    }

    /// Selection for one request of `bytes`, asking live peers what only
    /// they know.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn select(
        &self,
        local: &LocalBuffer,
        seg: &RemoteSegment,
        view: &RemoteView,
        remote: usize,
        bytes: u64,
        hint: Option<&str>,
        explain: bool,
    ) -> Result<Choice> {
        let want = Want {
            local,
            segment: seg,
            view,
            remote,
            bytes,
            hint,
            explain,
        };
        self.transports.select(&want, |t, key| {
            let local_mem = local.registration(t).map(|r| r.handle);
            self.peers.accepts(seg, t, local_mem, key)
        })
    }

    /// Checks and routes every request. With `slots`, remote addresses are
    /// in staging slots a peer lent us rather than in its published
    /// buffers (the host leg of a staged chunk).
    pub(crate) fn plan(
        &self,
        requests: &[Request],
        slots: Option<&Arc<RemoteView>>,
    ) -> Result<Plan> {
        let mut routed: SmallVec<[Pending; 1]> = SmallVec::with_capacity(requests.len());
        let mut segs = SegTable::default();
        let mut last_route: Option<LastRoute<'_>> = None;
        let mut last_local: Option<Arc<LocalBuffer>> = None;
        let mut staged: Vec<(usize, StagedItem)> = Vec::new();
        let mut last_staged = None;
        let mut empty: Vec<usize> = Vec::new();
        for (i, r) in requests.iter().enumerate() {
            if r.length == 0 {
                // Nothing to move (Mooncake's convention): it succeeds
                // without looking at its addresses.
                empty.push(i);
                continue;
            }
            let local = self.local_of(&mut last_local, i, r)?;
            let entry = segs.get_or_insert(r.segment, || self.open_segment(r.segment))?;
            let (view, remote) = self.remote_of(entry, slots, i, r)?;
            let hint = r.transport.as_deref();
            // Device memory on either side that no transport moves directly
            // goes through staging.
            let remote_on_device = !view.buffers[remote].location.starts_with("cpu");
            // Requests of one batch mostly share their buffers: route the
            // first of a run, reuse the answer for the rest.
            let memo_key = (r.segment, remote, Arc::as_ptr(&local), hint);
            // A run already routed between these buffers needs no staging
            // (asking selection per request cost microseconds per block).
            let routed_before = matches!(&last_route, Some((k, _, _)) if *k == memo_key);
            // Likewise a run staged between these buffers stays staged:
            // whether a transport serves depends on the buffers, not on a
            // request's length (and a failed selection formats its reasons).
            let staged_before = last_staged == Some(memo_key);
            if staged_before
                || (local.device.is_some() || remote_on_device)
                    && !routed_before
                    && self
                        .select(&local, &entry.0, &view, remote, r.length, hint, false)
                        .is_err()
            {
                last_staged = Some(memo_key);
                if !self.has_devices && local.device.is_none() {
                    // Only the peer has device memory: it stages for us.
                    log::debug!("request {i}: the peer's device memory is staged at the peer");
                }
                let item = StagedItem {
                    group: 0,
                    ends: StagedEnds {
                        op: r.op,
                        local,
                        segment: entry.0.clone(),
                        remote_on_device,
                        transport: r.transport.clone(),
                    },
                    local_addr: r.local_addr,
                    remote_addr: r.remote_addr,
                    length: r.length,
                };
                if staged.is_empty() {
                    // A staged request is mostly the first of many.
                    staged.reserve(requests.len() - i);
                }
                staged.push((i, item));
                continue;
            }
            let at = Target {
                seg: &entry.0,
                view: &view,
                remote,
                remote_on_device,
            };
            let (transport, remote_key) =
                self.route_of(&mut last_route, memo_key, &at, &local, i, r)?;
            if let Some(prev) = routed.last_mut() {
                if prev.continued_by(r, transport, &local, &remote_key, &view) {
                    prev.length += r.length;
                    prev.count += 1;
                    continue;
                }
            }
            routed.push(Pending {
                segment: entry.0.clone(),
                transport,
                op: r.op,
                first: i,
                count: 1,
                local,
                local_addr: r.local_addr,
                remote_addr: r.remote_addr,
                length: r.length,
                remote_key,
            });
        }
        Ok(Plan {
            requests: requests.len(),
            empty,
            routed,
            staged,
            retry: slots.is_none(),
        })
    }

    /// Request `i`'s local buffer. Requests of a batch mostly come from one
    /// buffer: the one the previous request was found in, when it holds
    /// this one too (dispatch checks again that it is still registered).
    fn local_of(
        &self,
        last: &mut Option<Arc<LocalBuffer>>,
        i: usize,
        r: &Request,
    ) -> Result<Arc<LocalBuffer>> {
        if let Some(b) = last.as_ref().filter(|b| {
            b.visibility != Visibility::Unregistered
                && r.local_addr >= b.addr
                && r.local_addr
                    .checked_add(r.length)
                    .is_some_and(|e| e <= b.end())
        }) {
            return Ok(b.clone());
        }
        let b = self.local_buffer(i, r.local_addr, r.length)?;
        *last = Some(b.clone());
        Ok(b)
    }

    /// A segment as this plan first sees it. After a failed connection it
    /// is looked up again once: a restarted peer's requests then fail (or
    /// succeed) on its current memory, not on the old process's. A peer
    /// still unreachable keeps the old view.
    fn open_segment(&self, id: SegmentId) -> Result<SegState> {
        let seg = self.segments.get(id)?;
        let refreshed = seg.stale.swap(false, Ordering::Relaxed);
        let view = match refreshed.then(|| self.peers.refresh(&seg)) {
            Some(Ok(v)) => v,
            _ => seg.view.read().clone(),
        };
        Ok((seg, view, refreshed))
    }

    /// The view request `i`'s remote range is found in (the lent `slots`,
    /// or the segment's), and the buffer holding it. A range not found is
    /// looked for once more after re-reading the segment: the peer may have
    /// registered memory since.
    fn remote_of(
        &self,
        entry: &mut SegState,
        slots: Option<&Arc<RemoteView>>,
        i: usize,
        r: &Request,
    ) -> Result<(Arc<RemoteView>, usize)> {
        let mut view = slots.unwrap_or(&entry.1).clone();
        let mut remote = view.find(r.remote_addr, r.length);
        if remote.is_none() && !entry.2 && slots.is_none() {
            entry.2 = true;
            if let Ok(v) = self.peers.refresh(&entry.0) {
                entry.1 = v;
                view = entry.1.clone();
                remote = view.find(r.remote_addr, r.length);
            }
        }
        match remote {
            Some(remote) => Ok((view, remote)),
            None => Err(remote_out_of_bounds(
                i,
                &entry.0,
                r.remote_addr,
                r.length,
                entry.1.buffers.len(),
            )),
        }
    }

    /// The transport and remote key for request `i`: the previous request's
    /// when it ran between the same buffers, the one remembered for small
    /// host requests of its kind (route_memo.rs), else selection's, logged
    /// the first time this segment uses that transport.
    fn route_of<'r>(
        &self,
        last: &mut Option<LastRoute<'r>>,
        memo_key: RouteMemo<'r>,
        at: &Target<'_>,
        local: &Arc<LocalBuffer>,
        i: usize,
        r: &'r Request,
    ) -> Result<(usize, Arc<[u8]>)> {
        if let Some((k, t, key)) = last.as_ref() {
            if *k == memo_key {
                return Ok((*t, key.clone()));
            }
        }
        let hint = r.transport.as_deref();
        let small =
            r.length < BANDWIDTH_MIN_BYTES && local.device.is_none() && !at.remote_on_device;
        let kind = Kind {
            view: at.view,
            remote: at.remote,
            local,
            bytes: r.length,
            hint,
        };
        if let Some((t, key)) = small.then(|| at.seg.routes.get(&kind)).flatten() {
            *last = Some((memo_key, t, key.clone()));
            return Ok((t, key));
        }
        let transport = self
            .select(local, at.seg, at.view, at.remote, r.length, hint, false)
            .map_err(|e| Error::new(e.code, format!("request {i}: {}", e.message)))?
            .transport;
        let name = self.transports[transport].name();
        if self.transports.first_use(r.segment, transport) {
            if let Ok(c) = self.select(local, at.seg, at.view, at.remote, r.length, hint, true) {
                log::info!("segment {}: using {name} ({})", at.seg.name, c.reason);
            }
        }
        let remote_key = at.view.buffers[at.remote]
            .keys
            .get(name)
            .cloned()
            .unwrap_or_else(|| Arc::from(&[][..]));
        if small {
            at.seg.routes.put(&kind, transport, &remote_key);
        }
        *last = Some((memo_key, transport, remote_key.clone()));
        Ok((transport, remote_key))
    }
}

impl Pending {
    /// Whether `r`, routed to `transport`, continues this group: the same
    /// segment, transport, op, buffers and key, contiguous on both sides,
    /// and still inside one remote buffer when joined.
    fn continued_by(
        &self,
        r: &Request,
        transport: usize,
        local: &Arc<LocalBuffer>,
        remote_key: &Arc<[u8]>,
        view: &RemoteView,
    ) -> bool {
        self.segment.id == r.segment
            && self.transport == transport
            && self.op == r.op
            && Arc::ptr_eq(&self.local, local)
            && self.local_addr + self.length == r.local_addr
            && self.remote_addr + self.length == r.remote_addr
            && self.remote_key == *remote_key
            && view
                .find(self.remote_addr, self.length + r.length)
                .is_some()
    }
}

#[cfg(test)]
mod tests;
