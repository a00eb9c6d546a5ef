//! Remote segments: peers' descriptors decoded for the data path, opened,
//! re-read when a peer restarts or registers more memory, and closed; the
//! connections each transport holds to a peer, and the staging sessions
//! peers lent this engine.

use super::node::Node;
use super::request::{Scope, SegmentId};
use super::route_memo::RouteMemo;
use crate::control::ControlClient;
use crate::descriptor::SegmentDescriptor;
use crate::error::{Error, ErrorCode, Result};
use crate::host::PeerControls;
use crate::id_map::IdMap;
use crate::memory::LocalBuffer;
use crate::transport::{PeerHandle, Transport};
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

/// A remote buffer with its keys decoded once.
pub(crate) struct RemoteBuffer {
    pub(crate) addr: u64,
    pub(crate) len: u64,
    pub(crate) location: String,
    pub(crate) keys: HashMap<String, Arc<[u8]>>,
}

/// A peer's descriptor, decoded for the data path.
pub(crate) struct RemoteView {
    pub(crate) descriptor: SegmentDescriptor,
    pub(crate) buffers: Vec<RemoteBuffer>,
    pub(crate) endpoints: HashMap<String, Vec<u8>>,
}

impl RemoteView {
    pub(crate) fn new(descriptor: SegmentDescriptor) -> RemoteView {
        let buffers = descriptor
            .buffers
            .iter()
            .map(|b| RemoteBuffer {
                addr: b.addr,
                len: b.len,
                location: b.location.clone(),
                keys: b
                    .keys
                    .iter()
                    .filter_map(|k| Some((k.transport.clone(), Arc::from(b.key(&k.transport)?))))
                    .collect(),
            })
            .collect();
        let endpoints = descriptor
            .transports
            .iter()
            .filter_map(|t| Some((t.name.clone(), descriptor.endpoint(&t.name)?)))
            .collect();
        RemoteView {
            descriptor,
            buffers,
            endpoints,
        }
    }

    /// The buffer holding all of `[addr, addr + len)`, by index.
    pub(crate) fn find(&self, addr: u64, len: u64) -> Option<usize> {
        let end = addr.checked_add(len)?;
        let idx = self
            .buffers
            .partition_point(|b| b.addr <= addr)
            .checked_sub(1)?;
        let b = &self.buffers[idx];
        (end <= b.addr + b.len).then_some(idx)
    }
}

/// A transport's answer for each remote buffer key: served, or why not.
pub(crate) type KeyVerdicts = HashMap<Vec<u8>, std::result::Result<(), String>>;

/// A staging session a peer opened for us: a control connection of our own
/// and the slots lent on it. One job uses a session at a time, so requests
/// and replies on its connection never interleave with another job's.
pub(crate) struct RemoteStaging {
    pub(crate) client: Mutex<ControlClient>,
    /// The lent slots, as a view the router understands.
    pub(crate) view: Arc<RemoteView>,
    /// Whether the peer takes StageCopyList (it said so in StageOpened).
    pub(crate) copy_list: bool,
}

pub(crate) struct RemoteSegment {
    pub(crate) id: SegmentId,
    pub(crate) name: String,
    pub(crate) scope: Scope,
    pub(crate) view: RwLock<Arc<RemoteView>>,
    /// Connected peers, by transport index; created on first use.
    pub(crate) peers: Mutex<IdMap<usize, Arc<PeerHandle>>>,
    /// Per transport, whether it serves a remote buffer with a given key.
    pub(crate) verdicts: Mutex<IdMap<usize, KeyVerdicts>>,
    /// Idle staging sessions with this peer (slots it lent us for its
    /// device memory), each used by one job at a time.
    pub(crate) staging: Mutex<Vec<Arc<RemoteStaging>>>,
    /// A connection to the peer failed: the next submit re-reads the
    /// descriptor first (the peer may have restarted with other memory).
    pub(crate) stale: AtomicBool,
    /// Small requests' routes, kept across submissions.
    pub(crate) routes: RouteMemo<RemoteView, LocalBuffer>,
}

impl RemoteSegment {
    pub(crate) fn new(
        id: SegmentId,
        name: &str,
        scope: Scope,
        descriptor: SegmentDescriptor,
    ) -> RemoteSegment {
        RemoteSegment {
            id,
            name: name.to_string(),
            scope,
            view: RwLock::new(Arc::new(RemoteView::new(descriptor))),
            peers: Mutex::default(),
            verdicts: Mutex::default(),
            staging: Mutex::new(Vec::new()),
            stale: AtomicBool::new(false),
            routes: RouteMemo::default(),
        }
    }

    /// Forgets transport `transport`'s broken peer handle (not reused) and
    /// marks the view stale, so that the next submit reads the peer's
    /// descriptor again and routes afresh.
    pub(crate) fn forget_peer(&self, transport: usize) {
        self.peers.lock().remove(&transport);
        self.stale.store(true, Ordering::Relaxed);
        self.routes.clear();
    }

    /// The peer handle of transport `i` (index `transport` of the engine's
    /// list), connected on first use.
    pub(crate) fn peer(&self, transport: usize, t: &Arc<Transport>) -> Result<Arc<PeerHandle>> {
        if let Some(p) = self.peers.lock().get(&transport) {
            return Ok(p.clone());
        }
        let view = self.view.read().clone();
        let endpoint = view.endpoints.get(&t.name).cloned().unwrap_or_default();
        let handle = Arc::new(t.connect(&self.name, self.scope.raw(), &endpoint)?);
        let mut peers = self.peers.lock();
        Ok(peers.entry(transport).or_insert(handle).clone())
    }

    /// Takes a newly read descriptor as the current view. A peer that
    /// restarted (new engine id) has lost every connection: drop ours.
    /// Remembered routes and acceptance verdicts go with the old view:
    /// they hold its keys, which the peer may have revoked (a buffer
    /// registered again has new ones).
    pub(crate) fn replace_view(&self, descriptor: SegmentDescriptor) -> Arc<RemoteView> {
        let view = Arc::new(RemoteView::new(descriptor));
        let mut current = self.view.write();
        self.routes.clear();
        self.verdicts.lock().clear();
        if current.descriptor.engine_id != view.descriptor.engine_id {
            log::info!(
                "segment {} restarted (engine {} -> {}); reconnecting",
                self.name,
                current.descriptor.engine_id,
                view.descriptor.engine_id
            );
            self.peers.lock().clear();
        }
        *current = view.clone();
        view
    }
}

/// The segments this engine opened, by id, and their control addresses
/// by name (shared with host services, for plugin messages).
pub(crate) struct Segments {
    open: RwLock<IdMap<SegmentId, Arc<RemoteSegment>>>,
    next: AtomicU64,
    /// Open segments' names -> their control addresses, for plugin
    /// messages addressed by segment name.
    controls: PeerControls,
}

impl Segments {
    pub(crate) fn new(controls: PeerControls) -> Segments {
        Segments {
            open: RwLock::default(),
            next: AtomicU64::new(1),
            controls,
        }
    }

    pub(crate) fn get(&self, id: SegmentId) -> Result<Arc<RemoteSegment>> {
        self.open
            .read()
            .get(&id)
            .cloned()
            .ok_or_else(|| unknown_segment(id))
    }

    /// Opens a peer's segment by name, fetching its descriptor through
    /// `node`; a name already open returns the same id.
    pub(crate) fn open(&self, name: &str, node: &Node) -> Result<SegmentId> {
        if let Some(seg) = self.open.read().values().find(|s| s.name == name) {
            return Ok(seg.id);
        }
        let descriptor = node.fetch_descriptor(name)?;
        self.controls
            .write()
            .insert(name.to_string(), descriptor.control_addr().to_string());
        let scope = node.scope_of(&descriptor);
        let id = self.next.fetch_add(1, Ordering::SeqCst);
        log::info!(
            "opened segment {name} (engine {}, {}, {} buffers, transports: {})",
            descriptor.engine_id,
            scope.as_str(),
            descriptor.buffers.len(),
            descriptor
                .transports
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
        let seg = Arc::new(RemoteSegment::new(id, name, scope, descriptor));
        Ok(self.insert(seg))
    }

    /// Adds an opened segment, unless another thread opened the same name
    /// meanwhile: one is kept, and its id returned.
    pub(crate) fn insert(&self, seg: Arc<RemoteSegment>) -> SegmentId {
        let mut open = self.open.write();
        if let Some(existing) = open.values().find(|s| s.name == seg.name) {
            return existing.id;
        }
        let id = seg.id;
        open.insert(id, seg);
        id
    }

    /// Forgets a segment (`Engine::close_segment`).
    pub(crate) fn close(&self, id: SegmentId) -> Result<()> {
        match self.open.write().remove(&id) {
            Some(_) => Ok(()),
            None => Err(unknown_segment(id)),
        }
    }

    /// Re-reads a segment's descriptor through `node`.
    pub(crate) fn refresh(&self, seg: &RemoteSegment, node: &Node) -> Result<Arc<RemoteView>> {
        let descriptor = node.fetch_descriptor(&seg.name)?;
        self.controls
            .write()
            .insert(seg.name.clone(), descriptor.control_addr().to_string());
        Ok(seg.replace_view(descriptor))
    }
}

pub(crate) fn unknown_segment(id: SegmentId) -> Error {
    Error::new(
        ErrorCode::NotFound,
        format!("no open segment with id {id} (never opened, or closed)"),
    )
}

pub(crate) fn remote_out_of_bounds(
    i: usize,
    seg: &RemoteSegment,
    addr: u64,
    len: u64,
    buffers: usize,
) -> Error {
    Error::new(
        ErrorCode::OutOfBounds,
        format!(
            "request {i}: remote range [{addr:#x}, {:#x}) is not inside one buffer registered \
             by segment {} (it has {buffers} buffers)",
            addr.saturating_add(len),
            seg.name
        ),
    )
}
