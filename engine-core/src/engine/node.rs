//! Who this engine is to its peers: its segment name, control address and
//! identity, the deadlines and token of its control connections, and the
//! metadata store, when there is one, through which peers find each other.

use super::request::Scope;
use crate::control;
use crate::descriptor::SegmentDescriptor;
use crate::error::{Error, ErrorCode, Result};
use crate::identity::Identity;
use ferry_metadata::EtcdStore;
use std::sync::Arc;

pub(crate) struct Node {
    pub(crate) identity: Identity,
    /// The segment name peers open: the control address, or the name
    /// registered in the metadata store.
    pub(crate) name: String,
    /// The control listener's "host:port".
    pub(crate) control_addr: String,
    /// Deadlines and the auth token of control connections.
    pub(crate) link: control::Link,
    /// The metadata store (etcd), when not peer to peer.
    pub(crate) metadata: Option<Arc<EtcdStore>>,
}

impl Node {
    /// A peer's descriptor: from the metadata store when there is one,
    /// else from the peer itself (the name is its control address).
    pub(crate) fn fetch_descriptor(&self, name: &str) -> Result<SegmentDescriptor> {
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

    /// Where the engine that wrote `d` is, relative to this one.
    pub(crate) fn scope_of(&self, d: &SegmentDescriptor) -> Scope {
        if d.machine_id != self.identity.machine_id {
            Scope::CrossHost
        } else if d.process_id == self.identity.process_id {
            Scope::SameProcess
        } else {
            Scope::SameHost
        }
    }

    /// Stores this engine's descriptor in the metadata store, if any. A
    /// failure is logged: the store's keeper stores it once etcd answers.
    pub(crate) fn publish(&self, descriptor: impl FnOnce() -> SegmentDescriptor) {
        if let Some(store) = &self.metadata {
            if let Err(e) = store.publish(&self.name, descriptor().to_json()) {
                log::warn!("metadata: {e}");
            }
        }
    }
}

/// Segments stored in a metadata store, decoded; entries that do not decode
/// are skipped with a warning.
pub fn list_segments(store: Option<&EtcdStore>) -> Result<Vec<(String, SegmentDescriptor)>> {
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
