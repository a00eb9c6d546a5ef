//! Remote segments: peers' descriptors decoded for the data path, opened,
//! re-read when a peer restarts or registers more memory, and closed; the
//! connections each transport holds to a peer.

use super::request::{Scope, SegmentId};
use super::shared::Shared;
use super::staging::RemoteStaging;
use crate::control;
use crate::descriptor::SegmentDescriptor;
use crate::error::{Error, ErrorCode, Result};
use crate::transport::PeerHandle;
use parking_lot::{Mutex, RwLock};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
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

pub(crate) struct RemoteSegment {
    pub(crate) id: SegmentId,
    pub(crate) name: String,
    pub(crate) scope: Scope,
    pub(crate) view: RwLock<Arc<RemoteView>>,
    /// Connected peers, by transport index; created on first use.
    pub(crate) peers: Mutex<HashMap<usize, Arc<PeerHandle>>>,
    /// Per transport, whether it serves a remote buffer with a given key.
    pub(crate) verdicts: Mutex<HashMap<usize, KeyVerdicts>>,
    /// Idle staging sessions with this peer (slots it lent us for its
    /// device memory), each used by one job at a time.
    pub(crate) staging: Mutex<Vec<Arc<RemoteStaging>>>,
    /// A connection to the peer failed: the next submit re-reads the
    /// descriptor first (the peer may have restarted with other memory).
    pub(crate) stale: AtomicBool,
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

impl Shared {
    pub(crate) fn segment(&self, id: SegmentId) -> Result<Arc<RemoteSegment>> {
        self.segments
            .read()
            .get(&id)
            .cloned()
            .ok_or_else(|| unknown_segment(id))
    }

    /// A peer's descriptor: from the metadata store when there is one,
    /// else from the peer itself (the name is its control address).
    fn fetch_descriptor(&self, name: &str) -> Result<SegmentDescriptor> {
        let Some(store) = &self.metadata else {
            return control::fetch_descriptor(name, &self.link);
        };
        match store.fetch(name)? {
            Some(bytes) => SegmentDescriptor::from_json(&bytes).map_err(|e| {
                Error::new(
                    e.code,
                    format!(
                        "segment {name} in etcd at {}: {}",
                        store.endpoints(),
                        e.message
                    ),
                )
            }),
            None => Err(Error::new(
                ErrorCode::NotFound,
                format!(
                    "no such segment {name:?} in etcd at {} (its engine is not running, or \
                     registered under another name or prefix; `ferry segments` lists them)",
                    store.endpoints()
                ),
            )),
        }
    }

    fn scope_of(&self, d: &SegmentDescriptor) -> Scope {
        if d.machine_id != self.identity.machine_id {
            Scope::CrossHost
        } else if d.process_id == self.identity.process_id {
            Scope::SameProcess
        } else {
            Scope::SameHost
        }
    }

    pub(crate) fn open_segment(&self, name: &str) -> Result<SegmentId> {
        if let Some(seg) = self.segments.read().values().find(|s| s.name == name) {
            return Ok(seg.id);
        }
        let descriptor = self.fetch_descriptor(name)?;
        self.peer_controls
            .write()
            .insert(name.to_string(), descriptor.control_addr().to_string());
        let scope = self.scope_of(&descriptor);
        let id = self.next_segment.fetch_add(1, Ordering::SeqCst);
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
        let seg = Arc::new(RemoteSegment {
            id,
            name: name.to_string(),
            scope,
            view: RwLock::new(Arc::new(RemoteView::new(descriptor))),
            peers: Mutex::new(HashMap::new()),
            verdicts: Mutex::new(HashMap::new()),
            staging: Mutex::new(Vec::new()),
            stale: AtomicBool::new(false),
        });
        let mut segments = self.segments.write();
        // Another thread may have opened it meanwhile: keep one.
        if let Some(existing) = segments.values().find(|s| s.name == name) {
            return Ok(existing.id);
        }
        segments.insert(id, seg);
        Ok(id)
    }

    /// Re-reads a segment's descriptor. A peer that restarted (new engine
    /// id) has lost every connection: drop ours.
    pub(crate) fn refresh(&self, seg: &RemoteSegment) -> Result<Arc<RemoteView>> {
        let descriptor = self.fetch_descriptor(&seg.name)?;
        self.peer_controls
            .write()
            .insert(seg.name.clone(), descriptor.control_addr().to_string());
        let view = Arc::new(RemoteView::new(descriptor));
        let mut current = seg.view.write();
        if current.descriptor.engine_id != view.descriptor.engine_id {
            log::info!(
                "segment {} restarted (engine {} -> {}); reconnecting",
                seg.name,
                current.descriptor.engine_id,
                view.descriptor.engine_id
            );
            seg.peers.lock().clear();
            seg.verdicts.lock().clear();
        }
        *current = view.clone();
        Ok(view)
    }
    pub(crate) fn peer(&self, seg: &RemoteSegment, transport: usize) -> Result<Arc<PeerHandle>> {
        if let Some(p) = seg.peers.lock().get(&transport) {
            return Ok(p.clone());
        }
        let view = seg.view.read().clone();
        let t = &self.transports[transport];
        let endpoint = view.endpoints.get(&t.name).cloned().unwrap_or_default();
        let handle = Arc::new(t.connect(&seg.name, seg.scope.raw(), &endpoint)?);
        let mut peers = seg.peers.lock();
        Ok(peers.entry(transport).or_insert(handle).clone())
    }
}

/// Segments stored in a metadata store, decoded; entries that do not decode
/// are skipped with a warning.
pub fn list_segments(
    store: Option<&crate::metadata::EtcdStore>,
) -> Result<Vec<(String, SegmentDescriptor)>> {
    let store = store.ok_or_else(|| {
        Error::new(
            ErrorCode::Unsupported,
            "no metadata store is configured (FERRY_METADATA=etcd://host:port): peer-to-peer \
             segments are named by their control address and are not listed anywhere",
        )
    })?;
    let mut out = Vec::new();
    for (name, bytes) in store.list()? {
        match SegmentDescriptor::from_json(&bytes) {
            Ok(d) => out.push((name, d)),
            Err(e) => log::warn!("metadata: segment {name}: {e}"),
        }
    }
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}
