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
        let mut last_route: Option<(RouteMemo, usize, Arc<[u8]>)> = None;
        let mut last_local: Option<Arc<LocalBuffer>> = None;
        let mut staged: Vec<(usize, StagedItem)> = Vec::new();
        let mut empty: Vec<usize> = Vec::new();
        for (i, r) in requests.iter().enumerate() {
            if r.length == 0 {
                // Nothing to move (Mooncake's convention): it succeeds
                // without looking at its addresses.
                empty.push(i);
                continue;
            }
            // Requests of a batch mostly come from one buffer: the one the
            // previous request was found in, when it holds this one too
            // (dispatch checks again that it is still registered).
            let local = match &last_local {
                Some(b)
                    if b.visibility != Visibility::Unregistered
                        && r.local_addr >= b.addr
                        && r.local_addr
                            .checked_add(r.length)
                            .is_some_and(|e| e <= b.end()) =>
                {
                    b.clone()
                }
                _ => {
                    let b = self.local_buffer(i, r.local_addr, r.length)?;
                    last_local = Some(b.clone());
                    b
                }
            };
            let entry = segs.get_or_insert(r.segment, || {
                let seg = self.segments.get(r.segment)?;
                // After a failed connection, look again once: a restarted
                // peer's requests then fail (or succeed) on its current
                // memory, not on the old process's. A peer still
                // unreachable keeps the old view.
                let refreshed = seg.stale.swap(false, Ordering::Relaxed);
                let view = match refreshed.then(|| self.peers.refresh(&seg)) {
                    Some(Ok(v)) => v,
                    _ => seg.view.read().clone(),
                };
                Ok((seg, view, refreshed))
            })?;
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
            // Requests of one batch mostly share their buffers: route the
            // first of a run, reuse the answer for the rest.
            let memo_key = (r.segment, remote, Arc::as_ptr(&local), hint);
            // A run already routed between these buffers needs no staging
            // (asking selection per request cost microseconds per block).
            let routed_before = matches!(&last_route, Some((k, _, _)) if *k == memo_key);
            if (local.device.is_some() || remote_on_device)
                && !routed_before
                && self
                    .select(&local, &entry.0, &view, remote, r.length, hint, false)
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
            // Small host requests: the route chosen for the same kind in an
            // earlier submission (see route_memo.rs).
            let small =
                r.length < BANDWIDTH_MIN_BYTES && local.device.is_none() && !remote_on_device;
            let kind = Kind {
                view: &view,
                remote,
                local: &local,
                bytes: r.length,
                hint,
            };
            let remembered = || small.then(|| entry.0.routes.get(&kind)).flatten();
            let known = match &last_route {
                Some((k, t, key)) if *k == memo_key => Some((*t, key.clone())),
                _ => remembered().inspect(|(t, key)| {
                    last_route = Some((memo_key, *t, key.clone()));
                }),
            };
            let (transport, remote_key) = match known {
                Some(known) => known,
                None => {
                    let transport = self
                        .select(&local, &entry.0, &view, remote, r.length, hint, false)
                        .map_err(|e| Error::new(e.code, format!("request {i}: {}", e.message)))?
                        .transport;
                    let name = self.transports[transport].name();
                    if self.transports.first_use(r.segment, transport) {
                        if let Ok(c) =
                            self.select(&local, &entry.0, &view, remote, r.length, hint, true)
                        {
                            log::info!("segment {}: using {name} ({})", entry.0.name, c.reason);
                        }
                    }
                    let remote_key = view.buffers[remote]
                        .keys
                        .get(name)
                        .cloned()
                        .unwrap_or_else(|| Arc::from(&[][..]));
                    if small {
                        entry.0.routes.put(&kind, transport, &remote_key);
                    }
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
            empty,
            routed,
            staged,
            retry: slots.is_none(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::request::Scope;
    use super::super::select::fakes::*;
    use super::*;
    use crate::descriptor::SegmentDescriptor;
    use crate::memory::Visibility;
    use parking_lot::Mutex;

    const LOCAL: u64 = 0x10_0000;
    const REMOTE: u64 = 0x1000;

    /// Peers answered from tables: what a refresh reads, who declines.
    #[derive(Default)]
    struct FakePeers {
        /// The descriptor a refresh reads (none: the peer is unreachable).
        reread: Mutex<Option<SegmentDescriptor>>,
        refreshes: Mutex<usize>,
        declined: Vec<usize>,
        asked: Mutex<usize>,
    }

    impl Peers for FakePeers {
        fn unregistered_local(&self, i: usize, addr: u64, len: u64) -> Result<Arc<LocalBuffer>> {
            match addr {
                // Below LOCAL: memory tcp (transport 0) moves unregistered.
                a if a < LOCAL => Ok(unregistered_host_buffer(addr, len, &[0])),
                _ => Err(Error::new(
                    ErrorCode::OutOfBounds,
                    format!("request {i}: not registered"),
                )),
            }
        }
        fn refresh(&self, seg: &RemoteSegment) -> Result<Arc<RemoteView>> {
            *self.refreshes.lock() += 1;
            match self.reread.lock().clone() {
                Some(d) => Ok(seg.replace_view(d)),
                None => Err(Error::new(ErrorCode::Connection, "unreachable")),
            }
        }
        fn accepts(
            &self,
            _seg: &RemoteSegment,
            transport: usize,
            _local_mem: Option<u64>,
            _key: &[u8],
        ) -> std::result::Result<(), String> {
            *self.asked.lock() += 1;
            match self.declined.contains(&transport) {
                true => Err("declined".into()),
                false => Ok(()),
            }
        }
    }

    /// An engine's state without an engine: fake transports, registered
    /// local memory, and segment 1 (a same-host peer) open.
    struct World {
        transports: Transports<FakeTransport>,
        memory: MemoryRegistry,
        segments: Segments,
        peers: FakePeers,
    }

    impl World {
        fn new(transports: Vec<FakeTransport>, peer: SegmentDescriptor) -> World {
            let segments = Segments::new(Default::default());
            segments.insert(segment(1, Scope::SameHost, peer));
            World {
                transports: Transports::new(transports, Vec::new(), Vec::new()),
                memory: MemoryRegistry::default(),
                segments,
                peers: FakePeers::default(),
            }
        }

        fn planner(&self) -> Planner<'_, FakeTransport> {
            Planner {
                transports: &self.transports,
                memory: &self.memory,
                segments: &self.segments,
                peers: &self.peers,
                has_devices: true,
            }
        }

        fn plan(&self, requests: &[Request]) -> Result<Plan> {
            self.planner().plan(requests, None)
        }
    }

    /// tcp and shm at both ends; the peer has two adjacent host buffers of
    /// 64 KiB; 1 MiB of local host memory is registered with both.
    fn world() -> World {
        let both: &[&str] = &["tcp", "shm"];
        let peer = descriptor(
            "e1",
            both,
            &[
                (REMOTE, 64 << 10, "cpu:0", both),
                (REMOTE + (64 << 10), 64 << 10, "cpu:0", both),
            ],
        );
        let w = World::new(
            vec![fake("tcp", HOST, ANY_HOST), fake("shm", HOST, SAME_HOST)],
            peer,
        );
        w.memory.insert(host_buffer(LOCAL, 1 << 20, &[0, 1]));
        w
    }

    fn write(local: u64, remote: u64, len: u64) -> Request {
        Request::new(Op::Write, LOCAL + local, 1, REMOTE + remote, len)
    }

    fn shape(plan: &Plan) -> Vec<(usize, usize, u64, u64, usize)> {
        plan.routed
            .iter()
            .map(|p| {
                (
                    p.first,
                    p.count,
                    p.local_addr - LOCAL,
                    p.length,
                    p.transport,
                )
            })
            .collect()
    }

    #[test]
    fn adjacent_requests_become_one() {
        let w = world();
        let plan = w
            .plan(&[
                write(0, 0, 4096),
                write(4096, 4096, 4096),
                write(8192, 8192, 4096),
                write(65536, 16384, 4096),
            ])
            .unwrap();
        assert_eq!(plan.requests, 4);
        assert!(plan.staged.is_empty());
        // Both to shm (the same-host transport).
        assert_eq!(
            shape(&plan),
            vec![(0, 3, 0, 12288, 1), (3, 1, 65536, 4096, 1)]
        );
        assert_eq!(&plan.routed[0].remote_key[..], b"shm@0x1000");
    }

    #[test]
    fn requests_are_not_joined_across_an_op_a_buffer_or_a_transport() {
        let w = world();
        let read = Request::new(Op::Read, LOCAL + 4096, 1, REMOTE + 4096, 4096);
        let plan = w.plan(&[write(0, 0, 4096), read]).unwrap();
        assert_eq!(plan.routed.len(), 2);
        // Contiguous on both sides, but in two remote buffers.
        let edge = (64 << 10) - 4096;
        let plan = w
            .plan(&[write(0, edge, 4096), write(4096, edge + 4096, 4096)])
            .unwrap();
        assert_eq!(plan.routed.len(), 2);
        assert_ne!(plan.routed[0].remote_key, plan.routed[1].remote_key);
        let mut by_tcp = write(4096, 4096, 4096);
        by_tcp.transport = Some("tcp".into());
        let plan = w.plan(&[write(0, 0, 4096), by_tcp]).unwrap();
        assert_eq!(
            shape(&plan),
            vec![(0, 1, 0, 4096, 1), (1, 1, 4096, 4096, 0)]
        );
    }

    #[test]
    fn zero_length_requests_move_nothing_and_check_nothing() {
        let w = world();
        let mut nowhere = write(0, 0, 0);
        nowhere.segment = 7;
        nowhere.local_addr = 1;
        let plan = w
            .plan(&[write(0, 0, 0), write(0, 0, 4096), nowhere])
            .unwrap();
        assert_eq!(plan.empty, vec![0, 2]);
        assert_eq!(shape(&plan), vec![(1, 1, 0, 4096, 1)]);
    }

    #[test]
    fn unregistered_local_memory_goes_to_a_transport_that_needs_no_registration() {
        let w = world();
        // shm ranks first between same-host peers, but needs registration
        // in this table: tcp takes it.
        let r = Request::new(Op::Write, 0x8000, 1, REMOTE, 4096);
        let plan = w.plan(&[r]).unwrap();
        assert_eq!(plan.routed.len(), 1);
        assert_eq!(plan.routed[0].transport, 0);
        // Straddling the end of a registered buffer is still an error.
        let e = w.plan(&[write((1 << 20) - 4096, 0, 8192)]).err().unwrap();
        assert!(e.message.contains("runs past its end"), "{}", e.message);
        // Only tcp's "registration" stands for it: with tcp asked to
        // decline, selection says shm needs the memory registered.
        let mut w = world();
        w.peers.declined = vec![0];
        let e = w.plan(&[r_at(0x8000)]).err().unwrap();
        assert!(
            e.message.contains("shm needs local memory registered"),
            "{}",
            e.message
        );
    }

    /// Host memory registered nowhere; `transports` take it as it is.
    fn unregistered_host_buffer(addr: u64, len: u64, transports: &[usize]) -> Arc<LocalBuffer> {
        Arc::new(LocalBuffer {
            addr,
            len,
            location: crate::location::Location::Cpu(0),
            mem_kind: HOST,
            device: None,
            visibility: Visibility::Unregistered,
            registrations: transports
                .iter()
                .map(|&transport| crate::memory::TransportRegistration {
                    transport,
                    handle: 0,
                    key: Vec::new(),
                    mem_kind: HOST,
                })
                .collect(),
            inflight: Default::default(),
        })
    }

    fn r_at(addr: u64) -> Request {
        Request::new(Op::Write, addr, 1, REMOTE, 4096)
    }

    #[test]
    fn one_bad_request_fails_the_whole_plan() {
        let w = world();
        let e = w.plan(&[write((1 << 20) - 4096, 0, 8192)]).err().unwrap();
        assert_eq!(e.code, ErrorCode::OutOfBounds);
        assert!(
            e.message.starts_with("request 0: local range"),
            "{}",
            e.message
        );
        let mut elsewhere = write(0, 0, 4096);
        elsewhere.segment = 7;
        assert_eq!(
            w.plan(&[elsewhere]).err().unwrap().code,
            ErrorCode::NotFound
        );
        let mut by_rdma = write(0, 0, 4096);
        by_rdma.transport = Some("rdma".into());
        let e = w.plan(&[by_rdma]).err().unwrap();
        assert_eq!(e.code, ErrorCode::Unsupported);
        assert!(
            e.message.starts_with("request 0: transport rdma"),
            "{}",
            e.message
        );
    }

    #[test]
    fn a_range_outside_the_peers_buffers_is_looked_up_again_once() {
        let w = world();
        let beyond = write(0, 128 << 10, 4096);
        let e = w.plan(&[beyond.clone(), beyond.clone()]).err().unwrap();
        assert_eq!(e.code, ErrorCode::OutOfBounds);
        assert!(e.message.contains("it has 2 buffers"), "{}", e.message);
        assert_eq!(*w.peers.refreshes.lock(), 1);
        // The peer registered more memory meanwhile.
        let all: &[&str] = &["tcp", "shm"];
        *w.peers.reread.lock() = Some(descriptor("e1", all, &[(REMOTE, 256 << 10, "cpu:0", all)]));
        let plan = w.plan(&[beyond.clone(), write(4096, (128 << 10) + 4096, 4096)]);
        assert_eq!(shape(&plan.unwrap()), vec![(0, 2, 0, 8192, 1)]);
        assert_eq!(*w.peers.refreshes.lock(), 2);
    }

    #[test]
    fn a_segment_whose_connection_failed_is_read_again_first() {
        let w = world();
        let seg = w.segments.get(1).unwrap();
        seg.stale.store(true, Ordering::Relaxed);
        // Unreachable still: the old view serves.
        assert_eq!(w.plan(&[write(0, 0, 4096)]).unwrap().routed.len(), 1);
        assert_eq!(*w.peers.refreshes.lock(), 1);
        assert!(!seg.stale.load(Ordering::Relaxed));
        // Restarted without the buffer: the request fails on the new view,
        // not on the old process's memory.
        seg.stale.store(true, Ordering::Relaxed);
        *w.peers.reread.lock() = Some(descriptor("e2", &["tcp", "shm"], &[]));
        let e = w.plan(&[write(0, 0, 4096)]).err().unwrap();
        assert_eq!(e.code, ErrorCode::OutOfBounds);
        assert_eq!(*w.peers.refreshes.lock(), 2);
    }

    #[test]
    fn device_memory_no_transport_moves_directly_is_staged() {
        let gpu = &["tcp", "shm"];
        let peer = descriptor(
            "e1",
            gpu,
            &[
                (REMOTE, 64 << 10, "cpu:0", gpu),
                (0x100_0000, 1 << 20, "cuda:0", &[]),
            ],
        );
        let w = World::new(
            vec![fake("tcp", HOST, ANY_HOST), fake("shm", HOST, SAME_HOST)],
            peer,
        );
        w.memory.insert(host_buffer(LOCAL, 1 << 20, &[0, 1]));
        w.memory.insert(device_buffer(0x800_0000, 1 << 20, &[]));
        let plan = w
            .plan(&[
                // Local device memory to a host buffer.
                Request::new(Op::Write, 0x800_0000, 1, REMOTE, 4096),
                // Local host memory to the peer's device memory.
                Request::new(Op::Read, LOCAL, 1, 0x100_0000, 8192),
                // Host to host: routed as usual.
                write(8192, 8192, 4096),
            ])
            .unwrap();
        assert_eq!(shape(&plan), vec![(2, 1, 8192, 4096, 1)]);
        let staged: Vec<(usize, bool, u64)> = plan
            .staged
            .iter()
            .map(|(i, it)| (*i, it.remote_on_device, it.length))
            .collect();
        assert_eq!(staged, vec![(0, false, 4096), (1, true, 8192)]);
    }

    #[test]
    fn a_run_of_requests_between_the_same_buffers_is_routed_once() {
        let w = world();
        let run: Vec<Request> = (0..8).map(|k| write(k * 8192, k * 8192, 4096)).collect();
        let plan = w.plan(&run).unwrap();
        assert_eq!(plan.routed.len(), 8);
        // One selection (one question to the peer), and one more to put the
        // first use of the route into words for the log.
        assert_eq!(*w.peers.asked.lock(), 2);
        // Later submissions of the same kind reuse it (one use each) until
        // its uses run out; then selection runs again.
        for _ in 0..super::super::route_memo::REUSES {
            w.plan(&run).unwrap();
        }
        assert_eq!(*w.peers.asked.lock(), 2);
        w.plan(&run).unwrap();
        assert_eq!(*w.peers.asked.lock(), 3);
        // Another length is another kind; a large request is selected
        // every time.
        w.plan(&[write(0, 0, 2048)]).unwrap();
        assert_eq!(*w.peers.asked.lock(), 4);
        let both: &[&str] = &["tcp", "shm"];
        let big = World::new(
            vec![fake("tcp", HOST, ANY_HOST), fake("shm", HOST, SAME_HOST)],
            descriptor("e1", both, &[(REMOTE, 1 << 20, "cpu:0", both)]),
        );
        big.memory.insert(host_buffer(LOCAL, 1 << 20, &[0, 1]));
        let large = [Request::new(Op::Write, LOCAL, 1, REMOTE, 256 << 10)];
        big.plan(&large).unwrap();
        let first = *big.peers.asked.lock();
        for n in 1..=3 {
            big.plan(&large).unwrap();
            assert_eq!(*big.peers.asked.lock(), first + n);
        }
    }

    #[test]
    fn a_declined_transport_is_passed_over() {
        let mut w = world();
        w.peers.declined = vec![1];
        let plan = w.plan(&[write(0, 0, 4096)]).unwrap();
        assert_eq!(shape(&plan), vec![(0, 1, 0, 4096, 0)]);
        assert_eq!(&plan.routed[0].remote_key[..], b"tcp@0x1000");
    }

    #[test]
    fn staging_slots_replace_the_peers_buffers() {
        let w = world();
        let slots = Arc::new(RemoteView::new(descriptor(
            "e1",
            &["tcp", "shm"],
            &[(0x5000_0000, 1 << 20, "cpu:0", &["tcp"])],
        )));
        let leg = Request::new(Op::Write, LOCAL, 1, 0x5000_0000, 4096);
        let plan = w.planner().plan(&[leg], Some(&slots)).unwrap();
        assert_eq!(shape(&plan), vec![(0, 1, 0, 4096, 0)]);
        assert_eq!(&plan.routed[0].remote_key[..], b"tcp@0x50000000");
        // Outside the slots: no second look at the peer's descriptor.
        let e = w
            .planner()
            .plan(&[write(0, 0, 4096)], Some(&slots))
            .err()
            .unwrap();
        assert_eq!(e.code, ErrorCode::OutOfBounds);
        assert_eq!(*w.peers.refreshes.lock(), 0);
    }
}
