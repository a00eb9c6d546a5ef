//! The state every part of the engine shares, behind one `Arc` (held by
//! the facade, the control plane and staging threads), grouped by concern
//! so that each part can be built and tested alone.

use super::allocations::Allocation;
use super::devices::Devices;
use super::ladder::GpuDirect;
use super::layouts::Layouts;
use super::node::Node;
use super::refused::RefusedQueue;
use super::segments::Segments;
use super::select::Transports;
use super::staging::Staging;
use crate::batch::{Batch, BatchStatus, BatchTable};
use crate::config::EngineConfig;
use crate::memory::MemoryRegistry;
use crate::metrics::Metrics;
use crate::notify::Notifier;
use crate::transport::Transport;
use ferry_loader::PluginSet;
use ferry_topology::Topology;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

/// The longest a waiter polls for a hand-over it expects to finish.
const MAX_SPIN: Duration = Duration::from_millis(2);

/// Fields drop in this order (after `Drop for Shared`, in startup.rs):
/// devices before transports, as the engine always did.
pub(crate) struct Shared {
    pub(crate) config: EngineConfig,
    pub(crate) topology: Arc<Topology>,
    /// Device plugins, their devices, and device memory handed out.
    pub(crate) devices: Devices,
    pub(crate) staging: Staging,
    /// Who this engine is to peers, and how it reaches them.
    pub(crate) node: Node,
    pub(crate) plugins: PluginSet,
    /// The transports that move data, and selection's memory of them.
    pub(crate) transports: Transports<Arc<Transport>>,
    /// Registered local memory.
    pub(crate) memory: MemoryRegistry,
    /// Open remote segments.
    pub(crate) segments: Segments,
    pub(crate) batches: Arc<BatchTable>,
    /// Requests peers refused on a stale key, waiting for their retry.
    pub(crate) refused: Arc<RefusedQueue>,
    /// Memory this engine allocated for the application, by address.
    pub(crate) allocations: Mutex<HashMap<u64, Allocation>>,
    /// How each GPU's memory is registered for RDMA, and what failed.
    pub(crate) gpu_direct: GpuDirect,
    /// What moved, where, how fast, and what failed.
    pub(crate) metrics: Metrics,
    /// Notifications peers sent, and the thread that sends this engine's.
    pub(crate) notifier: Notifier,
    /// Block layouts registered here (published with the descriptor).
    pub(crate) layouts: Layouts,
}

impl Shared {
    /// Lets every transport deliver the completions it has.
    pub(crate) fn progress(&self) {
        for t in self.transports.iter() {
            t.progress();
        }
    }

    pub(crate) fn wait(&self, batch: &Batch, timeout: Duration) -> BatchStatus {
        // A hand-over expected to finish within MAX_SPIN (a GPU list of a
        // few hundred microseconds) is waited for by polling to its end: a
        // thread that sleeps is woken tens of microseconds late, a fifth of
        // such a batch (256 KiB blocks on the H200: 0.55 -> 0.70 of the
        // device copy). Longer ones sleep after the configured spin.
        let expected = batch.expected().mul_f64(1.25);
        let spin = match expected <= MAX_SPIN {
            true => self.config.spin.max(expected),
            false => self.config.spin,
        };
        batch.wait(timeout, spin, || self.progress())
    }
}
