//! The services Ferry offers plugins (logging, configuration, topology),
//! implemented over the engine's configuration and discovered topology.

use crate::counters::PluginCounters;
use ferry_loader::{config_env_var, HostServices};
use ferry_plugins_abi::sdk::Nic;
use ferry_plugins_abi::{sys, ErrorCode};
use ferry_topology::{LinkState, NicKind, Topology};
use parking_lot::RwLock;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// Segment name -> control address ("host:port"): filled by the engine as
/// it opens segments, read by plugin messaging to reach a peer by name.
pub type PeerControls = Arc<RwLock<HashMap<String, String>>>;

/// Host services backed by explicit settings, then the environment, and by
/// the topology when one was discovered. Its `Debug` prints setting names
/// only: values may be secrets (`auth.token`).
#[derive(Clone, Default)]
pub struct CoreHost {
    settings: BTreeMap<String, String>,
    topology: Option<Arc<Topology>>,
    /// Device locations as the driver numbers them ("cuda:0") -> the
    /// topology's name for the same PCI function. Filled once device plugins
    /// report their devices.
    aliases: Arc<RwLock<HashMap<String, String>>>,
    /// The engine these services belong to (for plugin messaging).
    engine: Option<EngineLink>,
    /// What plugins count through the `count` service.
    counters: Arc<PluginCounters>,
}

impl std::fmt::Debug for CoreHost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CoreHost")
            .field("settings", &self.settings.keys().collect::<Vec<_>>())
            .field("topology", &self.topology.is_some())
            .field("engine", &self.engine.as_ref().map(|e| &e.name))
            .finish_non_exhaustive()
    }
}

/// What plugin messaging needs to know about its engine.
#[derive(Clone, Debug)]
struct EngineLink {
    name: String,
    link: crate::control::Link,
    /// Segment names -> control addresses, as the engine opened them.
    peers: PeerControls,
}

impl CoreHost {
    /// `settings` (from `EngineConfig::plugin_settings`) override the
    /// environment: key "tcp.connections" is looked up here first, then as
    /// FERRY_TCP_CONNECTIONS.
    pub fn new(settings: BTreeMap<String, String>, topology: Option<Arc<Topology>>) -> CoreHost {
        CoreHost {
            settings,
            topology,
            aliases: Arc::default(),
            engine: None,
            counters: Arc::default(),
        }
    }

    /// What plugins counted through the `count` service, so far.
    pub fn plugin_counters(&self) -> &Arc<PluginCounters> {
        &self.counters
    }

    /// Services of engine `name`: plugin messages go out under that name,
    /// with these deadlines.
    pub fn for_engine(
        mut self,
        name: &str,
        link: crate::control::Link,
        peers: PeerControls,
    ) -> CoreHost {
        self.engine = Some(EngineLink {
            name: name.to_string(),
            link,
            peers,
        });
        self
    }

    /// Where to record the driver's device numbering (see `aliases`).
    pub fn aliases(&self) -> Arc<RwLock<HashMap<String, String>>> {
        self.aliases.clone()
    }
}

/// A topology NIC in the ABI's terms, with its class from some location.
pub fn abi_nic(nic: &ferry_topology::Nic, path_class: u32) -> Nic {
    let link_layer = match nic.link_layer.as_deref() {
        Some(l) if l.eq_ignore_ascii_case("infiniband") => sys::FERRY_LINK_INFINIBAND,
        Some(l) if l.eq_ignore_ascii_case("ethernet") => sys::FERRY_LINK_ETHERNET,
        _ if nic.kind == NicKind::Net => sys::FERRY_LINK_ETHERNET,
        _ => sys::FERRY_LINK_UNKNOWN,
    };
    Nic {
        kind: match nic.kind {
            NicKind::Rdma => sys::FERRY_NIC_KIND_RDMA,
            NicKind::Net => sys::FERRY_NIC_KIND_NET,
        },
        path_class,
        name: nic.name.clone(),
        netdev: nic.netdevs.first().cloned().unwrap_or_default(),
        pci_bus_id: nic.pci.map(|p| p.to_string()).unwrap_or_default(),
        numa_node: nic.numa,
        port_state: match nic.state {
            LinkState::Active => sys::FERRY_PORT_ACTIVE,
            LinkState::Unknown => sys::FERRY_PORT_UNKNOWN,
            LinkState::Armed | LinkState::Init | LinkState::Down => sys::FERRY_PORT_DOWN,
        },
        link_layer,
        speed_mbps: nic.speed_mbps.unwrap_or(0),
    }
}

impl HostServices for CoreHost {
    fn count(&self, plugin: &str, name: &str, device: Option<&str>, delta: u64) {
        self.counters.add(plugin, name, device, delta);
    }

    /// The engine's settings first. A plugin setting the engine was not
    /// given (`tcp.connections`) falls back to its environment variable
    /// (FERRY_TCP_CONNECTIONS); the keys the engine hands over itself
    /// (`timeout_ms`, `auth.token`, ...: every key without a dot, and
    /// `auth.token`) never do, so a plugin sees the engine's own value,
    /// checked once by EngineConfig, or nothing.
    fn config(&self, key: &str) -> Option<String> {
        if let Some(v) = self.settings.get(key) {
            return Some(v.clone());
        }
        let engine_owned = !key.contains('.') || key == "auth.token";
        if engine_owned {
            return None;
        }
        std::env::var(config_env_var(key)).ok()
    }

    fn peer_request(
        &self,
        plugin: &str,
        peer: &str,
        body: &[u8],
    ) -> Result<Vec<u8>, (ErrorCode, String)> {
        let Some(engine) = &self.engine else {
            return Err((
                ErrorCode::Unsupported,
                "plugin messaging needs an engine (this host has none)".into(),
            ));
        };
        // A segment name from a metadata store is not an address.
        let control = engine.peers.read().get(peer).cloned();
        crate::control::plugin_request(
            control.as_deref().unwrap_or(peer),
            plugin,
            &engine.name,
            body,
            &engine.link,
        )
        .map_err(|e| (e.code, e.message))
    }

    fn nics(&self, location: Option<&str>) -> Result<Vec<Nic>, ErrorCode> {
        let Some(topology) = &self.topology else {
            return Ok(Vec::new());
        };
        match location {
            None => Ok(topology
                .nics()
                .iter()
                .map(|n| abi_nic(n, sys::FERRY_PATH_UNKNOWN))
                .collect()),
            Some(loc) => {
                let alias = self.aliases.read().get(loc).cloned();
                let loc = alias.as_deref().unwrap_or(loc);
                let ranked = topology.preferred_nics(loc).ok_or(ErrorCode::NotFound)?;
                Ok(ranked
                    .iter()
                    .filter_map(|r| {
                        let nic = topology.nic(&r.name)?;
                        Some(abi_nic(nic, r.class.as_abi()))
                    })
                    .collect())
            }
        }
    }
}

/// Loads every plugin the configuration finds, with host services backed by
/// `host`. Never fails; see each plugin's state and reason.
pub fn load_plugins(
    config: &ferry_loader::LoaderConfig,
    host: CoreHost,
) -> ferry_loader::PluginSet {
    ferry_loader::PluginSet::load(config, Arc::new(host))
}

#[cfg(test)]
mod debug_tests {
    use super::*;

    #[test]
    fn debug_never_prints_setting_values() {
        let mut s = BTreeMap::new();
        s.insert("auth.token".to_string(), "s3cret-token-value".to_string());
        let h = CoreHost::new(s, None);
        let text = format!("{h:?}");
        assert!(text.contains("auth.token"), "{text}");
        assert!(!text.contains("s3cret"), "{text}");
    }
}
