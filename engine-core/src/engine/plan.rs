//! Planning a batch: every request checked against local and remote
//! registered memory and routed to a transport, adjacent requests
//! coalesced, and device memory that no transport moves directly set
//! aside for staging. Nothing is handed to a transport here (that is
//! dispatch); a plan either covers every request or is an error.

use super::request::{Op, Request, SegmentId};
use super::segments::{remote_out_of_bounds, RemoteSegment, RemoteView, Segments};
use super::select::{Candidate, Transports, Want};
use crate::error::{Error, ErrorCode, Result};
use crate::memory::{LocalBuffer, MemoryRegistry};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::Arc;

/// What planning asks of live peers: only an engine with connections can
/// answer these (tests answer them from tables).
pub(crate) trait Peers {
    /// Re-reads a segment's descriptor (the peer may have restarted, or
    /// registered more memory).
    fn refresh(&self, seg: &RemoteSegment) -> Result<Arc<RemoteView>>;
    /// Whether transport `transport` serves the segment's buffer with
    /// `key` (connecting on first use, remembering the answer).
    fn accepts(
        &self,
        seg: &RemoteSegment,
        transport: usize,
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
    pub(crate) op: Op,
    pub(crate) local: Arc<LocalBuffer>,
    pub(crate) local_addr: u64,
    pub(crate) segment: Arc<RemoteSegment>,
    pub(crate) remote_addr: u64,
    pub(crate) remote_on_device: bool,
    pub(crate) length: u64,
}

/// Every request of a submission, routed.
pub(crate) struct Plan {
    /// How many requests were submitted.
    pub(crate) requests: usize,
    pub(crate) routed: Vec<Pending>,
    /// Staged requests, each with its index in the submitted list.
    pub(crate) staged: Vec<(usize, StagedItem)>,
}

/// What a route depends on: segment, remote buffer, local buffer, hint.
type RouteMemo = (SegmentId, usize, *const LocalBuffer, Option<String>);

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
    /// The registered local buffer holding `[addr, addr + len)`.
    pub(crate) fn local_buffer(&self, i: usize, addr: u64, len: u64) -> Result<Arc<LocalBuffer>> {
        self.memory.find(addr, len).ok_or_else(|| {
            Error::new(
                ErrorCode::OutOfBounds,
                format!(
                    "request {i}: local range [{addr:#x}, {:#x}) is not inside one buffer \
                     registered with this engine",
                    addr.saturating_add(len)
                ),
            )
        })
    }

    /// Selection for one request, asking live peers what only they know.
    pub(crate) fn select(
        &self,
        local: &LocalBuffer,
        seg: &RemoteSegment,
        view: &RemoteView,
        remote: usize,
        hint: Option<&str>,
        explain: bool,
    ) -> Result<(usize, String)> {
        let want = Want {
            local,
            segment: seg,
            view,
            remote,
            hint,
            explain,
        };
        self.transports
            .select(&want, |t, key| self.peers.accepts(seg, t, key))
    }

    /// Checks and routes every request. With `slots`, remote addresses are
    /// in staging slots a peer lent us rather than in its published
    /// buffers (the host leg of a staged chunk).
    pub(crate) fn plan(
        &self,
        requests: &[Request],
        slots: Option<&Arc<RemoteView>>,
    ) -> Result<Plan> {
        let mut routed: Vec<Pending> = Vec::with_capacity(requests.len());
        let mut segs: HashMap<SegmentId, (Arc<RemoteSegment>, Arc<RemoteView>, bool)> =
            HashMap::new();
        let mut last_route: Option<(RouteMemo, usize, Arc<[u8]>)> = None;
        let mut staged: Vec<(usize, StagedItem)> = Vec::new();
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
                    let seg = self.segments.get(r.segment)?;
                    // After a failed connection, look again once: a
                    // restarted peer's requests then fail (or succeed) on
                    // its current memory, not on the old process's. A peer
                    // still unreachable keeps the old view.
                    let refreshed = seg.stale.swap(false, Ordering::Relaxed);
                    let view = match refreshed.then(|| self.peers.refresh(&seg)) {
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
                if let Ok(v) = self.peers.refresh(&entry.0) {
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
            let hint = r.transport.as_deref();
            // Device memory on either side that no transport moves directly
            // goes through staging.
            let remote_on_device = !view.buffers[remote].location.starts_with("cpu");
            if (local.device.is_some() || remote_on_device)
                && self
                    .select(&local, &entry.0, &view, remote, hint, false)
                    .is_err()
            {
                if !self.has_devices && local.device.is_none() {
                    // Only the peer has device memory: it stages for us.
                    log::debug!("request {i}: the peer's device memory is staged at the peer");
                }
                staged.push((
                    i,
                    StagedItem {
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
                        .select(&local, &entry.0, &view, remote, hint, false)
                        .map_err(|e| Error::new(e.code, format!("request {i}: {}", e.message)))?;
                    let name = self.transports[transport].name();
                    if self.transports.first_use(r.segment, transport) {
                        if let Ok((_, reason)) =
                            self.select(&local, &entry.0, &view, remote, hint, true)
                        {
                            log::info!("segment {}: using {name} ({reason})", entry.0.name);
                        }
                    }
                    let remote_key = view.buffers[remote]
                        .keys
                        .get(name)
                        .cloned()
                        .unwrap_or_else(|| Arc::from(&[][..]));
                    last_route = Some((memo_key, transport, remote_key.clone()));
                    (transport, remote_key)
                }
            };
            // Coalesce with the previous request when both sides are
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
        Ok(Plan {
            requests: requests.len(),
            routed,
            staged,
        })
    }
}
