//! Submitting a batch: every request checked and routed, adjacent ones
//! coalesced, then handed to the transports; device memory that no
//! transport moves directly goes to staging.

use super::request::{Op, Request, SegmentId};
use super::segments::{remote_out_of_bounds, RemoteSegment, RemoteView};
use super::shared::Shared;
use super::staging;
use crate::batch::BatchId;
use crate::error::{Error, ErrorCode, Result};
use crate::memory::LocalBuffer;
use ferry_plugins_abi::sys;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// What a route depends on: segment, remote buffer, local buffer, hint.
pub(crate) type RouteMemo = (SegmentId, usize, *const LocalBuffer, Option<String>);

/// Requests for one (segment, transport), each with its index in `routed`.
pub(crate) type TargetGroup = (
    (SegmentId, usize),
    Vec<(sys::ferry_transfer_request_t, usize)>,
);

/// A group of adjacent requests for one transport and segment.
pub(crate) struct Pending {
    segment: Arc<RemoteSegment>,
    transport: usize,
    op: Op,
    first: usize,
    count: usize,
    local: Arc<LocalBuffer>,
    local_addr: u64,
    remote_addr: u64,
    length: u64,
    remote_key: Arc<[u8]>,
}

impl Shared {
    pub(crate) fn submit(self: &Arc<Self>, batch_id: BatchId, requests: &[Request]) -> Result<()> {
        self.submit_with(batch_id, requests, None)
    }

    /// Submits requests; with `slots`, remote addresses are in staging
    /// slots a peer lent us rather than in its published buffers.
    pub(crate) fn submit_with(
        self: &Arc<Self>,
        batch_id: BatchId,
        requests: &[Request],
        slots: Option<&Arc<RemoteView>>,
    ) -> Result<()> {
        let batch = self.batches.get(batch_id)?;
        if requests.is_empty() {
            return Ok(());
        }
        // 1. Check and route every request before touching the batch.
        let mut routed: Vec<Pending> = Vec::with_capacity(requests.len());
        let mut segs: HashMap<SegmentId, (Arc<RemoteSegment>, Arc<RemoteView>, bool)> =
            HashMap::new();
        let mut last_route: Option<(RouteMemo, usize, Arc<[u8]>)> = None;
        let mut staged: Vec<(usize, staging::StagedItem)> = Vec::new();
        for (i, r) in requests.iter().enumerate() {
            if r.length == 0 {
                return Err(Error::new(
                    ErrorCode::InvalidArgument,
                    format!("request {i}: length is 0"),
                ));
            }
            let local = self.local_buffer(i, r.local_addr, r.length)?;
            let entry = match segs.entry(r.segment) {
                std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
                std::collections::hash_map::Entry::Vacant(e) => {
                    let seg = self.segment(r.segment)?;
                    // After a failed connection, look again once: a
                    // restarted peer's requests then fail (or succeed) on
                    // its current memory, not on the old process's. A peer
                    // still unreachable keeps the old view.
                    let refreshed = seg.stale.swap(false, Ordering::Relaxed);
                    let view = match refreshed.then(|| self.refresh(&seg)) {
                        Some(Ok(v)) => v,
                        _ => seg.view.read().clone(),
                    };
                    e.insert((seg, view, refreshed))
                }
            };
            let mut view = slots.unwrap_or(&entry.1).clone();
            let mut remote = view.find(r.remote_addr, r.length);
            if remote.is_none() && !entry.2 && slots.is_none() {
                // The peer may have registered memory since we last looked.
                entry.2 = true;
                if let Ok(v) = self.refresh(&entry.0) {
                    entry.1 = v;
                    view = entry.1.clone();
                    remote = view.find(r.remote_addr, r.length);
                }
            }
            let Some(remote) = remote else {
                return Err(remote_out_of_bounds(
                    i,
                    &entry.0,
                    r.remote_addr,
                    r.length,
                    entry.1.buffers.len(),
                ));
            };
            // Device memory on either side that no transport moves directly
            // goes through staging.
            let remote_on_device = !view.buffers[remote].location.starts_with("cpu");
            if (local.device.is_some() || remote_on_device)
                && self
                    .select(
                        &local,
                        &entry.0,
                        &view,
                        remote,
                        r.transport.as_deref(),
                        false,
                    )
                    .is_err()
            {
                if self.devices.is_empty() && local.device.is_none() {
                    // Only the peer has device memory: it stages for us.
                    log::debug!("request {i}: the peer's device memory is staged at the peer");
                }
                staged.push((
                    i,
                    staging::StagedItem {
                        group: 0,
                        op: r.op,
                        local,
                        local_addr: r.local_addr,
                        segment: entry.0.clone(),
                        remote_addr: r.remote_addr,
                        remote_on_device,
                        length: r.length,
                    },
                ));
                continue;
            }
            // Requests of one batch mostly share their buffers: route the
            // first of a run, reuse the answer for the rest.
            let memo_key = (r.segment, remote, Arc::as_ptr(&local), r.transport.clone());
            let (transport, remote_key) = match &last_route {
                Some((k, t, key)) if *k == memo_key => (*t, key.clone()),
                _ => {
                    let (transport, _) = self
                        .select(
                            &local,
                            &entry.0,
                            &view,
                            remote,
                            r.transport.as_deref(),
                            false,
                        )
                        .map_err(|e| Error::new(e.code, format!("request {i}: {}", e.message)))?;
                    if !self.logged_routes.lock().contains(&(r.segment, transport)) {
                        if let Ok((_, reason)) = self.select(
                            &local,
                            &entry.0,
                            &view,
                            remote,
                            r.transport.as_deref(),
                            true,
                        ) {
                            log::info!(
                                "segment {}: using {} ({reason})",
                                entry.0.name,
                                self.transports[transport].name
                            );
                        }
                        self.logged_routes.lock().insert((r.segment, transport));
                    }
                    let remote_key = view.buffers[remote]
                        .keys
                        .get(&self.transports[transport].name)
                        .cloned()
                        .unwrap_or_else(|| Arc::from(&[][..]));
                    last_route = Some((memo_key, transport, remote_key.clone()));
                    (transport, remote_key)
                }
            };
            // 2. Coalesce with the previous request when both sides are
            // contiguous in the same buffers.
            if let Some(prev) = routed.last_mut() {
                if prev.segment.id == r.segment
                    && prev.transport == transport
                    && prev.op == r.op
                    && Arc::ptr_eq(&prev.local, &local)
                    && prev.local_addr + prev.length == r.local_addr
                    && prev.remote_addr + prev.length == r.remote_addr
                    && prev.remote_key == remote_key
                    && view
                        .find(prev.remote_addr, prev.length + r.length)
                        .is_some()
                {
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

        // 3. Reserve the batch slots and create one completion group per
        // coalesced request.
        let base = batch.reserve(requests.len())?;
        for (i, item) in &mut staged {
            item.group = crate::batch::group_of(batch.add_group(base + *i, 1, item.local.clone()));
        }
        let mut by_target: Vec<TargetGroup> = Vec::new();
        for (n, p) in routed.iter().enumerate() {
            let token = batch.add_group(base + p.first, p.count, p.local.clone());
            let local_mem = p
                .local
                .registration(p.transport)
                .map(|r| r.handle)
                .unwrap_or(0);
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
                None => by_target.push((key, vec![(raw, n)])),
            }
        }

        // 3b. Every group now counts in its local buffer's `inflight`.
        // `unregister_memory` first removes a buffer from the registry and
        // then waits for its `inflight` to drain; a buffer found in step 1
        // may have been unregistered since, with nothing in flight yet to
        // hold it back, and a read would then land in memory the caller has
        // taken back (found by reading the code while writing
        // tests/faults.rs). Checked after counting, so one side always sees
        // the other: either the buffer is still registered here (and its
        // unregister waits for these requests), or nothing is handed to a
        // transport.
        let gone = routed
            .iter()
            .map(|p| (p.first, &p.local))
            .chain(staged.iter().map(|(i, it)| (*i, &it.local)))
            .find(|(_, local)| {
                !self
                    .memory
                    .find(local.addr, 1)
                    .is_some_and(|b| Arc::ptr_eq(&b, local))
            })
            .map(|(i, local)| (i, local.addr));
        if let Some((i, addr)) = gone {
            let e = Error::new(
                ErrorCode::OutOfBounds,
                format!(
                    "request {i}: the local buffer at {addr:#x} was unregistered while the \
                     request was being submitted"
                ),
            );
            for (_, list) in &by_target {
                for (r, _) in list {
                    batch.complete_group(crate::batch::group_of(r.token), Err(e.clone()));
                }
            }
            for (_, it) in &staged {
                batch.complete_group(it.group, Err(e.clone()));
            }
            return Err(e);
        }

        // 4. Hand each group list to its transport.
        let mut failures = 0usize;
        let mut first_failure = None;
        for ((seg_id, transport), list) in by_target {
            let Some(p) = list.first().map(|(_, n)| &routed[*n]) else {
                continue;
            };
            let seg = p.segment.clone();
            let raw: Vec<sys::ferry_transfer_request_t> = list.iter().map(|(r, _)| *r).collect();
            let result = self
                .peer(&seg, transport)
                .and_then(|peer| self.transports[transport].submit(&peer, &raw));
            if let Err(e) = result {
                if e.code == ErrorCode::Connection {
                    // A broken peer handle is not reused, and the next
                    // submit re-reads the peer's descriptor.
                    seg.peers.lock().remove(&transport);
                    seg.stale.store(true, Ordering::Relaxed);
                }
                log::debug!("segment {seg_id}: {e}");
                for r in &raw {
                    batch.complete_group(crate::batch::group_of(r.token), Err(e.clone()));
                }
                failures += raw.len();
                first_failure.get_or_insert(e);
            }
        }
        let staged_count = staged.len();
        if !staged.is_empty() {
            let (me, b) = (self.clone(), batch.clone());
            let items: Vec<staging::StagedItem> = staged.into_iter().map(|(_, it)| it).collect();
            let groups: Vec<usize> = items.iter().map(|it| it.group).collect();
            let spawned = std::thread::Builder::new()
                .name("ferry-staging".into())
                .spawn(move || me.run_staged(b, items));
            if let Err(e) = spawned {
                let e = Error::new(
                    ErrorCode::NoMemory,
                    format!("cannot start a staging thread: {e}"),
                );
                for g in groups {
                    batch.complete_group(g, Err(e.clone()));
                }
            }
        }
        match first_failure {
            Some(e) if failures == routed.len() && staged_count == 0 => Err(e),
            _ => Ok(()),
        }
    }
}
