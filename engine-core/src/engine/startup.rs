//! Start-up and shut-down: an engine's listener, topology, plugins,
//! devices, transports and GPU-direct decisions, wired into its shared
//! state and its control plane; and what the engine gives back when the
//! last handle goes.

use super::allocations::Allocation;
use super::api::Engine;
use super::devices::Devices;
use super::ladder::GpuDirect;
use super::node::Node;
use super::refused::RefusedQueue;
use super::segments::Segments;
use super::select::Transports;
use super::shared::Shared;
use super::staging::Staging;
use crate::batch::BatchTable;
use crate::config::EngineConfig;
use crate::control;
use crate::control_server::{ControlHandler, ControlServer};
use crate::descriptor::SegmentDescriptor;
use crate::device::Device;
use crate::error::{Error, ErrorCode, Result};
use crate::host::{load_plugins, CoreHost, PeerControls};
use crate::host_plan::HostPlan;
use crate::identity::Identity;
use crate::memory::MemoryRegistry;
use crate::transport::Transport;
use ferry_loader::PluginKind;
use ferry_topology::Topology;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::sync::{Arc, Weak};

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
            control::MsgType::StageCopyList => self.stage_copy_list(conn, body),
            control::MsgType::Notify => self.receive_notify(body),
            control::MsgType::PluginRequest => {
                let (name, from, payload) = control::decode_plugin_request(body)?;
                let t = self
                    .transports
                    .iter()
                    .find(|t| t.name == name)
                    .ok_or_else(|| {
                        Error::new(
                            ErrorCode::NotFound,
                            format!("engine {} runs no transport {name}", self.node.name),
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

fn advertised_host(config: &EngineConfig, bound: SocketAddr) -> String {
    if let Some(h) = &config.hostname {
        // A wildcard (0.0.0.0, ::) is where to listen, never a place a peer
        // can dial: the route out is advertised instead.
        let wildcard = h
            .trim_matches(|c| c == '[' || c == ']')
            .parse::<IpAddr>()
            .is_ok_and(|ip| ip.is_unspecified());
        if !wildcard {
            return h.clone();
        }
        log::warn!(
            "hostname {h} is a wildcard no peer can dial: advertising the address of this \
             host's route out instead (set FERRY_HOSTNAME to the address peers should use)"
        );
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
    /// Starts an engine in named phases: who it is and where peers reach
    /// it, its plugins and the start-up plan, the devices, the transports,
    /// then the shared state and the control plane that serves it.
    pub fn new(config: EngineConfig) -> Result<Engine> {
        let front = Front::open(&config)?;
        let host = Loaded::load(&config, &front)?;
        // Devices first: transports may ask where a device sits.
        let devices = start_devices(&host.plugins, &host.plan, &host.topology);
        for g in &devices.gpus {
            if let Some(t) = &g.topology_name {
                host.aliases
                    .write()
                    .insert(g.location.to_string(), t.clone());
            }
        }
        let batches = Arc::new(BatchTable::default());
        let transports = data_path(&config, &host, &front, &batches);
        let (listener, shared) = assemble(config, front, host, devices, transports, batches);
        serve(listener, shared)
    }
}

/// Who this engine is to peers and how they reach it: the bound control
/// listener, the token, the control plane's limits and the metadata store.
struct Front {
    listener: std::net::TcpListener,
    bound: SocketAddr,
    host_name: String,
    control_addr: String,
    token: Option<ferry_plugins_abi::sdk::auth::Token>,
    link: control::Link,
    metadata: Option<Arc<ferry_metadata::EtcdStore>>,
    name: String,
}

impl Front {
    fn open(config: &EngineConfig) -> Result<Front> {
        let listener = ControlServer::bind(&config.listen)?;
        let bound = listener.local_addr().map_err(|e| {
            Error::new(
                ErrorCode::Io,
                format!("cannot read the control address: {e}"),
            )
        })?;
        check_exposure(config, bound)?;
        let host_name = advertised_host(config, bound);
        let control_addr = format!("{host_name}:{}", bound.port());
        let token = cluster_token(config)?;
        let link = control_link(config, token.clone());
        let metadata = connect_metadata(config, &control_addr)?;
        let name = match (&metadata, &config.name) {
            (Some(_), Some(n)) => n.clone(),
            _ => control_addr.clone(),
        };
        Ok(Front {
            listener,
            bound,
            host_name,
            control_addr,
            token,
            link,
            metadata,
            name,
        })
    }
}

/// The host as plugins see it (topology, settings, aliases), the loaded
/// plugins, and the plan their probes make (host_plan.rs).
struct Loaded {
    topology: Arc<Topology>,
    plugins: ferry_loader::PluginSet,
    plan: HostPlan,
    aliases: Arc<parking_lot::RwLock<HashMap<String, String>>>,
    plugin_counters: Arc<crate::counters::PluginCounters>,
    peer_controls: PeerControls,
}

impl Loaded {
    fn load(config: &EngineConfig, front: &Front) -> Result<Loaded> {
        // The host peers reach this engine at is what a plugin listening on
        // every interface advertises (its engine's name may be an etcd name).
        let mut settings = config.plugin_settings(Some(&front.host_name));
        // Plugins authenticate their own connections with the same token:
        // the configured one, or this user's.
        match &front.token {
            Some(t) => settings.insert("auth.token".into(), t.expose()),
            None => settings.remove("auth.token"),
        };
        let topology = Arc::new(
            Topology::discover(&config.topology)
                .map_err(|e| Error::new(ErrorCode::InvalidArgument, format!("topology: {e}")))?,
        );
        for w in topology.warnings() {
            log::warn!("topology: {w}");
        }
        let peer_controls: PeerControls = Arc::default();
        let host = CoreHost::new(settings, Some(topology.clone())).for_engine(
            &front.name,
            front.link.clone(),
            peer_controls.clone(),
        );
        let aliases = host.aliases();
        let plugin_counters = host.plugin_counters().clone();
        let plugins = load_plugins(&config.loader, host);
        let plan = {
            let reports: Vec<_> = plugins.plugins.iter().map(|p| &p.report).collect();
            HostPlan::new(&reports, &topology, config.gpu_direct)
        };
        Ok(Loaded {
            topology,
            plugins,
            plan,
            aliases,
            plugin_counters,
            peer_controls,
        })
    }
}

/// Starts the plan's transports and ranks them for selection.
fn data_path(
    config: &EngineConfig,
    host: &Loaded,
    front: &Front,
    batches: &Arc<BatchTable>,
) -> Transports<Arc<Transport>> {
    let listen_host = front.bound.ip().to_string();
    let started = start_transports(
        &host.plugins,
        &host.plan,
        &front.name,
        &listen_host,
        batches,
    );
    let transports = Transports::new(started.transports, started.failures, started.endpoints)
        .placed(&host.topology)
        .measured(config.select_measured)
        .preferring(config.prefer.as_deref());
    log_preference(&transports, config.prefer.as_deref(), &front.name);
    transports
}

/// The engine's shared state, from the phases' results; the control
/// listener comes back to be served.
fn assemble(
    config: EngineConfig,
    front: Front,
    host: Loaded,
    devices: Devices,
    transports: Transports<Arc<Transport>>,
    batches: Arc<BatchTable>,
) -> (std::net::TcpListener, Arc<Shared>) {
    let staging = Staging::new(config.staging_chunk, config.staging_depth);
    let gpu_direct = GpuDirect::from_plan(&host.plan, &devices.gpus, &host.topology);
    let metrics = crate::metrics::Metrics::new(config.metrics, host.plugin_counters);
    metrics.set_transport_names(transports.iter().map(|t| t.name.clone()).collect());
    let shared = Arc::new(Shared {
        config,
        topology: host.topology,
        plugins: host.plugins,
        node: Node {
            identity: Identity::new(),
            name: front.name,
            control_addr: front.control_addr,
            link: front.link,
            metadata: front.metadata,
        },
        transports,
        devices,
        gpu_direct,
        notifier: Default::default(),
        layouts: Default::default(),
        memory: MemoryRegistry::default(),
        allocations: Mutex::new(HashMap::new()),
        segments: Segments::new(host.peer_controls),
        staging,
        refused: Arc::new(RefusedQueue::new(&batches)),
        batches,
        metrics,
    });
    (front.listener, shared)
}

/// Starts the control plane on the listener, publishes the segment and
/// serves metrics where asked.
fn serve(listener: std::net::TcpListener, shared: Arc<Shared>) -> Result<Engine> {
    let weak: Weak<dyn ControlHandler> = Arc::downgrade(&shared) as Weak<dyn ControlHandler>;
    let control = ControlServer::start(listener, weak, &shared.node.link)?;
    publish(&shared);
    log_started(&shared);
    let metrics_server = match shared.config.metrics_listen.clone() {
        Some(listen) => Some(super::observe::serve_metrics(&shared, &listen)?),
        None => None,
    };
    Ok(Engine {
        metrics_server,
        control,
        shared,
    })
}

/// Refuses a listener other hosts can reach without a token, unless auth
/// is turned off (then says what that means, once).
fn check_exposure(config: &EngineConfig, bound: SocketAddr) -> Result<()> {
    if bound.ip().is_loopback() || config.auth_token.is_some() {
        return Ok(());
    }
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
    Ok(())
}

/// The token peers must prove: the configured one; with none configured
/// and auth not turned off, this user's, so other users of the host are
/// refused.
fn cluster_token(config: &EngineConfig) -> Result<Option<ferry_plugins_abi::sdk::auth::Token>> {
    match (&config.auth_token, config.auth_off) {
        (Some(t), _) => Ok(Some(t.clone())),
        (None, true) => {
            log::warn!(
                "FERRY_AUTH=off: no auth token; every process that can reach this engine's \
                 listeners, of any user, can read and write its registered memory"
            );
            Ok(None)
        }
        (None, false) => {
            let (t, path) = crate::user_token::load_or_create()?;
            log::info!(
                "auth: no token configured; using this user's token {} (other users are \
                 refused)",
                path.display()
            );
            Ok(Some(t))
        }
    }
}

/// The control plane's timeouts and admission limits, from the settings.
fn control_link(
    config: &EngineConfig,
    token: Option<ferry_plugins_abi::sdk::auth::Token>,
) -> control::Link {
    let mut link = control::Link::new(config.connect_timeout, config.timeout, token)
        .with_idle_timeout(config.idle_timeout);
    link.auth_timeout = config.auth_timeout;
    link.max_pending = config.auth_max_pending;
    link.max_pending_per_source = config.auth_max_pending_per_host;
    link.max_per_host = config.control_max_per_host;
    link
}

/// The metadata store, when one is configured (else segments are named by
/// their control address, and a configured name is ignored, with a word).
fn connect_metadata(
    config: &EngineConfig,
    control_addr: &str,
) -> Result<Option<Arc<ferry_metadata::EtcdStore>>> {
    match &config.metadata {
        ferry_metadata::MetadataConfig::P2p => {
            if let Some(n) = &config.name {
                log::warn!(
                    "name {n:?} ignored: without a metadata store (FERRY_METADATA) a \
                     segment's name is its control address, {control_addr}"
                );
            }
            Ok(None)
        }
        m => ferry_metadata::EtcdStore::connect(m, config.connect_timeout).map(Some),
    }
}

/// The enabled plugins of `kind` the plan names, in its order.
fn planned<'a>(
    plugins: &'a ferry_loader::PluginSet,
    kind: PluginKind,
    names: &'a [String],
) -> impl Iterator<Item = &'a ferry_loader::Plugin> {
    names
        .iter()
        .filter_map(move |n| plugins.enabled(kind).find(|p| p.report.name == *n))
}

/// Starts the plan's device plugins; one that fails is left out, with its
/// reason.
fn start_devices(
    plugins: &ferry_loader::PluginSet,
    plan: &HostPlan,
    topology: &Topology,
) -> Devices {
    let mut devices = Vec::new();
    for plugin in planned(plugins, PluginKind::Device, &plan.devices) {
        match Device::init(plugin) {
            Ok(Some(d)) => devices.push(Arc::new(d)),
            Ok(None) => {}
            Err(e) => log::warn!("device plugin {} failed to start: {e}", plugin.report.name),
        }
    }
    Devices::new(devices, topology)
}

/// The transports that started, those that failed (with why), and the
/// endpoint data each publishes.
struct Started {
    transports: Vec<Arc<Transport>>,
    failures: Vec<(String, Error)>,
    endpoints: Vec<(String, Vec<u8>)>,
}

/// Starts the plan's transport plugins, each logged once.
fn start_transports(
    plugins: &ferry_loader::PluginSet,
    plan: &HostPlan,
    name: &str,
    listen_host: &str,
    batches: &Arc<BatchTable>,
) -> Started {
    let mut out = Started {
        transports: Vec::new(),
        failures: Vec::new(),
        endpoints: Vec::new(),
    };
    for plugin in planned(plugins, PluginKind::Transport, &plan.transports) {
        let started =
            Transport::init(plugin, name, listen_host, batches.clone()).and_then(|t| match t {
                Some(t) => t.endpoint().map(|e| Some((t, e))),
                None => Ok(None),
            });
        match started {
            Ok(Some((t, endpoint))) => {
                log::info!(
                    "engine {name}: transport {} started ({} bytes of endpoint data)",
                    t.name,
                    endpoint.len()
                );
                out.endpoints.push((t.name.clone(), endpoint));
                out.transports.push(Arc::new(t));
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
                out.failures.push((plugin.report.name.clone(), e));
            }
        }
    }
    if out.transports.is_empty() {
        log::warn!(
            "engine {name}: no transport can move data; run `ferry info` to see why each \
             plugin is disabled"
        );
    }
    out
}

/// Says once what the `prefer` setting does here.
fn log_preference(transports: &Transports<Arc<Transport>>, prefer: Option<&str>, name: &str) {
    let Some(p) = prefer else { return };
    match transports.preferred() {
        Some(t) => log::info!(
            "engine {name}: requests prefer the {} transport where it serves them \
             (prefer={p}); elsewhere the engine chooses",
            transports[t].name
        ),
        None => log::info!(
            "engine {name}: the preferred transport {p:?} does not run here (running: \
             {}; `ferry info` says why); the engine chooses per request",
            transports
                .iter()
                .map(|t| t.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    }
}

/// Registers the segment in the metadata store, if there is one, saying
/// which engine's registration it replaces. An engine that cannot register
/// yet still starts: it can open segments by name as soon as etcd answers,
/// and its keeper registers it then.
fn publish(shared: &Shared) {
    let Some(store) = &shared.node.metadata else {
        return;
    };
    if let Ok(Some(old)) = store.fetch(&shared.node.name) {
        if let Ok(d) = SegmentDescriptor::from_json(&old) {
            log::warn!(
                "metadata: segment {} was registered by engine {} (at {}); replacing it",
                shared.node.name,
                d.engine_id,
                d.control_addr()
            );
        }
    }
    match store.publish(&shared.node.name, shared.describe().to_json()) {
        Ok(()) => log::info!(
            "metadata: registered segment {} in etcd at {}",
            shared.node.name,
            store.endpoints()
        ),
        Err(e) => log::warn!("metadata: {e}"),
    }
}

/// The settings that differ from the defaults, and the transports running.
fn log_started(shared: &Shared) {
    let changed = shared.config.changed();
    log::info!(
        "engine {}: settings other than the defaults: {}",
        shared.node.name,
        if changed.is_empty() {
            "none".to_string()
        } else {
            changed
                .iter()
                .map(|(k, v)| format!("{k}={v}"))
                .collect::<Vec<_>>()
                .join(", ")
        }
    );
    log::info!(
        "engine {} listening; transports: {}",
        shared.node.name,
        shared
            .transports
            .iter()
            .map(|t| t.name.as_str())
            .collect::<Vec<_>>()
            .join(", ")
    );
}

impl Drop for Shared {
    fn drop(&mut self) {
        // Gone from the metadata store at once, not when the lease expires.
        if let Some(store) = &self.node.metadata {
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
            owner.release(addr, &self.transports);
        }
    }
}
