//! The `Engine` facade: the public API, each call handed to the part of
//! the engine that does it.

use super::blocks::BlockTransfer;
use super::layouts::{BlockLayout, LayoutId};
use super::node::list_segments;
use super::plan::Peers;
use super::request::{Request, Route, SegmentId};
use super::shared::Shared;
use crate::batch::{BatchId, BatchStatus, NotifyStatus, RequestStatus};
use crate::config::EngineConfig;
use crate::control_server::ControlServer;
use crate::descriptor::SegmentDescriptor;
use crate::error::{Error, ErrorCode, Result};
use crate::gpu::Gpu;
use crate::location::Location;
use crate::notify::{Notification, Notify};
use ferry_loader::PluginSet;
use ferry_topology::Topology;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

/// A Ferry engine. Share it between threads with `Arc<Engine>`; dropping
/// the last handle stops its listener and fails whatever is still in flight.
pub struct Engine {
    // Declared first: stops serving before the shared state goes.
    pub(super) control: ControlServer,
    /// The metrics endpoint (FERRY_METRICS_LISTEN), stopped before the rest.
    pub(super) metrics_server: Option<crate::metrics::MetricsServer>,
    pub(super) shared: Arc<Shared>,
}

impl Engine {
    /// This engine's segment name for peers to open: "host:port", or its
    /// name in the metadata store.
    pub fn segment_name(&self) -> &str {
        &self.shared.node.name
    }

    /// The metadata store's segments (name, descriptor), or an error
    /// without one.
    pub fn list_segments(&self) -> Result<Vec<(String, SegmentDescriptor)>> {
        list_segments(self.shared.node.metadata.as_deref())
    }

    pub fn control_addr(&self) -> SocketAddr {
        self.control.local_addr()
    }

    pub fn plugins(&self) -> &PluginSet {
        &self.shared.plugins
    }

    /// Names of the transports that can move data, in load order.
    pub fn transports(&self) -> Vec<String> {
        self.shared
            .transports
            .iter()
            .map(|t| t.name.clone())
            .collect()
    }

    /// The transport requests prefer (the `prefer` setting), if one of
    /// that name runs here.
    pub fn preferred_transport(&self) -> Option<String> {
        self.shared
            .transports
            .preferred()
            .map(|t| self.shared.transports[t].name.clone())
    }

    /// Transports that were enabled but failed to start, with the error.
    pub fn transport_failures(&self) -> &[(String, Error)] {
        &self.shared.transports.failures
    }

    pub fn config(&self) -> &EngineConfig {
        &self.shared.config
    }

    /// Devices (GPUs) the device plugins report, in the driver's numbering.
    pub fn gpus(&self) -> &[Gpu] {
        &self.shared.devices.gpus
    }

    /// Allocates device memory on `location` (e.g. cuda:0) through its device
    /// plugin; register it to move it. For tools and tests: applications
    /// normally bring their own (framework) allocations.
    pub fn allocate_device(&self, location: Location, len: u64) -> Result<u64> {
        self.shared.devices.allocate(location, len)
    }

    /// Frees memory from [`Engine::allocate_device`] (unregister it first).
    pub fn free_device(&self, addr: u64) -> Result<()> {
        self.shared.devices.free(addr)
    }

    /// A DMA-BUF fd for `[addr, addr + len)` of device memory (for RDMA
    /// registration), and `addr`'s offset inside the exported range.
    pub fn export_dmabuf(&self, addr: u64, len: u64) -> Result<(std::os::fd::OwnedFd, u64)> {
        self.shared.devices.export_dmabuf(addr, len)
    }

    /// Host memory the first device copies to and from fastest (pinned);
    /// free it with [`Engine::free_pinned`].
    pub fn allocate_pinned(&self, len: u64) -> Result<u64> {
        self.shared.devices.allocate_pinned(len)
    }

    pub fn free_pinned(&self, addr: u64) {
        self.shared.devices.free_pinned(addr)
    }

    /// Queues `(dst, src, len)` copies on one stream of device `location`
    /// and waits for all of them: for measuring copy bandwidth.
    ///
    /// # Safety
    /// Every range must be valid memory of this process.
    pub unsafe fn copy_batch(&self, location: Location, copies: &[(u64, u64, u64)]) -> Result<()> {
        // SAFETY: Devices::copy_batch's one requirement, every range valid memory of this
        // process, is word for word the `# Safety` of this method, whose callers (the cli's
        // bench and limits tools) pass ranges they allocated and keep until it returns.
        unsafe { self.shared.devices.copy_batch(location, copies) }
    }

    /// Copies `len` bytes from `src` to `dst`, either of which may be device
    /// memory (through its device plugin), and waits for the copy.
    ///
    /// # Safety
    /// Both ranges must be valid memory of this process for `len` bytes, and
    /// no transfer may be writing `dst` meanwhile.
    pub unsafe fn copy_memory(&self, dst: u64, src: u64, len: u64) -> Result<()> {
        // SAFETY: Devices::copy_memory requires both ranges valid memory of this process for
        // `len` bytes and no transfer writing `dst` meanwhile: the two requirements of this
        // method's own `# Safety`, which its callers (cli tools, tests) must meet for us.
        unsafe { self.shared.devices.copy_memory(dst, src, len) }
    }

    /// The hardware topology this engine discovered at start.
    pub fn topology(&self) -> &Arc<Topology> {
        &self.shared.topology
    }

    /// Registers `[addr, addr + len)` so that it can be a local buffer and
    /// peers can read and write it. `location` is detected when `None`
    /// (host memory: the NUMA node of its first page).
    pub fn register_memory(&self, addr: u64, len: u64, location: Option<Location>) -> Result<()> {
        self.shared.register_memory(addr, len, location)
    }

    /// How memory of `location` (a GPU) would be registered for RDMA and
    /// why better methods were skipped (docs/gpu.md's tiers), if it is a GPU
    /// this engine knows.
    pub fn gpu_direct(&self, location: Location) -> Option<String> {
        self.shared.gpu_direct.explain(&location.to_string())
    }

    /// How the buffer registered at `addr` is registered: each transport's
    /// name with the kind of memory it registered it as, as `ferry info`
    /// names kinds ("host", "cuda-dmabuf", "cuda-peermem", "cuda-ipc"; for
    /// device memory, none at all means staged).
    pub fn registrations(&self, addr: u64) -> Result<Vec<(String, String)>> {
        let b = self.shared.memory.find(addr, 1).ok_or_else(|| {
            Error::new(
                ErrorCode::NotFound,
                format!("no buffer registered at {addr:#x}"),
            )
        })?;
        Ok(b.registrations
            .iter()
            .map(|r| {
                (
                    self.shared.transports[r.transport].name.clone(),
                    ferry_plugins_abi::caps::mem_kind_names(r.mem_kind).join(", "),
                )
            })
            .collect())
    }

    /// Allocates `len` bytes of host memory (near NUMA node `numa_node` when
    /// given) and registers it. The memory comes from the transport that
    /// shares it best (shm maps it into same-host peers, so they copy with
    /// plain loads and stores); without such a transport, from the kernel.
    /// Free it with [`Engine::free_memory`]; what is left is freed with the
    /// engine.
    pub fn allocate_memory(&self, len: u64, numa_node: Option<u32>) -> Result<u64> {
        self.shared.allocate_memory(len, numa_node)
    }

    /// Unregisters and frees memory from [`Engine::allocate_memory`].
    pub fn free_memory(&self, addr: u64) -> Result<()> {
        self.shared.free_memory(addr)
    }

    /// Unregisters the buffer that starts at `addr`. Transfers in flight that
    /// use it locally finish first (they complete or fail within the
    /// timeout); afterwards peers can no longer reach it.
    pub fn unregister_memory(&self, addr: u64) -> Result<()> {
        self.shared.unregister_memory(addr)
    }

    /// Opens a peer's segment by name ("host:port"), fetching its descriptor.
    /// Opening a name that is already open returns the same id.
    pub fn open_segment(&self, name: &str) -> Result<SegmentId> {
        self.shared.segments.open(name, &self.shared.node)
    }

    /// Closes a segment; its connections are dropped and requests in flight
    /// to it fail.
    pub fn close_segment(&self, id: SegmentId) -> Result<()> {
        self.shared.segments.close(id)
    }

    /// Re-reads the peer's descriptor now (it is also re-read automatically
    /// when a request falls outside the known buffers).
    pub fn refresh_segment(&self, id: SegmentId) -> Result<()> {
        let seg = self.shared.segments.get(id)?;
        self.shared.refresh(&seg).map(|_| ())
    }

    /// A new batch with room for `capacity` requests.
    pub fn allocate_batch(&self, capacity: usize) -> Result<BatchId> {
        Ok(self.shared.batches.allocate(capacity)?.id)
    }

    /// Adds requests to a batch and starts them. Requests are checked first;
    /// if any is invalid (memory not registered at the peer, unknown
    /// segment, no transport can serve it), the call fails and nothing is
    /// submitted. Requests a transport then refuses (an unreachable peer)
    /// are marked failed in the batch. A request of length 0 moves nothing
    /// and succeeds at once, whatever its addresses.
    ///
    /// Local memory need not be registered when a transport that moves
    /// unregistered local memory serves the peer (tcp, shm: plugins that
    /// declare `FERRY_TRANSPORT_LOCAL_UNREGISTERED`); it must then stay
    /// valid memory of this process until its request completes. Others
    /// (rdma) need it registered, and the error says so. Device memory
    /// must always be registered.
    pub fn submit(&self, batch: BatchId, requests: &[Request]) -> Result<()> {
        self.shared.submit(batch, requests)
    }

    /// Registers a block layout (a pool of equal blocks inside memory
    /// registered here) and publishes it with this engine's segment, so
    /// peers can name its blocks by index; returns its id.
    pub fn register_layout(&self, layout: BlockLayout) -> Result<LayoutId> {
        self.shared.register_layout(layout)
    }

    /// Withdraws a layout (peers that still name it are refused).
    pub fn unregister_layout(&self, id: LayoutId) -> Result<()> {
        self.shared.unregister_layout(id)
    }

    /// Adds a transfer by block layouts to a batch and starts it: block
    /// `local_ids[i]` of the local layout moves to or from block
    /// `remote_ids[i]` of the peer's layout, one request per pair (status
    /// by index, in order). Indices out of range, unknown layouts or block
    /// sizes that differ fail the call and nothing is submitted. The route
    /// is chosen once for all blocks; a transport that takes block lists
    /// (cuda-ipc's one-kernel copy) moves them in one call.
    pub fn submit_blocks(&self, batch: BatchId, transfer: &BlockTransfer<'_>) -> Result<()> {
        self.shared.submit_blocks(batch, transfer)
    }

    /// [`Engine::submit_blocks`] as one batch, waited for (up to twice
    /// the configured timeout); the first failure is the error.
    pub fn transfer_blocks(&self, transfer: &BlockTransfer<'_>) -> Result<()> {
        let batch = self.allocate_batch(transfer.local_ids.len().max(1))?;
        let timeout = self.shared.config.timeout * 2;
        if let Err(e) = self.submit_blocks(batch, transfer) {
            let _ = self.free_batch(batch);
            return Err(e);
        }
        let status = self.wait(batch, timeout)?;
        if !status.is_done() {
            // Leave the batch allocated: its blocks are still in flight.
            return Err(Error::new(
                ErrorCode::Timeout,
                format!(
                    "{} blocks did not finish within {timeout:?}",
                    status.pending
                ),
            ));
        }
        let _ = self.free_batch(batch);
        match status.first_error {
            Some((i, e)) => Err(Error::new(e.code, format!("block {i}: {}", e.message))),
            None => Ok(()),
        }
    }

    /// Like [`Engine::submit`], and attaches `notify`: the requests' peer
    /// (they must all name one segment) receives it once every request of
    /// the batch has finished with its data in the peer's memory, never
    /// before. The batch then takes no more requests, and stays pending
    /// until the message was delivered or failed
    /// ([`BatchStatus::notify`](crate::BatchStatus::notify)). If a request
    /// fails, the message is not sent.
    pub fn submit_with_notify(
        &self,
        batch: BatchId,
        requests: &[Request],
        notify: Notify,
    ) -> Result<()> {
        self.shared.submit_with_notify(batch, requests, notify)
    }

    /// Sends `notify` alone to an open segment and waits for its delivery.
    pub fn send_notify(&self, segment: SegmentId, notify: Notify) -> Result<()> {
        self.shared.send_notify(segment, notify)
    }

    /// Every notification peers sent since the last call, oldest first
    /// (Mooncake's `getNotifies`: taking them empties the queue).
    pub fn take_notifies(&self) -> Vec<Notification> {
        self.shared.notifier.inbox.take_all()
    }

    /// The oldest notification a peer sent, taken; `None` when none waits.
    pub fn take_notify(&self) -> Option<Notification> {
        self.shared.notifier.inbox.take_one()
    }

    /// Notifications refused because this engine's queue was full (at most
    /// [`NOTIFY_QUEUE_DEPTH`](crate::notify::NOTIFY_QUEUE_DEPTH) wait; the
    /// newest is refused and its sender told), since the engine started.
    pub fn notifies_dropped(&self) -> u64 {
        self.shared.notifier.inbox.dropped()
    }

    /// The batch's status now (after completing what has already arrived).
    pub fn batch_status(&self, batch: BatchId) -> Result<BatchStatus> {
        let batch = self.shared.batches.get(batch)?;
        if batch.pending() != 0 {
            self.shared.progress();
        }
        Ok(batch.status())
    }

    pub fn request_status(&self, batch: BatchId, index: usize) -> Result<RequestStatus> {
        self.shared.batches.get(batch)?.request_status(index)
    }

    /// Waits for every request of the batch to finish, or for `timeout`.
    pub fn wait(&self, batch: BatchId, timeout: Duration) -> Result<BatchStatus> {
        let batch = self.shared.batches.get(batch)?;
        Ok(self.shared.wait(&batch, timeout))
    }

    /// Frees a batch whose requests have all finished.
    pub fn free_batch(&self, batch: BatchId) -> Result<()> {
        self.shared.batches.free(batch)
    }

    /// Submits `requests` as one batch and waits for them (up to twice the
    /// configured timeout); the first failure is the error.
    pub fn transfer_sync(&self, requests: &[Request]) -> Result<()> {
        self.transfer_sync_inner(requests, None)
    }

    /// [`Engine::transfer_sync`] with a notification to the requests' peer
    /// (see [`Engine::submit_with_notify`]); returns once the peer has it
    /// queued. A notification that was not delivered is the error.
    pub fn transfer_sync_with_notify(&self, requests: &[Request], notify: Notify) -> Result<()> {
        self.transfer_sync_inner(requests, Some(notify))
    }

    fn transfer_sync_inner(&self, requests: &[Request], notify: Option<Notify>) -> Result<()> {
        let batch = self.allocate_batch(requests.len().max(1))?;
        let submitted = match notify {
            Some(n) => self.submit_with_notify(batch, requests, n),
            None => self.submit(batch, requests),
        };
        let result = submitted.and_then(|_| self.wait(batch, self.shared.config.timeout * 2));
        let status = match result {
            Ok(s) => s,
            Err(e) => {
                let _ = self.wait(batch, self.shared.config.timeout * 2);
                let _ = self.free_batch(batch);
                return Err(e);
            }
        };
        if !status.is_done() {
            // Leave the batch allocated: its requests are still in flight.
            return Err(Error::new(
                ErrorCode::Timeout,
                match status.pending {
                    0 => "the notification was not delivered in time".to_string(),
                    n => format!("{n} requests did not finish in time"),
                },
            ));
        }
        let _ = self.free_batch(batch);
        match (status.first_error, status.notify) {
            (Some((i, e)), _) => Err(Error::new(e.code, format!("request {i}: {}", e.message))),
            (None, Some(NotifyStatus::Failed(e))) => Err(e),
            _ => Ok(()),
        }
    }

    /// Which transport would carry a request from `local_addr` to this
    /// segment, and why.
    pub fn route(
        &self,
        segment: SegmentId,
        local_addr: u64,
        remote_addr: u64,
        len: u64,
    ) -> Result<Route> {
        self.shared.route(segment, local_addr, remote_addr, len)
    }

    /// The address and length of the buffer the peer registered first, of
    /// those it publishes (Mooncake's `get_first_buffer_address`: by
    /// registration order, not by address), as last fetched; `None` when
    /// it publishes none.
    pub fn first_buffer(&self, id: SegmentId) -> Result<Option<(u64, u64)>> {
        let seg = self.shared.segments.get(id)?;
        let view = seg.view.read();
        Ok(view.descriptor.first_buffer().map(|b| (b.addr, b.len)))
    }

    /// The descriptor of an open segment, as last fetched.
    pub fn descriptor_of(&self, id: SegmentId) -> Result<SegmentDescriptor> {
        Ok(self.shared.segments.get(id)?.view.read().descriptor.clone())
    }

    /// This engine's own descriptor, as peers see it.
    pub fn descriptor(&self) -> SegmentDescriptor {
        self.shared.describe()
    }
}

/// Metrics: what moved, where, how fast, and what failed.
impl Engine {
    /// Every metric now: bytes and requests per transport, device, peer and
    /// op, failures by code, latency histograms, staged traffic, route
    /// changes, registered memory, plugins' counters.
    pub fn metrics(&self) -> crate::metrics::MetricsSnapshot {
        self.shared.metrics_snapshot()
    }

    /// [`Engine::metrics`] as JSON (what the C and Python APIs return).
    pub fn metrics_json(&self) -> String {
        serde_json::to_string(&self.metrics()).unwrap_or_default()
    }

    /// [`Engine::metrics`] in the Prometheus text format.
    pub fn metrics_prometheus(&self) -> String {
        crate::metrics::prometheus::render(&self.metrics())
    }

    /// Turns per-request counting on or off while the engine runs (it
    /// starts as FERRY_METRICS says); what was counted stays readable.
    pub fn set_metrics_enabled(&self, on: bool) {
        self.shared.metrics.set_enabled(on);
    }

    /// Where the metrics endpoint listens, when FERRY_METRICS_LISTEN set one.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics_server.as_ref().map(|s| s.local_addr())
    }
}
