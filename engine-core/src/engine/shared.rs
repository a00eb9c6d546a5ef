//! The state every part of the engine shares, behind one `Arc`: what the
//! facade, the control plane and the staging threads hold on to.

use super::allocations::Allocation;
use super::devices::Gpu;
use super::request::SegmentId;
use super::segments::RemoteSegment;
use super::staging;
use crate::batch::{BatchStatus, BatchTable};
use crate::config::EngineConfig;
use crate::control;
use crate::device::Device;
use crate::error::{Error, ErrorCode, Result};
use crate::host::PeerControls;
use crate::identity::Identity;
use crate::memory::{LocalBuffer, MemoryRegistry};
use crate::topology::Topology;
use crate::transport::Transport;
use ferry_loader::PluginSet;
use parking_lot::{Mutex, RwLock};
use std::collections::{HashMap, HashSet};
use std::sync::atomic::AtomicU64;
use std::sync::Arc;
use std::time::Duration;

pub(crate) struct Shared {
    pub(crate) config: EngineConfig,
    pub(crate) topology: Arc<Topology>,
    /// Device plugin instances (cuda, ...) and the devices they report.
    pub(crate) devices: Vec<Arc<Device>>,
    pub(crate) gpus: Vec<Gpu>,
    pub(crate) staging: staging::Staging,
    pub(crate) identity: Identity,
    /// The segment name peers open: the control address, or the name
    /// registered in the metadata store.
    pub(crate) name: String,
    /// The control listener's "host:port".
    pub(crate) control_addr: String,
    /// The metadata store (etcd), when not peer to peer.
    pub(crate) metadata: Option<Arc<crate::metadata::EtcdStore>>,
    /// Deadlines and the auth token of control connections.
    pub(crate) link: control::Link,
    /// Open segments' names -> their control addresses, for plugin
    /// messages addressed by segment name.
    pub(crate) peer_controls: PeerControls,
    pub(crate) plugins: PluginSet,
    pub(crate) transports: Vec<Arc<Transport>>,
    pub(crate) transport_failures: Vec<(String, Error)>,
    pub(crate) endpoints: Vec<(String, Vec<u8>)>,
    pub(crate) memory: MemoryRegistry,
    pub(crate) segments: RwLock<HashMap<SegmentId, Arc<RemoteSegment>>>,
    pub(crate) next_segment: AtomicU64,
    pub(crate) batches: Arc<BatchTable>,
    /// (segment, transport) pairs already logged.
    pub(crate) logged_routes: Mutex<HashSet<(SegmentId, usize)>>,
    /// Memory this engine allocated for the application, by address.
    pub(crate) allocations: Mutex<HashMap<u64, Allocation>>,
    /// Device memory from allocate_device, by address: its device plugin.
    pub(crate) device_allocations: Mutex<HashMap<u64, usize>>,
    /// How each device's memory ("cuda:0") would be registered for RDMA,
    /// and the host facts and policy behind it.
    pub(crate) gpu_direct: HashMap<String, crate::gpudirect::Decision>,
    pub(crate) gpu_direct_host: crate::gpudirect::HostFacts,
    pub(crate) gpu_direct_policy: crate::gpudirect::Policy,
    /// (device, transport, method) whose trial registration failed: not
    /// tried again.
    pub(crate) direct_failures: Mutex<Vec<(String, usize, crate::gpudirect::Method)>>,
    /// (device, transport, method) successes already logged.
    pub(crate) direct_logged: Mutex<HashSet<(String, usize, crate::gpudirect::Method)>>,
}

impl Shared {
    pub(crate) fn progress(&self) {
        for t in &self.transports {
            t.progress();
        }
    }

    pub(crate) fn wait(&self, batch: &crate::batch::Batch, timeout: Duration) -> BatchStatus {
        batch.wait(timeout, self.config.spin, || self.progress())
    }

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
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Gone from the metadata store at once, not when the lease expires.
        if let Some(store) = &self.metadata {
            store.withdraw();
        }
        // Staging sessions peers opened here, and our own slots.
        let conns: Vec<u64> = self.staging_connections();
        for c in conns {
            self.stage_close(c);
        }
        self.release_local_slots();
        // Memory handed out by allocate_memory belongs to the engine.
        let allocations: Vec<(u64, Allocation)> = self.allocations.lock().drain().collect();
        for (addr, owner) in allocations {
            let _ = self.unregister_memory(addr);
            self.release(addr, owner);
        }
    }
}
