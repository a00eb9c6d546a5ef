//! Dispatch: a plan handed to the transports. The batch's slots are
//! reserved, each coalesced request becomes a completion group, and each
//! transport gets its groups in one call; what it refuses fails in the
//! batch, but for a refusal of the peer's key (retried once, retry.rs).
//! Staged requests get their groups here and run elsewhere.

use super::measure::Flight;
use super::plan::{Pending, Plan, StagedItem};
use super::request::{Op, SegmentId};
use super::retry::Resend;
use super::segments::RemoteSegment;
use super::shared::Shared;
use crate::batch::{group_of, Batch, GroupObserver, Retry};
use crate::error::{Error, ErrorCode, Result};
use crate::memory::{LocalBuffer, Visibility};
use crate::metrics::{memory_label, FlowCache, FlowKey, FlowLabels, Stamp, Tally, STAGING_SLOT};
use ferry_plugins_abi::sys;
use smallvec::SmallVec;
use std::sync::atomic::Ordering;
use std::sync::Arc;

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
        let mut flows = Flows {
            cache: FlowCache::default(),
            started: Stamp::now(),
        };
        for (i, item) in &mut staged {
            let tally = self.tally(
                &mut flows,
                None,
                item.op,
                &item.local,
                0,
                &item.segment,
                item.length,
            );
            item.group = group_of(batch.add_group(base + *i, 1, item.local.clone(), tally));
        }
        let by_target = self.group_by_target(batch, base, &routed, &mut flows);
        if let Some(e) = self.unregistered_meanwhile(&routed, &staged) {
            for (_, list) in &by_target {
                for (r, _) in list {
                    batch.complete_group(group_of(r.token), Err(e.clone()));
                }
            }
            for (_, it) in &staged {
                batch.complete_group(it.group, Err(e.clone()));
            }
            return Err(e);
        }
        // What the peer refuses is retried once with its descriptor read
        // again; not staging's host legs, whose keys are slots it lent.
        let resend: Option<Arc<dyn Retry>> =
            retry.then(|| Arc::new(Resend::new(self, &routed)) as Arc<dyn Retry>);
        let (failures, first_failure) = self.hand_over(batch, by_target, &routed, resend.as_ref());
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
    ) -> SmallVec<[TargetGroup; 1]> {
        let mut by_target: SmallVec<[TargetGroup; 1]> = SmallVec::new();
        for (n, p) in routed.iter().enumerate() {
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
        by_target
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
        let (i, addr) = routed
            .iter()
            .map(|p| (p.first, &p.local))
            .chain(staged.iter().map(|(i, it)| (*i, &it.local)))
            .find(|(_, local)| {
                local.visibility != Visibility::Unregistered
                    && !self
                        .memory
                        .find(local.addr, 1)
                        .is_some_and(|b| Arc::ptr_eq(&b, local))
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
                    // A broken peer handle is not reused, and the next
                    // submit re-reads the peer's descriptor.
                    seg.peers.lock().remove(&transport);
                    seg.stale.store(true, Ordering::Relaxed);
                    seg.routes.clear();
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
struct Flows {
    cache: FlowCache,
    started: Stamp,
}

impl Shared {
    /// Where a submission of `bytes` counts: its flow (transport, or
    /// staging when `None`; local device; peer; op; memory kind).
    #[allow(clippy::too_many_arguments)]
    fn tally<'c>(
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
