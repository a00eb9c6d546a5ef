//! The engine: registered memory, remote segments, batches, and the choice
//! of transport for each request.
//!
//! An engine loads plugins, starts an instance of every enabled transport,
//! and serves its segment descriptor on a control listener whose address is
//! the segment name ("host:port"). Opening a peer's segment fetches the
//! peer's descriptor; submitting a batch checks every request against local
//! and remote registered memory, picks a transport, coalesces adjacent
//! requests, and hands them to the transports, which complete them.

use crate::batch::{BatchId, BatchStatus, BatchTable, RequestStatus};
use crate::config::EngineConfig;
use crate::control::{self, ControlHandler, ControlServer};
use crate::descriptor::{
    encode_blob, BufferDescriptor, BufferKey, SegmentDescriptor, TransportEndpoint,
    DESCRIPTOR_VERSION,
};
use crate::device::{Device, PointerKind};
use crate::error::{Error, ErrorCode, Result};
use crate::host::CoreHost;
use crate::identity::Identity;
use crate::location::{host_location, Location};
use crate::memory::{LocalBuffer, MemoryRegistry, TransportRegistration, Visibility};
use crate::topology::{PathClass, PciAddress, Topology};
use crate::transport::{PeerHandle, RegionSpec, Transport};
use ferry_loader::{PluginKind, PluginSet};
use ferry_plugins_abi::sys;
use parking_lot::{Mutex, RwLock};
use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

mod staging;
/// The staging requests peers send on the control plane, and their
/// decoders (exercised by the fuzz targets).
pub use staging::{
    decode_copy_request, decode_open_reply, decode_open_request, CopyRequest, OpenReply,
    OpenRequest,
};

/// Identifies an open remote segment within one engine.
pub type SegmentId = u64;

/// Segment name -> control address ("host:port"), shared with host services.
pub type PeerControls = Arc<RwLock<HashMap<String, String>>>;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// Remote -> local.
    Read,
    /// Local -> remote.
    Write,
}

impl Op {
    fn raw(self) -> u32 {
        match self {
            Op::Read => sys::FERRY_OP_READ,
            Op::Write => sys::FERRY_OP_WRITE,
        }
    }
}

/// One transfer between local memory and a remote segment.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Request {
    pub op: Op,
    pub local_addr: u64,
    pub segment: SegmentId,
    pub remote_addr: u64,
    pub length: u64,
    /// Use this transport if it can serve the request (else an error).
    pub transport: Option<String>,
}

impl Request {
    pub fn new(op: Op, local_addr: u64, segment: SegmentId, remote_addr: u64, length: u64) -> Self {
        Request {
            op,
            local_addr,
            segment,
            remote_addr,
            length,
            transport: None,
        }
    }
}

/// Where a peer is, relative to this engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scope {
    SameProcess,
    SameHost,
    CrossHost,
}

impl Scope {
    fn raw(self) -> u32 {
        match self {
            Scope::SameProcess => sys::FERRY_SCOPE_SAME_PROCESS,
            Scope::SameHost => sys::FERRY_SCOPE_SAME_HOST,
            Scope::CrossHost => sys::FERRY_SCOPE_CROSS_HOST,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Scope::SameProcess => "same process",
            Scope::SameHost => "same host",
            Scope::CrossHost => "another host",
        }
    }
}

/// A remote buffer with its keys decoded once.
struct RemoteBuffer {
    addr: u64,
    len: u64,
    location: String,
    keys: HashMap<String, Arc<[u8]>>,
}

/// A peer's descriptor, decoded for the data path.
struct RemoteView {
    descriptor: SegmentDescriptor,
    buffers: Vec<RemoteBuffer>,
    endpoints: HashMap<String, Vec<u8>>,
}

impl RemoteView {
    fn new(descriptor: SegmentDescriptor) -> RemoteView {
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

    fn find(&self, addr: u64, len: u64) -> Option<usize> {
        let end = addr.checked_add(len)?;
        let idx = self
            .buffers
            .partition_point(|b| b.addr <= addr)
            .checked_sub(1)?;
        let b = &self.buffers[idx];
        (end <= b.addr + b.len).then_some(idx)
    }
}

/// What a route depends on: segment, remote buffer, local buffer, hint.
type RouteMemo = (SegmentId, usize, *const LocalBuffer, Option<String>);

/// A transport's answer for each remote buffer key: served, or why not.
type KeyVerdicts = HashMap<Vec<u8>, std::result::Result<(), String>>;

struct RemoteSegment {
    id: SegmentId,
    name: String,
    scope: Scope,
    view: RwLock<Arc<RemoteView>>,
    /// Connected peers, by transport index; created on first use.
    peers: Mutex<HashMap<usize, Arc<PeerHandle>>>,
    /// Per transport, whether it serves a remote buffer with a given key.
    verdicts: Mutex<HashMap<usize, KeyVerdicts>>,
    /// Idle staging sessions with this peer (slots it lent us for its
    /// device memory), each used by one job at a time.
    staging: Mutex<Vec<Arc<staging::RemoteStaging>>>,
    /// A connection to the peer failed: the next submit re-reads the
    /// descriptor first (the peer may have restarted with other memory).
    stale: AtomicBool,
}

/// Why a transport was chosen, for logs and `ferry demo`.
#[derive(Clone, Debug)]
pub struct Route {
    pub transport: String,
    pub scope: Scope,
    pub reason: String,
    /// The plugin's own description of how it reaches the peer.
    pub peer_detail: Option<String>,
    /// For socket transports: the interface the kernel routes through.
    pub nic: Option<RouteNic>,
}

/// The local interface toward a peer and where it sits in the topology.
#[derive(Clone, Debug)]
pub struct RouteNic {
    pub interface: String,
    pub local_ip: IpAddr,
    pub loopback: bool,
    /// The topology's NIC behind the interface (its PCI function), if any.
    pub nic: Option<String>,
    pub pci: Option<String>,
    /// Path class from the local buffer's location to that NIC.
    pub class: Option<PathClass>,
}

struct Shared {
    config: EngineConfig,
    topology: Arc<Topology>,
    /// Device plugin instances (cuda, ...) and the devices they report.
    devices: Vec<Arc<Device>>,
    gpus: Vec<Gpu>,
    staging: staging::Staging,
    identity: Identity,
    /// The segment name peers open: the control address, or the name
    /// registered in the metadata store.
    name: String,
    /// The control listener's "host:port".
    control_addr: String,
    /// The metadata store (etcd), when not peer to peer.
    metadata: Option<Arc<crate::metadata::EtcdStore>>,
    /// Deadlines and the auth token of control connections.
    link: control::Link,
    /// Open segments' names -> their control addresses, for plugin
    /// messages addressed by segment name.
    peer_controls: PeerControls,
    plugins: PluginSet,
    transports: Vec<Arc<Transport>>,
    transport_failures: Vec<(String, Error)>,
    endpoints: Vec<(String, Vec<u8>)>,
    memory: MemoryRegistry,
    segments: RwLock<HashMap<SegmentId, Arc<RemoteSegment>>>,
    next_segment: AtomicU64,
    batches: Arc<BatchTable>,
    /// (segment, transport) pairs already logged.
    logged_routes: Mutex<HashSet<(SegmentId, usize)>>,
    /// Memory this engine allocated for the application, by address.
    allocations: Mutex<HashMap<u64, Allocation>>,
    /// Device memory from allocate_device, by address: its device plugin.
    device_allocations: Mutex<HashMap<u64, usize>>,
    /// How each device's memory ("cuda:0") would be registered for RDMA,
    /// and the host facts and policy behind it.
    gpu_direct: HashMap<String, crate::gpudirect::Decision>,
    gpu_direct_host: crate::gpudirect::HostFacts,
    gpu_direct_policy: crate::gpudirect::Policy,
    /// (device, transport, method) whose trial registration failed: not
    /// tried again.
    direct_failures: Mutex<Vec<(String, usize, crate::gpudirect::Method)>>,
    /// (device, transport, method) successes already logged.
    direct_logged: Mutex<HashSet<(String, usize, crate::gpudirect::Method)>>,
}

/// A device as the engine knows it: its plugin's description and where the
/// topology places it.
#[derive(Clone, Debug)]
pub struct Gpu {
    /// Index into the engine's device plugins.
    pub plugin: usize,
    pub info: crate::device::DeviceInfo,
    /// "cuda:N" as the driver numbers it.
    pub location: Location,
    /// The topology's name for the same PCI function (its PCI-order guess).
    pub topology_name: Option<String>,
}

/// Who allocated a buffer handed out by `allocate_memory`.
#[derive(Clone, Copy, Debug)]
enum Allocation {
    /// A transport's shareable memory (transport index).
    Transport(usize),
    /// A plain anonymous mapping of this many bytes.
    Anonymous(u64),
}

impl ControlHandler for Shared {
    fn descriptor(&self) -> SegmentDescriptor {
        self.describe()
    }

    fn request(
        &self,
        conn: u64,
        kind: control::MsgType,
        body: &[u8],
    ) -> Result<(control::MsgType, Vec<u8>)> {
        match kind {
            control::MsgType::StageOpen => self.stage_open(conn, body),
            control::MsgType::StageCopy => self.stage_copy(conn, body),
            control::MsgType::PluginRequest => {
                let (name, from, payload) = control::decode_plugin_request(body)?;
                let t = self
                    .transports
                    .iter()
                    .find(|t| t.name == name)
                    .ok_or_else(|| {
                        Error::new(
                            ErrorCode::NotFound,
                            format!("engine {} runs no transport {name}", self.name),
                        )
                    })?;
                let reply = t.peer_request(&from, payload)?;
                Ok((control::MsgType::PluginReply, reply))
            }
            _ => Err(Error::new(ErrorCode::Protocol, "unexpected request")),
        }
    }

    fn connection_closed(&self, conn: u64) {
        self.stage_close(conn);
    }
}

/// A Ferry engine. Share it between threads with `Arc<Engine>`; dropping
/// the last handle stops its listener and fails whatever is still in flight.
pub struct Engine {
    // Declared first: stops serving before the shared state goes.
    control: ControlServer,
    shared: Arc<Shared>,
}

fn advertised_host(config: &EngineConfig, bound: SocketAddr) -> String {
    if let Some(h) = &config.hostname {
        return h.clone();
    }
    let ip = bound.ip();
    if !ip.is_unspecified() {
        return ip.to_string();
    }
    first_non_loopback_ipv4()
        .map(|ip| ip.to_string())
        .unwrap_or_else(|| "127.0.0.1".to_string())
}

fn first_non_loopback_ipv4() -> Option<IpAddr> {
    // The source address the kernel would use to reach a public address,
    // found without sending anything (UDP connect only sets the route).
    let sock = std::net::UdpSocket::bind("0.0.0.0:0").ok()?;
    sock.connect("192.0.2.1:9").ok()?;
    let ip = sock.local_addr().ok()?.ip();
    (!ip.is_loopback() && !ip.is_unspecified()).then_some(ip)
}

impl Engine {
    /// Loads plugins, starts every enabled transport and the control listener.
    pub fn new(config: EngineConfig) -> Result<Engine> {
        let listener = ControlServer::bind(&config.listen)?;
        let bound = listener.local_addr().map_err(|e| {
            Error::new(
                ErrorCode::Io,
                format!("cannot read the control address: {e}"),
            )
        })?;
        let host_name = advertised_host(&config, bound);
        let control_addr = format!("{host_name}:{}", bound.port());
        if !bound.ip().is_loopback() && config.auth_token.is_none() {
            if !config.auth_off {
                return Err(Error::new(
                    ErrorCode::Permission,
                    format!(
                        "listening on {bound} (reachable from other hosts) without an auth token: \
                         set FERRY_AUTH_TOKEN (or FERRY_AUTH_TOKEN_FILE) to a secret shared by \
                         the cluster, or FERRY_AUTH=off to let anyone who can reach the port \
                         read and write registered memory"
                    ),
                ));
            }
            log::warn!(
                "listening on {bound} without an auth token (FERRY_AUTH=off): anyone who can \
                 reach this port can read and write registered memory"
            );
        }
        let link = control::Link::new(
            config.connect_timeout,
            config.timeout,
            config.auth_token.clone(),
        )
        .with_idle_timeout(config.idle_timeout);
        let metadata = match &config.metadata {
            crate::metadata::MetadataConfig::P2p => {
                if let Some(n) = &config.name {
                    log::warn!(
                        "name {n:?} ignored: without a metadata store (FERRY_METADATA) a \
                         segment's name is its control address, {control_addr}"
                    );
                }
                None
            }
            m => Some(crate::metadata::EtcdStore::connect(
                m,
                config.connect_timeout,
            )?),
        };
        let name = match (&metadata, &config.name) {
            (Some(_), Some(n)) => n.clone(),
            _ => control_addr.clone(),
        };

        let mut settings = config.settings.clone();
        settings
            .entry("timeout_ms".into())
            .or_insert_with(|| config.timeout.as_millis().to_string());
        settings
            .entry("connect_timeout_ms".into())
            .or_insert_with(|| config.connect_timeout.as_millis().to_string());
        settings
            .entry("idle_timeout_s".into())
            .or_insert_with(|| config.idle_timeout.as_secs().to_string());
        // The host peers reach this engine at: what a plugin listening on
        // every interface advertises (its engine's name may be an etcd name).
        settings.entry("hostname".into()).or_insert(host_name);
        // Plugins authenticate their own connections with the same token.
        if let Some(t) = &config.auth_token {
            settings.insert("auth.token".into(), t.expose());
        }
        let topology = Arc::new(
            Topology::discover(&config.topology)
                .map_err(|e| Error::new(ErrorCode::InvalidArgument, format!("topology: {e}")))?,
        );
        for w in topology.warnings() {
            log::warn!("topology: {w}");
        }
        let peer_controls: PeerControls = Arc::default();
        let host = CoreHost::new(settings, Some(topology.clone())).for_engine(
            &name,
            link.clone(),
            peer_controls.clone(),
        );
        let aliases = host.aliases();
        let plugins = crate::load_plugins(&config.loader, host);

        // Devices first: transports may ask where a device sits.
        let mut devices = Vec::new();
        for plugin in plugins.enabled(PluginKind::Device) {
            match Device::init(plugin) {
                Ok(Some(d)) => devices.push(Arc::new(d)),
                Ok(None) => {}
                Err(e) => log::warn!("device plugin {} failed to start: {e}", plugin.report.name),
            }
        }
        let gpus = discover_gpus(&devices, &topology);
        for g in &gpus {
            if let Some(t) = &g.topology_name {
                aliases.write().insert(g.location.to_string(), t.clone());
            }
        }

        let batches = Arc::new(BatchTable::default());
        let listen_host = bound.ip().to_string();
        let mut transports = Vec::new();
        let mut transport_failures = Vec::new();
        let mut endpoints = Vec::new();
        for plugin in plugins.enabled(PluginKind::Transport) {
            let started = Transport::init(plugin, &name, &listen_host, batches.clone()).and_then(
                |t| match t {
                    Some(t) => t.endpoint().map(|e| Some((t, e))),
                    None => Ok(None),
                },
            );
            match started {
                Ok(Some((t, endpoint))) => {
                    log::info!(
                        "engine {name}: transport {} started ({} bytes of endpoint data)",
                        t.name,
                        endpoint.len()
                    );
                    endpoints.push((t.name.clone(), endpoint));
                    transports.push(Arc::new(t));
                }
                Ok(None) => log::info!(
                    "engine {name}: transport {} is probe-only (no data path); not used",
                    plugin.report.name
                ),
                Err(e) => {
                    log::warn!(
                        "engine {name}: transport {} failed to start: {e}",
                        plugin.report.name
                    );
                    transport_failures.push((plugin.report.name.clone(), e));
                }
            }
        }
        if transports.is_empty() {
            log::warn!(
                "engine {name}: no transport can move data; run `ferry info` to see why each \
                 plugin is disabled"
            );
        }

        let (gpu_direct_policy, policy_warning) = crate::gpudirect::Policy::from_env();
        if let Some(w) = policy_warning {
            log::warn!("{w}");
        }
        let gpu_direct_host = crate::gpudirect::HostFacts::detect(
            topology.sysfs_root(),
            crate::gpudirect::no_direct_transport(&plugins),
        );
        let gpu_direct =
            gpu_direct_decisions(&gpus, &topology, gpu_direct_policy, &gpu_direct_host);
        let shared = Arc::new(Shared {
            gpu_direct,
            gpu_direct_host,
            gpu_direct_policy,
            direct_failures: Mutex::new(Vec::new()),
            direct_logged: Mutex::new(HashSet::new()),
            topology,
            devices,
            gpus,
            staging: staging::Staging::from_env(),
            identity: Identity::new(),
            name,
            control_addr,
            metadata,
            link,
            peer_controls,
            plugins,
            transports,
            transport_failures,
            endpoints,
            memory: MemoryRegistry::default(),
            segments: RwLock::new(HashMap::new()),
            next_segment: AtomicU64::new(1),
            batches,
            logged_routes: Mutex::new(HashSet::new()),
            allocations: Mutex::new(HashMap::new()),
            device_allocations: Mutex::new(HashMap::new()),
            config,
        });
        let weak: Weak<dyn ControlHandler> = Arc::downgrade(&shared) as Weak<dyn ControlHandler>;
        let control = ControlServer::start(listener, weak, &shared.link)?;
        if let Some(store) = &shared.metadata {
            if let Ok(Some(old)) = store.fetch(&shared.name) {
                if let Ok(d) = SegmentDescriptor::from_json(&old) {
                    log::warn!(
                        "metadata: segment {} was registered by engine {} (at {}); replacing it",
                        shared.name,
                        d.engine_id,
                        d.control_addr()
                    );
                }
            }
            store.publish(&shared.name, shared.describe().to_json())?;
            log::info!(
                "metadata: registered segment {} in etcd at {}",
                shared.name,
                store.endpoints()
            );
        }
        log::info!(
            "engine {} listening; transports: {}",
            shared.name,
            shared
                .transports
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
        Ok(Engine { control, shared })
    }

    /// This engine's segment name for peers to open: "host:port", or its
    /// name in the metadata store.
    pub fn segment_name(&self) -> &str {
        &self.shared.name
    }

    /// The metadata store's segments (name, descriptor), or an error
    /// without one.
    pub fn list_segments(&self) -> Result<Vec<(String, SegmentDescriptor)>> {
        list_segments(self.shared.metadata.as_deref())
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

    /// Transports that were enabled but failed to start, with the error.
    pub fn transport_failures(&self) -> &[(String, Error)] {
        &self.shared.transport_failures
    }

    pub fn config(&self) -> &EngineConfig {
        &self.shared.config
    }

    /// Devices (GPUs) the device plugins report, in the driver's numbering.
    pub fn gpus(&self) -> &[Gpu] {
        &self.shared.gpus
    }

    /// Allocates device memory on `location` (e.g. cuda:0) through its device
    /// plugin; register it to move it. For tools and tests: applications
    /// normally bring their own (framework) allocations.
    pub fn allocate_device(&self, location: Location, len: u64) -> Result<u64> {
        let (plugin, ordinal) = self.shared.device_of(location)?;
        let addr = self.shared.devices[plugin].alloc_device(ordinal, len)?;
        self.shared.device_allocations.lock().insert(addr, plugin);
        Ok(addr)
    }

    /// Frees memory from [`Engine::allocate_device`] (unregister it first).
    pub fn free_device(&self, addr: u64) -> Result<()> {
        let plugin = self
            .shared
            .device_allocations
            .lock()
            .remove(&addr)
            .ok_or_else(|| {
                Error::new(
                    ErrorCode::NotFound,
                    format!("{addr:#x} was not returned by allocate_device"),
                )
            })?;
        self.shared.devices[plugin].free_device(addr);
        Ok(())
    }

    /// A DMA-BUF fd for `[addr, addr + len)` of device memory (for RDMA
    /// registration), and `addr`'s offset inside the exported range.
    pub fn export_dmabuf(&self, addr: u64, len: u64) -> Result<(std::os::fd::OwnedFd, u64)> {
        use std::os::fd::FromRawFd;
        for d in &self.shared.devices {
            if let Ok((PointerKind::Device(_), _, _)) = d.query_pointer(addr) {
                let (fd, offset) = d.export_dmabuf(addr, len)?;
                if fd < 0 {
                    return Err(Error::new(
                        ErrorCode::Plugin,
                        format!("{}: exported no fd", d.name),
                    ));
                }
                // SAFETY: the plugin hands ownership of a fresh fd to us.
                return Ok((unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) }, offset));
            }
        }
        Err(Error::new(
            ErrorCode::InvalidArgument,
            format!("{addr:#x} is not device memory of any device plugin"),
        ))
    }

    /// Host memory the first device copies to and from fastest (pinned);
    /// free it with [`Engine::free_pinned`].
    pub fn allocate_pinned(&self, len: u64) -> Result<u64> {
        let d = self
            .shared
            .devices
            .first()
            .ok_or_else(|| Error::new(ErrorCode::Unsupported, "no device plugin is loaded"))?;
        d.alloc_pinned(len)
    }

    pub fn free_pinned(&self, addr: u64) {
        if let Some(d) = self.shared.devices.first() {
            d.free_pinned(addr);
        }
    }

    /// Queues `(dst, src, len)` copies on one stream of device `location`
    /// and waits for all of them: for measuring copy bandwidth.
    ///
    /// # Safety
    /// Every range must be valid memory of this process.
    pub unsafe fn copy_batch(&self, location: Location, copies: &[(u64, u64, u64)]) -> Result<()> {
        let (plugin, ordinal) = self.shared.device_of(location)?;
        let mut stream = self.shared.devices[plugin].stream(ordinal)?;
        for &(dst, src, len) in copies {
            stream.copy(dst, src, len)?;
        }
        stream.sync()
    }

    /// Copies `len` bytes from `src` to `dst`, either of which may be device
    /// memory (through its device plugin), and waits for the copy.
    ///
    /// # Safety
    /// Both ranges must be valid memory of this process for `len` bytes, and
    /// no transfer may be writing `dst` meanwhile.
    pub unsafe fn copy_memory(&self, dst: u64, src: u64, len: u64) -> Result<()> {
        for d in &self.shared.devices {
            let on_device = |a: u64| {
                d.query_pointer(a)
                    .map(|(k, _, _)| matches!(k, PointerKind::Device(_)))
                    .unwrap_or(false)
            };
            if on_device(dst) || on_device(src) {
                let mut stream = d.stream(0)?;
                stream.copy(dst, src, len)?;
                return stream.sync();
            }
        }
        // SAFETY: host memory on both sides, valid per the caller's contract.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len as usize) };
        Ok(())
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
    /// why better methods were skipped (DESIGN.md's tiers), if it is a GPU
    /// this engine knows.
    pub fn gpu_direct(&self, location: Location) -> Option<String> {
        self.shared
            .gpu_direct
            .get(&location.to_string())
            .map(|d| d.explain())
    }

    /// How the buffer registered at `addr` is registered: each transport's
    /// name with the `FERRY_MEM_*` bit it registered it as (for device
    /// memory, DMA-BUF or nvidia-peermem; none at all means staged).
    pub fn registrations(&self, addr: u64) -> Result<Vec<(String, u64)>> {
        let b = self.shared.memory.find(addr, 1).ok_or_else(|| {
            Error::new(
                ErrorCode::NotFound,
                format!("no buffer registered at {addr:#x}"),
            )
        })?;
        Ok(b.registrations
            .iter()
            .map(|r| (self.shared.transports[r.transport].name.clone(), r.mem_kind))
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
        self.shared.open_segment(name)
    }

    /// Closes a segment; its connections are dropped and requests in flight
    /// to it fail.
    pub fn close_segment(&self, id: SegmentId) -> Result<()> {
        let seg = self.shared.segments.write().remove(&id);
        match seg {
            Some(_) => Ok(()),
            None => Err(unknown_segment(id)),
        }
    }

    /// Re-reads the peer's descriptor now (it is also re-read automatically
    /// when a request falls outside the known buffers).
    pub fn refresh_segment(&self, id: SegmentId) -> Result<()> {
        let seg = self.shared.segment(id)?;
        self.shared.refresh(&seg).map(|_| ())
    }

    /// A new batch with room for `capacity` requests.
    pub fn allocate_batch(&self, capacity: usize) -> Result<BatchId> {
        Ok(self.shared.batches.allocate(capacity)?.id)
    }

    /// Adds requests to a batch and starts them. Requests are checked first;
    /// if any is invalid (zero length, memory not registered here or at the
    /// peer, unknown segment, no transport can serve it), the call fails and
    /// nothing is submitted. Requests a transport then refuses (an unreachable
    /// peer) are marked failed in the batch.
    pub fn submit(&self, batch: BatchId, requests: &[Request]) -> Result<()> {
        self.shared.submit(batch, requests)
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
        let batch = self.allocate_batch(requests.len().max(1))?;
        let result = self
            .submit(batch, requests)
            .and_then(|_| self.wait(batch, self.shared.config.timeout * 2));
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
                format!("{} requests did not finish in time", status.pending),
            ));
        }
        let _ = self.free_batch(batch);
        match status.first_error {
            Some((i, e)) => Err(Error::new(e.code, format!("request {i}: {}", e.message))),
            None => Ok(()),
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
        let seg = self.shared.segment(segment)?;
        let local = self.shared.local_buffer(0, local_addr, len)?;
        let view = seg.view.read().clone();
        let remote = view
            .find(remote_addr, len)
            .ok_or_else(|| remote_out_of_bounds(0, &seg, remote_addr, len, view.buffers.len()))?;
        let remote_on_device = !view.buffers[remote].location.starts_with("cpu");
        let (t, reason) = match self.shared.select(&local, &seg, &view, remote, None, true) {
            Ok(r) => r,
            Err(e) if local.device.is_none() && !remote_on_device => return Err(e),
            Err(_) => {
                // Device memory that no transport moves directly is staged:
                // the host leg runs between pinned slots.
                let host_local = match local.device {
                    Some(_) => self.shared.local_slot_buffer()?,
                    None => local.clone(),
                };
                let (v, idx) = if remote_on_device {
                    (self.shared.remote_staging(&seg)?.view().clone(), 0)
                } else {
                    (view.clone(), remote)
                };
                let (t, host_reason) =
                    self.shared.select(&host_local, &seg, &v, idx, None, true)?;
                let sides = match (local.device.is_some(), remote_on_device) {
                    (true, true) => "on both sides",
                    (true, false) => "on this side",
                    _ => "at the peer",
                };
                (
                    t,
                    format!(
                        "{} memory to {} memory: no transport moves device memory directly here, \
                         so it is staged through pinned host memory {sides}, pipelined; host leg: {host_reason}",
                        local.location, view.buffers[remote].location
                    ),
                )
            }
        };
        let peer = self.shared.peer(&seg, t).ok();
        let transport = &self.shared.transports[t];
        // Socket transports go where the kernel routes; RDMA picks its NICs
        // itself and same-host transports use none.
        let nic = if transport.name.starts_with("rdma")
            || transport.scopes & sys::FERRY_SCOPE_CROSS_HOST == 0
        {
            None
        } else {
            self.shared.route_nic(&seg, &local)
        };
        Ok(Route {
            transport: transport.name.clone(),
            scope: seg.scope,
            reason,
            peer_detail: peer.and_then(|p| transport.describe(&p)),
            nic,
        })
    }

    /// The descriptor of an open segment, as last fetched.
    pub fn descriptor_of(&self, id: SegmentId) -> Result<SegmentDescriptor> {
        Ok(self.shared.segment(id)?.view.read().descriptor.clone())
    }

    /// This engine's own descriptor, as peers see it.
    pub fn descriptor(&self) -> SegmentDescriptor {
        self.shared.describe()
    }
}

fn unknown_segment(id: SegmentId) -> Error {
    Error::new(
        ErrorCode::NotFound,
        format!("no open segment with id {id} (never opened, or closed)"),
    )
}

fn remote_out_of_bounds(
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

/// Requests for one (segment, transport), each with its index in `routed`.
type TargetGroup = (
    (SegmentId, usize),
    Vec<(sys::ferry_transfer_request_t, usize)>,
);

/// A group of adjacent requests for one transport and segment.
struct Pending {
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
    fn progress(&self) {
        for t in &self.transports {
            t.progress();
        }
    }

    fn wait(&self, batch: &crate::batch::Batch, timeout: Duration) -> BatchStatus {
        batch.wait(timeout, self.config.spin, || self.progress())
    }

    fn segment(&self, id: SegmentId) -> Result<Arc<RemoteSegment>> {
        self.segments
            .read()
            .get(&id)
            .cloned()
            .ok_or_else(|| unknown_segment(id))
    }

    fn local_buffer(&self, i: usize, addr: u64, len: u64) -> Result<Arc<LocalBuffer>> {
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

    fn buffer_descriptor(&self, b: &LocalBuffer) -> BufferDescriptor {
        BufferDescriptor {
            addr: b.addr,
            len: b.len,
            location: b.location.to_string(),
            keys: b
                .registrations
                .iter()
                .map(|r| BufferKey {
                    transport: self.transports[r.transport].name.clone(),
                    key: encode_blob(&r.key),
                })
                .collect(),
        }
    }

    /// The interface the kernel uses toward the segment's host, and its NIC.
    fn route_nic(&self, seg: &RemoteSegment, local: &LocalBuffer) -> Option<RouteNic> {
        use std::net::ToSocketAddrs;
        let control = seg.view.read().descriptor.control_addr().to_string();
        let peer = control.to_socket_addrs().ok()?.next()?;
        let local_ip = ferry_plugins_abi::sdk::net::source_address_toward(peer)?;
        let itf = ferry_plugins_abi::sdk::net::interface_with(local_ip)?;
        let nic = self
            .topology
            .nic_by_netdev(&itf.name)
            .or_else(|| self.topology.nic(&itf.name));
        let location = local.location.to_string();
        Some(RouteNic {
            interface: itf.name.clone(),
            local_ip,
            loopback: itf.loopback,
            nic: nic.map(|n| n.name.clone()),
            pci: nic.and_then(|n| n.pci.map(|p| p.to_string())),
            class: nic.and_then(|n| self.topology.path_class(&location, &n.name)),
        })
    }

    fn describe(&self) -> SegmentDescriptor {
        let buffers = self
            .memory
            .all()
            .iter()
            .filter(|b| b.visibility == Visibility::Published)
            .map(|b| self.buffer_descriptor(b))
            .collect();
        SegmentDescriptor {
            version: DESCRIPTOR_VERSION,
            name: self.name.clone(),
            control: self.control_addr.clone(),
            engine_id: self.identity.engine_id.clone(),
            machine_id: self.identity.machine_id.clone(),
            process_id: self.identity.process_id.clone(),
            transports: self
                .endpoints
                .iter()
                .map(|(name, e)| TransportEndpoint {
                    name: name.clone(),
                    endpoint: encode_blob(e),
                })
                .collect(),
            buffers,
        }
    }

    fn register_memory(&self, addr: u64, len: u64, location: Option<Location>) -> Result<()> {
        self.register(addr, len, location, Visibility::Published)
            .map(|_| ())
    }

    /// What memory `[addr, addr + len)` is: asks every device plugin, and
    /// checks a location the caller gave against what the driver says.
    fn classify(
        &self,
        addr: u64,
        len: u64,
        given: Option<Location>,
    ) -> Result<(Location, u64, Option<usize>)> {
        for (i, d) in self.devices.iter().enumerate() {
            let (kind, base, size) = d.query_pointer(addr)?;
            let ordinal = match kind {
                PointerKind::Device(o) => o,
                // Pinned and managed memory are host-addressable: any host
                // transport can move them.
                PointerKind::Host | PointerKind::HostPinned | PointerKind::Managed(_) => continue,
            };
            if size > 0 && addr.saturating_add(len) > base.saturating_add(size) {
                return Err(Error::new(
                    ErrorCode::OutOfBounds,
                    format!(
                        "[{addr:#x}, +{len}) runs past the end of its {} allocation [{base:#x}, +{size})",
                        d.name
                    ),
                ));
            }
            let location = match d.name.as_str() {
                "rocm" => Location::Rocm(ordinal),
                _ => Location::Cuda(ordinal),
            };
            if let Some(g) = given {
                if g != location {
                    return Err(Error::new(
                        ErrorCode::InvalidArgument,
                        format!("the location given is {g}, but the {} driver says the memory is on {location}", d.name),
                    ));
                }
            }
            return Ok((location, sys::FERRY_MEM_CUDA_STAGED, Some(i)));
        }
        match given {
            Some(Location::Cpu(n)) => Ok((Location::Cpu(n), sys::FERRY_MEM_HOST, None)),
            Some(other) => Err(Error::new(
                ErrorCode::Unsupported,
                format!(
                    "registering {other} memory needs a device plugin that owns it, and none does \
                     (`ferry info` shows the device plugins)"
                ),
            )),
            None => Ok((host_location(addr), sys::FERRY_MEM_HOST, None)),
        }
    }

    /// Registers a buffer with every transport that can move its memory.
    fn register(
        &self,
        addr: u64,
        len: u64,
        location: Option<Location>,
        visibility: Visibility,
    ) -> Result<Arc<LocalBuffer>> {
        if addr == 0 || len == 0 {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                format!("cannot register [{addr:#x}, +{len}): null address or zero length"),
            ));
        }
        self.memory.check_free(addr, len)?;
        let (location, mem_kind, device) = self.classify(addr, len, location)?;
        let numa = match location {
            Location::Cpu(n) => Some(n),
            _ => None,
        };
        let location_s = location.to_string();
        let local_only = visibility == Visibility::LocalOnly;
        let mut registrations = Vec::new();
        for (i, t) in self.transports.iter().enumerate() {
            if let Some(plugin) = device {
                let spec = RegionSpec {
                    addr,
                    len,
                    mem_kind: 0,
                    location: &location_s,
                    numa_node: None,
                    device_ordinal: match location {
                        Location::Cuda(o) | Location::Rocm(o) => Some(o),
                        Location::Cpu(_) => None,
                    },
                    dmabuf: None,
                    local_only,
                };
                if let Some(r) = self.register_device(i, t, plugin, &spec) {
                    registrations.push(r);
                }
                continue;
            }
            if t.mem_kinds & mem_kind == 0 {
                continue;
            }
            let spec = RegionSpec {
                addr,
                len,
                mem_kind,
                location: &location_s,
                numa_node: numa,
                device_ordinal: None,
                dmabuf: None,
                local_only,
            };
            match t.register(&spec) {
                Ok((handle, key)) => registrations.push(TransportRegistration {
                    transport: i,
                    handle,
                    key,
                    mem_kind,
                }),
                Err(e) => log::warn!(
                    "{}: cannot register [{addr:#x}, +{len}) ({location_s}): {e}",
                    t.name
                ),
            }
        }
        // Device memory that no transport reaches directly is staged through
        // host memory; host memory must be reachable by some transport.
        if registrations.is_empty() && device.is_none() && !self.transports.is_empty() {
            return Err(Error::new(
                ErrorCode::Unsupported,
                format!("no transport can register {location_s} memory at {addr:#x}"),
            ));
        }
        log::debug!("registered [{addr:#x}, +{len}) at {location_s} ({visibility:?})");
        let published = visibility == Visibility::Published;
        let buffer = Arc::new(LocalBuffer {
            addr,
            len,
            location,
            mem_kind,
            device,
            visibility,
            registrations,
            inflight: Default::default(),
        });
        self.memory.insert(buffer.clone());
        if published {
            self.publish();
        }
        Ok(buffer)
    }

    /// Registers device memory directly with transport `t` (an RDMA NIC
    /// reading and writing GPU memory), by the methods the GPU-direct
    /// decision allows, best first: DMA-BUF, then nvidia-peermem. The trial
    /// registration is the ground truth: a method that fails falls back one
    /// step (and is not tried again for this device), and `None` means the
    /// memory is staged through host memory for this transport.
    fn register_device(
        &self,
        i: usize,
        t: &Transport,
        plugin: usize,
        spec: &RegionSpec<'_>,
    ) -> Option<TransportRegistration> {
        use crate::gpudirect::Method;
        let direct = sys::FERRY_MEM_CUDA_DMABUF | sys::FERRY_MEM_CUDA_PEERMEM;
        if t.mem_kinds & direct == 0 {
            return None;
        }
        let ladder = self.direct_methods(spec.location);
        let failed_before: Vec<Method> = self
            .direct_failures
            .lock()
            .iter()
            .filter(|(loc, ti, _)| loc == spec.location && *ti == i)
            .map(|(_, _, m)| *m)
            .collect();
        let mut first_try = true;
        for (n, method) in ladder.iter().enumerate() {
            let bit = match method {
                Method::DmaBuf => sys::FERRY_MEM_CUDA_DMABUF,
                Method::PeerMem => sys::FERRY_MEM_CUDA_PEERMEM,
                Method::Staged => continue,
            };
            let next = ladder
                .get(n + 1..)
                .unwrap_or_default()
                .iter()
                .find(|m| !failed_before.contains(m))
                .copied()
                .unwrap_or(Method::Staged);
            if failed_before.contains(method) {
                continue;
            }
            if t.mem_kinds & bit == 0 {
                first_try = false;
                let key = (spec.location.to_string(), i, *method);
                if self.direct_logged.lock().insert(key) {
                    log::info!(
                        "{}: does not register {} memory by {} on this host (`ferry info` says \
                         why); trying {}",
                        t.name,
                        spec.location,
                        method.as_str(),
                        next.as_str()
                    );
                }
                continue;
            }
            let exported = if *method == Method::DmaBuf {
                let why = match self.devices[plugin].export_dmabuf(spec.addr, spec.len) {
                    Ok((fd, offset)) if fd >= 0 => {
                        use std::os::fd::FromRawFd;
                        // SAFETY: the device plugin hands us a fresh fd we own.
                        let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
                        Ok((fd, offset))
                    }
                    Ok(_) => Err("the device plugin exported no fd".to_string()),
                    Err(e) => Err(e.message),
                };
                match why {
                    Ok(pair) => Some(pair),
                    Err(why) => {
                        first_try = false;
                        log::info!(
                            "{}: cannot export {} memory at {:#x} as DMA-BUF ({why}); falling \
                             back to {}",
                            t.name,
                            spec.location,
                            spec.addr,
                            next.as_str()
                        );
                        continue;
                    }
                }
            } else {
                None
            };
            let attempt = RegionSpec {
                mem_kind: bit,
                dmabuf: exported.as_ref().map(|(fd, off)| {
                    use std::os::fd::AsRawFd;
                    (fd.as_raw_fd(), *off)
                }),
                ..*spec
            };
            // The fd is closed when `exported` drops: the NIC's registration
            // holds its own reference to the buffer.
            match t.register(&attempt) {
                Ok((handle, key)) => {
                    let newly =
                        self.direct_logged
                            .lock()
                            .insert((spec.location.to_string(), i, *method));
                    if newly {
                        log::info!(
                            "{}: {} memory is registered by {} (trial registration succeeded{})",
                            t.name,
                            spec.location,
                            method.as_str(),
                            if first_try {
                                String::new()
                            } else {
                                "; better methods failed, see above".to_string()
                            }
                        );
                    }
                    return Some(TransportRegistration {
                        transport: i,
                        handle,
                        key,
                        mem_kind: bit,
                    });
                }
                Err(e) => {
                    first_try = false;
                    log::info!(
                        "{}: registering {} memory by {} failed ({}); falling back to {}",
                        t.name,
                        spec.location,
                        method.as_str(),
                        e.message,
                        next.as_str()
                    );
                    self.direct_failures
                        .lock()
                        .push((spec.location.to_string(), i, *method));
                }
            }
        }
        None
    }

    /// The direct registration methods the GPU-direct decision allows for
    /// device memory at `location`, best first.
    fn direct_methods(&self, location: &str) -> Vec<crate::gpudirect::Method> {
        use crate::gpudirect::{Method, Policy};
        let Some(d) = self.gpu_direct.get(location) else {
            return Vec::new();
        };
        match d.method {
            Method::DmaBuf => {
                let mut m = vec![Method::DmaBuf];
                if self.gpu_direct_host.peermem.is_some()
                    && self.gpu_direct_policy != Policy::DmaBuf
                {
                    m.push(Method::PeerMem);
                }
                m
            }
            Method::PeerMem => vec![Method::PeerMem],
            Method::Staged => Vec::new(),
        }
    }

    fn allocate_memory(&self, len: u64, numa_node: Option<u32>) -> Result<u64> {
        self.allocate(len, numa_node, Visibility::Published)
    }

    fn allocate(&self, len: u64, numa_node: Option<u32>, visibility: Visibility) -> Result<u64> {
        if len == 0 {
            return Err(Error::new(
                ErrorCode::InvalidArgument,
                "cannot allocate 0 bytes",
            ));
        }
        let mut found = None;
        for (i, t) in self.transports.iter().enumerate() {
            match t.allocate(len, numa_node) {
                None => continue,
                Some(Ok(addr)) => {
                    found = Some((addr, Allocation::Transport(i)));
                    break;
                }
                Some(Err(e)) => log::warn!("{}: cannot allocate {len} bytes: {e}", t.name),
            }
        }
        let (addr, owner) = match found {
            Some(f) => f,
            None => (anonymous_map(len)?, Allocation::Anonymous(len)),
        };
        let location = numa_node.map(Location::Cpu);
        if let Err(e) = self.register(addr, len, location, visibility) {
            self.release(addr, owner);
            return Err(e);
        }
        self.allocations.lock().insert(addr, owner);
        Ok(addr)
    }

    fn free_memory(&self, addr: u64) -> Result<()> {
        let owner = self.allocations.lock().get(&addr).copied().ok_or_else(|| {
            Error::new(
                ErrorCode::NotFound,
                format!("{addr:#x} was not returned by allocate_memory (or is freed already)"),
            )
        })?;
        self.unregister_memory(addr)?;
        self.allocations.lock().remove(&addr);
        self.release(addr, owner);
        Ok(())
    }

    fn release(&self, addr: u64, owner: Allocation) {
        match owner {
            Allocation::Transport(i) => {
                if let Err(e) = self.transports[i].free(addr) {
                    log::warn!("freeing {addr:#x}: {e}");
                }
            }
            // SAFETY: addr/len describe a mapping anonymous_map made and that
            // nothing references any more (unregistered above).
            Allocation::Anonymous(len) => unsafe {
                libc::munmap(addr as *mut libc::c_void, len as usize);
            },
        }
    }

    fn unregister_memory(&self, addr: u64) -> Result<()> {
        let buffer = self.memory.remove(addr).ok_or_else(|| {
            Error::new(
                ErrorCode::NotFound,
                format!("no buffer registered at {addr:#x} (unregister takes the start address)"),
            )
        })?;
        // Let local transfers that use the buffer finish: every transport
        // completes or fails a request within its timeout.
        let deadline = Instant::now() + self.config.timeout * 2 + Duration::from_secs(1);
        while buffer.inflight.load(Ordering::SeqCst) != 0 {
            if Instant::now() > deadline {
                let n = buffer.inflight.load(Ordering::SeqCst);
                self.memory.insert(buffer);
                return Err(Error::new(
                    ErrorCode::Busy,
                    format!("{n} transfers using the buffer at {addr:#x} are still in flight"),
                ));
            }
            std::thread::sleep(Duration::from_micros(200));
        }
        let mut first_error = None;
        for r in &buffer.registrations {
            if let Err(e) = self.transports[r.transport].unregister(r.handle) {
                log::warn!("unregistering {addr:#x}: {e}");
                first_error.get_or_insert(e);
            }
        }
        if buffer.visibility == Visibility::Published {
            self.publish();
        }
        first_error.map_or(Ok(()), Err)
    }

    /// The device plugin and ordinal serving a device location.
    fn device_of(&self, location: Location) -> Result<(usize, u32)> {
        self.gpus
            .iter()
            .find(|g| g.location == location)
            .map(|g| {
                let ordinal = match g.location {
                    Location::Cuda(o) | Location::Rocm(o) => o,
                    Location::Cpu(n) => n,
                };
                (g.plugin, ordinal)
            })
            .ok_or_else(|| {
                Error::new(
                    ErrorCode::NotFound,
                    format!("no device {location} (`ferry info` lists the devices)"),
                )
            })
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

    /// Stores this engine's descriptor in the metadata store, if any. A
    /// failure is logged: the store's keeper stores it once etcd answers.
    fn publish(&self) {
        if let Some(store) = &self.metadata {
            if let Err(e) = store.publish(&self.name, self.describe().to_json()) {
                log::warn!("metadata: {e}");
            }
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

    fn open_segment(&self, name: &str) -> Result<SegmentId> {
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
    fn refresh(&self, seg: &RemoteSegment) -> Result<Arc<RemoteView>> {
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

    /// Picks the transport for one request and says why: the best-ranked
    /// transport that can move this memory to a peer in this scope, runs at
    /// the peer, has a key for the remote buffer, and does not decline this
    /// peer or buffer (asked once, remembered).
    /// The reason is only put into words when `explain` is set (for logs
    /// and `route`), which keeps the per-request path free of formatting.
    fn select(
        &self,
        local: &LocalBuffer,
        seg: &RemoteSegment,
        view: &RemoteView,
        remote: usize,
        hint: Option<&str>,
        explain: bool,
    ) -> Result<(usize, String)> {
        let remote_buf = &view.buffers[remote];
        let mut candidates: Vec<(usize, (u8, u8))> = Vec::new();
        let mut rejected: Vec<String> = Vec::new();
        for (i, t) in self.transports.iter().enumerate() {
            if hint.is_some_and(|h| h != t.name) {
                continue;
            }
            let verdict = if local.device.is_some() && local.registration(i).is_none() {
                Some(format!(
                    "{} did not register this {} memory directly",
                    t.name, local.location
                ))
            } else if local.device.is_none() && t.mem_kinds & local.mem_kind == 0 {
                Some(format!("{} cannot move {} memory", t.name, local.location))
            } else if !crate::transport::scope_served(t.scopes, seg.scope.raw()) {
                Some(format!(
                    "{} cannot reach a peer on {}",
                    t.name,
                    seg.scope.as_str()
                ))
            } else if !view.endpoints.contains_key(&t.name) {
                Some(format!("{} does not run at the peer", t.name))
            } else if !remote_buf.keys.contains_key(&t.name) {
                Some(format!(
                    "{} did not register the peer's buffer at {:#x}",
                    t.name, remote_buf.addr
                ))
            } else {
                None
            };
            match verdict {
                Some(v) => rejected.push(v),
                None => candidates.push((i, rank(t))),
            }
        }
        candidates.sort_by_key(|(i, r)| (*r, *i));
        let mut chosen = None;
        for (i, _) in &candidates {
            let key = remote_buf
                .keys
                .get(&self.transports[*i].name)
                .map(|k| &k[..])
                .unwrap_or_default();
            match self.acceptance(seg, *i, key) {
                Ok(()) => {
                    chosen = Some(*i);
                    break;
                }
                Err(why) => rejected.push(format!("{} declined: {why}", self.transports[*i].name)),
            }
        }
        let Some(best) = chosen else {
            let what = match hint {
                Some(h) => format!("transport {h} was requested but cannot serve this request"),
                None => format!(
                    "no transport can move {} memory to {} ({})",
                    local.location,
                    seg.name,
                    seg.scope.as_str()
                ),
            };
            let code = if hint.is_some() {
                ErrorCode::Unsupported
            } else {
                ErrorCode::Unavailable
            };
            return Err(Error::new(
                code,
                format!(
                    "{what}: {}",
                    if rejected.is_empty() {
                        "this engine has no transport plugin that can move data (`ferry info` \
                         shows why each plugin is disabled; FERRY_PLUGIN_PATH adds directories)"
                            .to_string()
                    } else {
                        rejected.join("; ")
                    }
                ),
            ));
        };
        let t = &self.transports[best];
        if !explain {
            return Ok((best, String::new()));
        }
        if hint.is_some() {
            return Ok((best, format!("{} was requested", t.name)));
        }
        let mut reason = format!(
            "{} memory to {} memory on {}: {}",
            local.location,
            remote_buf.location,
            seg.scope.as_str(),
            rank_reason(t, seg.scope)
        );
        if let Some(r) = local.registration(best).filter(|_| local.device.is_some()) {
            let how = ferry_plugins_abi::caps::mem_kind_names(r.mem_kind).join(", ");
            reason.push_str(&format!(
                " (local {} memory registered as {how})",
                local.location
            ));
        }
        let others: Vec<&str> = candidates
            .iter()
            .map(|(i, _)| *i)
            .filter(|i| *i != best && rank(&self.transports[*i]) >= rank(t))
            .map(|i| self.transports[i].name.as_str())
            .collect();
        if !others.is_empty() {
            reason.push_str(&format!("; preferred over {}", others.join(", ")));
        }
        if !rejected.is_empty() {
            reason.push_str(&format!("; not usable: {}", rejected.join("; ")));
        }
        Ok((best, reason))
    }

    /// Whether a transport serves this segment's buffer with `key`: asks
    /// the plugin once (connect, then accepts) and remembers the answer.
    fn acceptance(
        &self,
        seg: &RemoteSegment,
        transport: usize,
        key: &[u8],
    ) -> std::result::Result<(), String> {
        if let Some(v) = seg.verdicts.lock().get(&transport).and_then(|m| m.get(key)) {
            return v.clone();
        }
        let t = &self.transports[transport];
        let strip = |m: String| -> String {
            m.strip_prefix(&format!("{}: ", t.name))
                .map(str::to_string)
                .unwrap_or(m)
        };
        let verdict = match self.peer(seg, transport) {
            Ok(peer) => match t.accepts(&peer, key) {
                Ok(()) => Ok(()),
                Err(e) => Err(strip(e.message)),
            },
            // Other connection errors are the peer's state, not a refusal:
            // let the request try and report them.
            Err(e) if e.code != ErrorCode::Unavailable => return Ok(()),
            Err(e) => Err(strip(e.message)),
        };
        if let Err(why) = &verdict {
            log::info!(
                "segment {}: {} declined some of its buffers ({why}); using the next transport \
                 for them",
                seg.name,
                t.name
            );
        }
        seg.verdicts
            .lock()
            .entry(transport)
            .or_default()
            .insert(key.to_vec(), verdict.clone());
        verdict
    }

    fn peer(&self, seg: &RemoteSegment, transport: usize) -> Result<Arc<PeerHandle>> {
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

    fn submit(self: &Arc<Self>, batch_id: BatchId, requests: &[Request]) -> Result<()> {
        self.submit_with(batch_id, requests, None)
    }

    /// Submits requests; with `slots`, remote addresses are in staging
    /// slots a peer lent us rather than in its published buffers.
    fn submit_with(
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

/// Every device the device plugins report, placed in the topology by PCI
/// bus id (the driver's numbering replaces the topology's PCI-order guess).
pub(crate) fn discover_gpus(devices: &[Arc<Device>], topology: &Topology) -> Vec<Gpu> {
    let mut gpus = Vec::new();
    for (plugin, d) in devices.iter().enumerate() {
        let count = match d.device_count() {
            Ok(n) => n,
            Err(e) => {
                log::warn!("{}: cannot count devices: {e}", d.name);
                continue;
            }
        };
        for ordinal in 0..count {
            let info = match d.device_info(ordinal) {
                Ok(i) => i,
                Err(e) => {
                    log::warn!("{}: device {ordinal}: {e}", d.name);
                    continue;
                }
            };
            let topology_name = info
                .pci_bus_id
                .parse::<PciAddress>()
                .ok()
                .and_then(|pci| topology.gpu_by_pci(&pci))
                .map(|g| g.name.clone());
            let location = match d.name.as_str() {
                "rocm" => Location::Rocm(ordinal),
                _ => Location::Cuda(ordinal),
            };
            log::info!(
                "{location} is {} at PCI {}{}",
                info.name,
                info.pci_bus_id,
                match &topology_name {
                    Some(t) if *t != location.to_string() =>
                        format!(" (the topology's {t}: the driver's numbering wins)"),
                    Some(_) => String::new(),
                    None => " (not found in the sysfs PCI tree)".to_string(),
                }
            );
            gpus.push(Gpu {
                plugin,
                info,
                location,
                topology_name,
            });
        }
    }
    gpus
}

/// How each GPU's memory would be registered for RDMA (DESIGN.md's tiers,
/// judged against the GPU's closest RDMA NIC), logged once per GPU.
fn gpu_direct_decisions(
    gpus: &[Gpu],
    topology: &Topology,
    policy: crate::gpudirect::Policy,
    host: &crate::gpudirect::HostFacts,
) -> HashMap<String, crate::gpudirect::Decision> {
    use crate::gpudirect::{decide, GpuFacts, PairFacts};
    let mut out = HashMap::new();
    for g in gpus {
        let location = g.location.to_string();
        let topo_name = g.topology_name.clone().unwrap_or_else(|| location.clone());
        let pair = topology
            .preferred_nics(&topo_name)
            .unwrap_or_default()
            .iter()
            .find(|r| {
                r.usable
                    && topology
                        .nic(&r.name)
                        .is_some_and(|n| n.kind == crate::topology::NicKind::Rdma)
            })
            .map(|r| PairFacts {
                nic: r.name.clone(),
                class: r.class,
                nic_dmabuf: None,
            });
        let facts = GpuFacts {
            gpu_direct_rdma: g.info.gpu_direct_rdma,
            dmabuf: g.info.dmabuf,
            dmabuf_export: g.info.dmabuf_export,
        };
        let d = decide(policy, &facts, host, pair.as_ref());
        log::info!("{location} memory for RDMA: {}", d.explain());
        out.insert(location, d);
    }
    out
}

/// A private anonymous mapping of `len` bytes.
fn anonymous_map(len: u64) -> Result<u64> {
    let len = usize::try_from(len)
        .map_err(|_| Error::new(ErrorCode::InvalidArgument, "allocation too large"))?;
    // SAFETY: a fresh anonymous mapping; the result is checked below.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(Error::new(
            ErrorCode::NoMemory,
            format!(
                "cannot allocate {len} bytes: {}",
                std::io::Error::last_os_error()
            ),
        ));
    }
    Ok(ptr as u64)
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

/// Lower is better: transports limited to one process beat those limited to
/// one host, which beat cross-host ones; among cross-host ones RDMA beats
/// vendor plugins, which beat TCP, the transport of last resort.
fn rank(t: &Transport) -> (u8, u8) {
    let locality = if t.scopes & (sys::FERRY_SCOPE_SAME_HOST | sys::FERRY_SCOPE_CROSS_HOST) == 0 {
        0
    } else if t.scopes & sys::FERRY_SCOPE_CROSS_HOST == 0 {
        1
    } else {
        2
    };
    let kind = if t.name.starts_with("rdma") {
        0
    } else if t.name == "tcp" {
        2
    } else {
        1
    };
    (locality, kind)
}

fn rank_reason(t: &Transport, scope: Scope) -> String {
    match rank(t) {
        (0, _) => format!("{} copies within this process", t.name),
        (1, _) => format!(
            "{} is a same-host transport and the peer is on this host",
            t.name
        ),
        (_, 0) => format!("{} moves data by RDMA", t.name),
        (_, 2) => match scope {
            Scope::CrossHost => {
                format!("{} is the only cross-host transport both ends run", t.name)
            }
            _ => format!(
                "{} works between any two engines (no same-host transport can serve this)",
                t.name
            ),
        },
        _ => format!("{} is a vendor transport both ends run", t.name),
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
