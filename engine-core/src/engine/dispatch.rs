//! Dispatch: a plan handed to the transports. The batch's slots are
//! reserved, each coalesced request becomes a completion group, and each
//! transport gets its groups in one call; what it refuses fails in the
//! batch, but for a refusal of the peer's key (retried once, retry.rs).
//! Staged requests get their groups here and run elsewhere.
//!
//! Reaches in Shared: `memory`, `metrics`, `transports`.

use super::layouts::recycle_blocks;
use super::measure::Flight;
use super::plan::{Pending, Plan, StagedItem};
use super::refused::{BlockRequests, Sent};
use super::request::{Op, SegmentId};
use super::retry::{Resend, ResendList};
use super::segments::RemoteSegment;
use super::shared::Shared;
use crate::batch::{group_of, Batch, GroupObserver, Retry};
use crate::error::{Error, ErrorCode, Result};
use crate::memory::{LocalBuffer, Visibility};
use crate::metrics::{memory_label, FlowCache, FlowKey, FlowLabels, Stamp, Tally, STAGING_SLOT};
use ferry_plugins_abi::sys;
use smallvec::SmallVec;
use std::sync::Arc;
use std::time::Duration;

/// Requests for one (segment, transport), each with its index in the
/// plan's `routed` (a few inline: most submissions are small).
type TargetGroup = (
    (SegmentId, usize),
    SmallVec<[(sys::ferry_transfer_request_t, usize); 4]>,
);

impl Shared {
    /// Starts a plan's requests in `batch` and returns its staged requests,
    /// each with its completion group, for a staging job to run. Fails,
    /// with nothing left in flight, when a local buffer was unregistered
    /// meanwhile, or when every routed request failed and none is staged
    /// or being retried (retry.rs).
    pub(crate) fn dispatch(self: &Arc<Self>, batch: &Batch, plan: Plan) -> Result<Vec<StagedItem>> {
        let Plan {
            requests,
            empty,
            routed,
            mut staged,
            retry,
        } = plan;
        // Reserve the batch slots and create one completion group per
        // coalesced request; requests of length 0 are done.
        let base = batch.reserve(requests)?;
        for i in &empty {
            batch.complete_empty(base + i, 1);
        }
        let mut flows = Flows::new();
        batch.reserve_groups(staged.len());
        for (i, item) in &mut staged {
            let tally = self.tally(
                &mut flows,
                None,
                item.ends.op,
                &item.ends.local,
                0,
                &item.ends.segment,
                item.length,
            );
            item.group = group_of(batch.add_group(base + *i, 1, item.ends.local.clone(), tally));
        }
        let (by_target, lists) = self.group_by_target(batch, base, &routed, &mut flows, retry);
        if let Some(e) = self.unregistered_meanwhile(&routed, &staged) {
            for (_, list) in &by_target {
                for (r, _) in list {
                    batch.complete_group(group_of(r.token), Err(e.clone()));
                }
            }
            for (_, it) in &staged {
                batch.complete_group(it.group, Err(e.clone()));
            }
            for l in &lists {
                batch.abort_group(group_of(l.token), e.clone());
            }
            return Err(e);
        }
        // One completion stands for a list's requests: a list the peer
        // refuses is retried once (whole, or the part it still registers),
        // then fails its requests (or those outside) with one error.
        let mut list_failures = 0usize;
        let mut list_failure = None;
        for mut l in lists {
            if let Err(e) = self.hand_over_list(batch, &mut l) {
                list_failures += l.pendings;
                list_failure.get_or_insert(e);
            }
        }
        // What the peer refuses is retried once with its descriptor read
        // again; not staging's host legs, whose keys are slots it lent.
        let resend: Option<Arc<dyn Retry>> =
            retry.then(|| Arc::new(Resend::new(self, &routed)) as Arc<dyn Retry>);
        let (failures, first_failure) = self.hand_over(batch, by_target, &routed, resend.as_ref());
        let failures = failures + list_failures;
        let first_failure = list_failure.or(first_failure);
        match first_failure {
            Some(e) if failures == routed.len() && staged.is_empty() => Err(e),
            _ => Ok(staged.into_iter().map(|(_, it)| it).collect()),
        }
    }

    /// One completion group per routed request, gathered by the (segment,
    /// transport) they go to.
    fn group_by_target(
        &self,
        batch: &Batch,
        base: usize,
        routed: &[Pending],
        flows: &mut Flows,
        retry: bool,
    ) -> (SmallVec<[TargetGroup; 1]>, Vec<ListGroup>) {
        let mut by_target: SmallVec<[TargetGroup; 1]> = SmallVec::new();
        // Runs of requests between one pair of buffers, for a transport
        // that takes block lists: one list and one completion each (a
        // refused list is retried once, retry.rs).
        let runs = block_runs(routed, |p| self.transports[p.transport].takes_block_lists());
        let mut lists: Vec<ListGroup> = Vec::with_capacity(runs.len());
        let mut in_run = runs.iter().peekable();
        for (n, p) in routed.iter().enumerate() {
            if let Some(&&(first, len)) = in_run.peek() {
                if n == first {
                    let run = &routed[first..first + len];
                    lists.push(self.list_group(batch, flows, base, run, retry));
                }
                if n >= first && n < first + len {
                    if n == first + len - 1 {
                        in_run.next();
                    }
                    continue;
                }
            }
            let registration = p.local.registration(p.transport);
            let local_mem = registration.map(|r| r.handle).unwrap_or(0);
            let mem_kind = registration.map_or(p.local.mem_kind, |r| r.mem_kind);
            let tally = self.tally(
                flows,
                Some(p.transport),
                p.op,
                &p.local,
                mem_kind,
                &p.segment,
                p.length,
            );
            let token = batch.add_group(base + p.first, p.count, p.local.clone(), tally);
            let raw = sys::ferry_transfer_request_t {
                op: p.op.raw(),
                reserved: 0,
                local_addr: p.local_addr,
                local_mem,
                remote_addr: p.remote_addr,
                length: p.length,
                remote_key: p.remote_key.as_ptr(),
                remote_key_len: p.remote_key.len(),
                token,
            };
            let key = (p.segment.id, p.transport);
            match by_target.iter_mut().find(|(k, _)| *k == key) {
                Some((_, list)) => list.push((raw, n)),
                None => {
                    self.metrics
                        .route_used(p.segment.id, mem_kind, p.transport, || {
                            p.segment.name.clone()
                        });
                    by_target.push((key, smallvec::smallvec![(raw, n)]))
                }
            }
        }
        (by_target, lists)
    }

    /// The error for the first request whose local buffer was unregistered
    /// since it was planned, if one was.
    fn unregistered_meanwhile(
        &self,
        routed: &[Pending],
        staged: &[(usize, StagedItem)],
    ) -> Option<Error> {
        // Every group now counts in its local buffer's `inflight`.
        // `unregister_memory` first removes a buffer from the registry and
        // then waits for its `inflight` to drain; a buffer found while
        // planning may have been unregistered since, with nothing in flight
        // yet to hold it back, and a read would then land in memory the
        // caller has taken back (found by reading the code while writing
        // tests/faults.rs). Checked after counting, so one side always sees
        // the other: either the buffer is still registered here (and its
        // unregister waits for these requests), or nothing is handed to a
        // transport.
        // Requests of a run share their buffer: each is looked up once.
        let mut checked: Option<&Arc<LocalBuffer>> = None;
        let (i, addr) = routed
            .iter()
            .map(|p| (p.first, &p.local))
            .chain(staged.iter().map(|(i, it)| (*i, &it.ends.local)))
            .filter(|(_, local)| {
                let again = checked.is_some_and(|c| Arc::ptr_eq(c, local));
                checked = Some(local);
                !again
            })
            .find(|(_, local)| {
                local.visibility != Visibility::Unregistered && !self.still_registered(local)
            })
            .map(|(i, local)| (i, local.addr))?;
        Some(Error::new(
            ErrorCode::OutOfBounds,
            format!(
                "request {i}: the local buffer at {addr:#x} was unregistered while the request \
                 was being submitted"
            ),
        ))
    }

    /// Hands each group list to its transport; returns how many groups
    /// failed for good, and the first error.
    fn hand_over(
        &self,
        batch: &Batch,
        by_target: SmallVec<[TargetGroup; 1]>,
        routed: &[Pending],
        retry: Option<&Arc<dyn Retry>>,
    ) -> (usize, Option<Error>) {
        let mut failures = 0usize;
        let mut first_failure = None;
        for ((seg_id, transport), list) in by_target {
            let Some(p) = list.first().map(|(_, n)| &routed[*n]) else {
                continue;
            };
            let seg = p.segment.clone();
            let raw: SmallVec<[sys::ferry_transfer_request_t; 8]> =
                list.iter().map(|(r, _)| *r).collect();
            let t = &self.transports[transport];
            let result = seg.peer(transport, t).and_then(|peer| {
                // One sample of what this transport delivers to this peer,
                // timed from the hand-over to the last completion.
                let flight: Arc<dyn GroupObserver> = Flight::start(
                    self.transports.meter.clone(),
                    seg_id,
                    transport,
                    raw.len(),
                    raw.iter().map(|r| r.length).sum(),
                );
                let groups = list.iter().map(|(r, n)| (group_of(r.token), *n));
                batch.observe(groups, &flight, retry);
                t.submit(&peer, &raw)
            });
            if let Err(e) = result {
                if e.code == ErrorCode::Connection {
                    seg.forget_peer(transport);
                }
                log::debug!("segment {seg_id}: {e}");
                // A refusal of the peer's key goes to its retry instead.
                for r in &raw {
                    if batch.complete_group(group_of(r.token), Err(e.clone())) {
                        failures += 1;
                    }
                }
                first_failure.get_or_insert(e);
            }
        }
        (failures, first_failure)
    }
}

/// One dispatch's view of the metrics: the flow last used, and the time
/// its submissions started.
pub(crate) struct Flows {
    cache: FlowCache,
    started: Stamp,
}

impl Flows {
    pub(crate) fn new() -> Flows {
        Flows {
            cache: FlowCache::default(),
            started: Stamp::now(),
        }
    }
}

impl Shared {
    /// Where a submission of `bytes` counts: its flow (transport, or
    /// staging when `None`; local device; peer; op; memory kind).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn tally<'c>(
        &self,
        flows: &'c mut Flows,
        transport: Option<usize>,
        op: Op,
        local: &LocalBuffer,
        mem_kind: u64,
        segment: &RemoteSegment,
        bytes: u64,
    ) -> Option<Tally<'c>> {
        if !self.metrics.enabled() {
            return None;
        }
        // Staging's own host legs (its slots are the only local-only
        // buffers) count apart from what applications asked.
        let mem_kind = if local.visibility == Visibility::LocalOnly {
            STAGING_SLOT
        } else {
            mem_kind
        };
        let key = FlowKey {
            transport: transport.unwrap_or(usize::MAX),
            segment: segment.id,
            op: (op == Op::Write) as u8,
            location: local.location,
            mem_kind,
        };
        let started = flows.started;
        let flow = self
            .metrics
            .cached_flow(&mut flows.cache, key, || FlowLabels {
                transport: transport
                    .and_then(|t| self.transports.get(t))
                    .map_or_else(|| "staging".to_string(), |t| t.name.clone()),
                device: local.location.to_string(),
                peer: segment.name.clone(),
                op: match op {
                    Op::Read => "read",
                    Op::Write => "write",
                },
                memory: memory_label(mem_kind),
            })?;
        Some(Tally {
            flow,
            bytes,
            started,
        })
    }
}

/// A run of routed requests (index of its first in `routed`, length) that
/// goes as one block list: at least two, consecutive in the batch, between
/// one local buffer and one peer buffer, on a transport that takes lists.
fn block_runs(routed: &[Pending], takes_lists: impl Fn(&Pending) -> bool) -> Vec<(usize, usize)> {
    let mut runs = Vec::new();
    let mut i = 0;
    while i < routed.len() {
        let p = &routed[i];
        let mut j = i + 1;
        if takes_lists(p) {
            while j < routed.len() {
                let (prev, q) = (&routed[j - 1], &routed[j]);
                let same = q.segment.id == p.segment.id
                    && q.transport == p.transport
                    && q.op == p.op
                    && Arc::ptr_eq(&q.local, &p.local)
                    && Arc::ptr_eq(&q.remote_key, &p.remote_key)
                    && q.first == prev.first + prev.count;
                if !same {
                    break;
                }
                j += 1;
            }
        }
        if j - i >= 2 {
            runs.push((i, j - i));
        }
        i = j;
    }
    runs
}

/// One block list, its completion group made, ready to hand over.
pub(crate) struct ListGroup {
    segment: Arc<RemoteSegment>,
    transport: usize,
    /// How many submitted requests it completes.
    pendings: usize,
    raw: sys::ferry_block_list_t,
    blocks: Vec<sys::ferry_block_t>,
    /// Keeps `raw.remote_key` alive.
    _key: Arc<[u8]>,
    /// Handed over as one request per block under the list's token (a
    /// transport without block lists), not as a list.
    single_requests: bool,
    /// Handed over by layout and index instead (`submit_layouts`, with
    /// the list's token); its index arrays are the caller's, alive while
    /// it is handed over.
    layouts: Option<sys::ferry_layout_list_t>,
    op: Op,
    /// A refusal of the peer's key is retried once, as a list (retry.rs).
    retry: bool,
    /// How its requests lie on its blocks, for a retry that serves it in
    /// part.
    requests: BlockRequests,
    token: u64,
    bytes: u64,
}

impl ListGroup {
    pub(crate) fn token(&self) -> u64 {
        self.token
    }

    /// The list's blocks, for their memory to be used again.
    pub(crate) fn into_blocks(self) -> Vec<sys::ferry_block_t> {
        self.blocks
    }
}

impl Shared {
    /// The completion group and block list for a run of routed requests
    /// (bases: the local buffer and the lowest remote address).
    fn list_group(
        &self,
        batch: &Batch,
        flows: &mut Flows,
        base: usize,
        run: &[Pending],
        retry: bool,
    ) -> ListGroup {
        let p = &run[0];
        let remote_base = run.iter().map(|q| q.remote_addr).min().unwrap_or(0);
        let blocks: Vec<sys::ferry_block_t> = run
            .iter()
            .map(|q| sys::ferry_block_t {
                local_offset: q.local_addr - p.local.addr,
                remote_offset: q.remote_addr - remote_base,
                length: q.length,
            })
            .collect();
        let requests = run.iter().map(|q| q.count).sum();
        let per_block = if retry {
            BlockRequests::from_counts(run.iter().map(|q| q.count))
        } else {
            BlockRequests::Whole
        };
        let mut list = self.block_group(
            batch,
            flows,
            BlockGroup {
                start: base + p.first,
                requests,
                segment: &p.segment,
                transport: p.transport,
                op: p.op,
                local: &p.local,
                local_base: p.local.addr,
                remote_base,
                remote_key: &p.remote_key,
                single_requests: false,
                retry,
                requests_per_block: per_block,
            },
            blocks,
        );
        list.pendings = run.len();
        list
    }

    /// Makes the completion group of a block list covering `requests`
    /// reserved slots from `start`.
    pub(crate) fn block_group(
        &self,
        batch: &Batch,
        flows: &mut Flows,
        g: BlockGroup<'_>,
        blocks: Vec<sys::ferry_block_t>,
    ) -> ListGroup {
        let bytes = blocks.iter().map(|b| b.length).sum();
        self.list_group_of(batch, flows, g, blocks, bytes)
    }

    /// Makes the completion group of blocks handed over by layout and
    /// index (`layouts`, its token filled in here), `bytes` in all.
    pub(crate) fn layout_group(
        &self,
        batch: &Batch,
        flows: &mut Flows,
        g: BlockGroup<'_>,
        mut layouts: sys::ferry_layout_list_t,
        bytes: u64,
    ) -> ListGroup {
        let mut list = self.list_group_of(batch, flows, g, Vec::new(), bytes);
        layouts.token = list.token;
        layouts.local_mem = list.raw.local_mem;
        list.layouts = Some(layouts);
        list
    }

    fn list_group_of(
        &self,
        batch: &Batch,
        flows: &mut Flows,
        g: BlockGroup<'_>,
        blocks: Vec<sys::ferry_block_t>,
        bytes: u64,
    ) -> ListGroup {
        let registration = g.local.registration(g.transport);
        let mem_kind = registration.map_or(g.local.mem_kind, |r| r.mem_kind);
        let tally = self.tally(
            flows,
            Some(g.transport),
            g.op,
            g.local,
            mem_kind,
            g.segment,
            bytes,
        );
        let parts = if g.single_requests { blocks.len() } else { 1 };
        let token = batch.add_group_of_parts(g.start, g.requests, parts, g.local.clone(), tally);
        self.metrics
            .route_used(g.segment.id, mem_kind, g.transport, || {
                g.segment.name.clone()
            });
        let raw = sys::ferry_block_list_t {
            op: g.op.raw(),
            reserved: 0,
            local_addr: g.local_base,
            local_mem: registration.map(|r| r.handle).unwrap_or(0),
            remote_addr: g.remote_base,
            remote_key: g.remote_key.as_ptr(),
            remote_key_len: g.remote_key.len(),
            blocks: blocks.as_ptr(),
            count: blocks.len(),
            token,
        };
        ListGroup {
            segment: g.segment.clone(),
            transport: g.transport,
            pendings: 1,
            raw,
            blocks,
            _key: g.remote_key.clone(),
            single_requests: g.single_requests,
            layouts: None,
            op: g.op,
            retry: g.retry,
            requests: g.requests_per_block,
            token,
            bytes,
        }
    }

    /// Hands over a list built outside a plan (block layouts, a request
    /// run), unless its local buffer was unregistered since it was found:
    /// as for a plan, such a buffer must not be handed over (its unregister
    /// no longer waits for it), and the list's group fails with the error
    /// `unregistered` words from the buffer's address. The list's blocks
    /// go back for reuse either way.
    pub(crate) fn hand_over_if_registered(
        self: &Arc<Self>,
        batch: &Batch,
        mut list: ListGroup,
        local: &Arc<LocalBuffer>,
        unregistered: impl FnOnce(u64) -> String,
    ) -> Result<()> {
        let handed = if self.still_registered(local) {
            self.hand_over_list(batch, &mut list)
        } else {
            let e = Error::new(ErrorCode::OutOfBounds, unregistered(local.addr));
            batch.abort_group(group_of(list.token()), e.clone());
            Err(e)
        };
        recycle_blocks(list.into_blocks());
        handed
    }

    /// Whether `local` is still the buffer registered at its address: it
    /// may have been unregistered since a submission found it.
    pub(crate) fn still_registered(&self, local: &Arc<LocalBuffer>) -> bool {
        self.memory
            .find(local.addr, 1)
            .is_some_and(|b| Arc::ptr_eq(&b, local))
    }

    /// Hands a block list to its transport; on a refusal its group fails
    /// (and a broken connection is forgotten, as for single requests),
    /// unless it is retried: a list (not layouts, not single requests)
    /// whose peer refuses its key is submitted once more with the key read
    /// again, and keeps its blocks until then. Ok when the transport took
    /// the list or its retry did.
    pub(crate) fn hand_over_list(self: &Arc<Self>, batch: &Batch, l: &mut ListGroup) -> Result<()> {
        let t = &self.transports[l.transport];
        let mut raw = l.raw;
        let resend = (l.retry && l.layouts.is_none() && !l.single_requests).then(|| {
            let sent = Sent {
                segment: l.segment.id,
                transport: l.transport,
                op: l.op,
                local_addr: raw.local_addr,
                local_mem: raw.local_mem,
                remote_addr: raw.remote_addr,
                length: 0,
            };
            let blocks = std::mem::take(&mut l.blocks);
            Arc::new(ResendList::new(
                self,
                sent,
                blocks,
                std::mem::take(&mut l.requests),
            ))
        });
        raw.blocks = resend
            .as_ref()
            .map_or(l.blocks.as_ptr(), |r| r.blocks().as_ptr());
        let retry = resend.map(|r| r as Arc<dyn Retry>);
        let result = l.segment.peer(l.transport, t).and_then(|peer| {
            // One completion group for the whole list.
            let flight: Arc<dyn GroupObserver> = Flight::start(
                self.transports.meter.clone(),
                l.segment.id,
                l.transport,
                1,
                l.bytes,
            );
            batch.observe([(group_of(l.token), 0)], &flight, retry.as_ref());
            if let Some(mbps) = self
                .transports
                .meter
                .get(l.segment.id, l.transport)
                .bandwidth()
            {
                // Mbit/s, measured from hand-over to completion.
                batch.expect(Duration::from_secs_f64(l.bytes as f64 * 8.0 / mbps / 1e6));
            }
            if let Some(layouts) = &l.layouts {
                return t.submit_layouts(&peer, layouts);
            }
            if !l.single_requests {
                return t.submit_blocks(&peer, &raw);
            }
            let requests: Vec<sys::ferry_transfer_request_t> = l
                .blocks
                .iter()
                .map(|b| sys::ferry_transfer_request_t {
                    op: raw.op,
                    reserved: 0,
                    local_addr: raw.local_addr + b.local_offset,
                    local_mem: raw.local_mem,
                    remote_addr: raw.remote_addr + b.remote_offset,
                    length: b.length,
                    remote_key: raw.remote_key,
                    remote_key_len: raw.remote_key_len,
                    token: raw.token,
                })
                .collect();
            t.submit(&peer, &requests)
        });
        if let Err(e) = &result {
            if e.code == ErrorCode::Connection {
                l.segment.forget_peer(l.transport);
            }
            log::debug!("segment {}: {e}", l.segment.id);
            if !batch.abort_group(group_of(l.token), e.clone()) {
                return Ok(()); // its retry took it
            }
        }
        result
    }
}

/// What a block list's completion group stands for.
pub(crate) struct BlockGroup<'a> {
    /// Its first reserved request slot, and how many it completes.
    pub(crate) start: usize,
    pub(crate) requests: usize,
    pub(crate) segment: &'a Arc<RemoteSegment>,
    pub(crate) transport: usize,
    pub(crate) op: Op,
    pub(crate) local: &'a Arc<LocalBuffer>,
    pub(crate) local_base: u64,
    pub(crate) remote_base: u64,
    pub(crate) remote_key: &'a Arc<[u8]>,
    /// See [`ListGroup`]: one request per block under one token.
    pub(crate) single_requests: bool,
    /// Whether a refusal of the peer's key is retried (not for staging's
    /// slots, which the peer lent).
    pub(crate) retry: bool,
    /// How its requests lie on its blocks (Whole: they go together).
    pub(crate) requests_per_block: BlockRequests,
}
