//! Metrics: what the engine moved, where, how fast, and what failed;
//! cheap enough to stay on (a map lookup per batch, plain adds per
//! completion, relaxed atomic adds per batch). Read through `Engine::metrics()`, the C and
//! Python APIs, and the Prometheus endpoint (FERRY_METRICS_LISTEN).
//!
//! - `histogram`: latency buckets; `flow`: one flow's counters;
//! - `tally`: a batch's counts on their way to its flows;
//! - `snapshot`: the plain data read out; `prometheus`: its text format;
//! - `server`: the HTTP endpoint.

pub mod flow;
pub mod histogram;
pub mod prometheus;
pub mod server;
pub mod snapshot;
pub mod tally;

pub use flow::{Flow, FlowLabels, Latencies, Stamp};
pub use server::MetricsServer;
pub use snapshot::MetricsSnapshot;
pub use tally::{BatchTally, GroupTally, Tally};

use crate::counters::PluginCounters;
use crate::id_map::IdMap;
use ferry_plugins_abi::ErrorCode;
use ferry_topology::MemoryLocation;
use parking_lot::{Mutex, RwLock};
use snapshot::{PluginCounter, RefusalCount, RouteChanges};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Instant;

/// What finds a flow fast: plain numbers, no strings.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlowKey {
    /// The transport's index, or `usize::MAX` for staging.
    pub transport: usize,
    pub segment: u64,
    /// 0 read, 1 write.
    pub op: u8,
    pub location: MemoryLocation,
    /// The `FERRY_MEM_*` bit the local buffer is reached by (0: staged).
    pub mem_kind: u64,
}

/// The flow a batch used last: requests of one batch mostly share one, so
/// the map is asked once per batch, not once per request.
#[derive(Default)]
pub struct FlowCache(Option<(FlowKey, Arc<Flow>)>);

/// Flows with distinct labels at most; past this, new ones count in one
/// flow labelled "other" (peers come and go; series must not grow without
/// bound).
pub const MAX_FLOWS: usize = 1024;

struct Route {
    peer: String,
    memory: &'static str,
    /// The transport's index + 1 (0: none yet).
    current: AtomicUsize,
    changes: AtomicU64,
}

pub struct Metrics {
    /// Checked once per submission (relaxed): on/off at run time.
    enabled: AtomicBool,
    started: Instant,
    flows: RwLock<IdMap<FlowKey, Arc<Flow>>>,
    /// The same flows by labels: a reopened segment keeps its series.
    by_labels: Mutex<HashMap<FlowLabels, Arc<Flow>>>,
    latencies: Mutex<HashMap<(String, &'static str), Arc<Latencies>>>,
    refused: [AtomicU64; ErrorCode::ALL.len()],
    /// (segment, memory kind) -> the transport last used.
    routes: RwLock<IdMap<(u64, u64), Arc<Route>>>,
    transport_names: RwLock<Vec<String>>,
    plugins: Arc<PluginCounters>,
    /// Where the endpoint is, as peers reach it (descriptors announce it).
    advertised: std::sync::OnceLock<String>,
}

/// Stands for a `FERRY_MEM_*` bit in a flow key: the local buffer is a
/// staging slot (the host leg of staged traffic).
pub const STAGING_SLOT: u64 = u64::MAX;

/// The label of a `FERRY_MEM_*` bit.
pub fn memory_label(mem_kind: u64) -> &'static str {
    use ferry_plugins_abi::sys;
    match mem_kind {
        0 => "staged",
        STAGING_SLOT => "staging_slot",
        sys::FERRY_MEM_HOST => "host",
        sys::FERRY_MEM_CUDA_DMABUF => "dmabuf",
        sys::FERRY_MEM_CUDA_PEERMEM => "peermem",
        sys::FERRY_MEM_CUDA_IPC => "cuda_ipc",
        sys::FERRY_MEM_CUDA_STAGED => "staged",
        _ => "other",
    }
}

impl Metrics {
    pub fn new(enabled: bool, plugins: Arc<PluginCounters>) -> Metrics {
        Metrics {
            enabled: AtomicBool::new(enabled),
            started: Instant::now(),
            flows: RwLock::default(),
            by_labels: Mutex::default(),
            latencies: Mutex::default(),
            refused: Default::default(),
            routes: RwLock::default(),
            transport_names: RwLock::default(),
            plugins,
            advertised: std::sync::OnceLock::new(),
        }
    }

    pub fn enabled(&self) -> bool {
        self.enabled.load(Ordering::Relaxed)
    }

    /// Turns per-request counting on or off; what was counted stays.
    pub fn set_enabled(&self, on: bool) {
        self.enabled.store(on, Ordering::Relaxed);
    }

    /// The endpoint's "host:port" as peers reach it, once it serves.
    pub fn advertised(&self) -> Option<String> {
        self.advertised.get().cloned()
    }

    pub fn set_advertised(&self, addr: String) {
        let _ = self.advertised.set(addr);
    }

    /// [`Metrics::flow`] through `cache`.
    pub fn cached_flow<'c>(
        &self,
        cache: &'c mut FlowCache,
        key: FlowKey,
        labels: impl FnOnce() -> FlowLabels,
    ) -> Option<&'c Arc<Flow>> {
        if !self.enabled() {
            return None;
        }
        if !matches!(&cache.0, Some((k, _)) if *k == key) {
            cache.0 = Some((key, self.flow(key, labels)?));
        }
        cache.0.as_ref().map(|(_, f)| f)
    }

    /// The flow of `key`, created with `labels()` at its first use; `None`
    /// when metrics are off.
    pub fn flow(&self, key: FlowKey, labels: impl FnOnce() -> FlowLabels) -> Option<Arc<Flow>> {
        if !self.enabled() {
            return None;
        }
        if let Some(f) = self.flows.read().get(&key) {
            return Some(f.clone());
        }
        let mut labels = labels();
        let mut by_labels = self.by_labels.lock();
        if !by_labels.contains_key(&labels) && by_labels.len() >= MAX_FLOWS {
            labels.peer = "other".into();
            labels.device = "other".into();
        }
        let flow = by_labels
            .entry(labels.clone())
            .or_insert_with(|| {
                let latency = self
                    .latencies
                    .lock()
                    .entry((labels.transport.clone(), labels.op))
                    .or_insert_with(|| Arc::new(Latencies::new(&labels.transport, labels.op)))
                    .clone();
                Arc::new(Flow::new(labels, latency))
            })
            .clone();
        let mut flows = self.flows.write();
        if flows.len() < 4 * MAX_FLOWS {
            flows.insert(key, flow.clone());
        }
        Some(flow)
    }

    /// A submit refused whole: `requests` requests, none moved.
    pub fn refused(&self, code: ErrorCode, requests: usize) {
        if let Some(i) = ErrorCode::ALL.iter().position(|c| *c == code) {
            self.refused[i].fetch_add(requests as u64, Ordering::Relaxed);
        }
    }

    /// Names the transports by index (for route changes).
    pub fn set_transport_names(&self, names: Vec<String>) {
        *self.transport_names.write() = names;
    }

    /// Traffic of `segment` from memory of `mem_kind` now goes over
    /// `transport`: counts a change when it went elsewhere before.
    pub fn route_used(
        &self,
        segment: u64,
        mem_kind: u64,
        transport: usize,
        peer: impl FnOnce() -> String,
    ) {
        if !self.enabled() {
            return;
        }
        let key = (segment, mem_kind);
        let route = self.routes.read().get(&key).cloned();
        let route = match route {
            Some(r) => r,
            None => {
                let mut routes = self.routes.write();
                if routes.len() >= 4 * MAX_FLOWS {
                    return;
                }
                routes
                    .entry(key)
                    .or_insert_with(|| {
                        Arc::new(Route {
                            peer: peer(),
                            memory: memory_label(mem_kind),
                            current: AtomicUsize::new(0),
                            changes: AtomicU64::new(0),
                        })
                    })
                    .clone()
            }
        };
        let before = route.current.swap(transport + 1, Ordering::Relaxed);
        if before != 0 && before != transport + 1 {
            route.changes.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Everything counted so far (the engine adds what it knows: registered
    /// memory, GPU-direct decisions, its name).
    pub fn snapshot(&self) -> MetricsSnapshot {
        let mut flows: Vec<_> = self
            .by_labels
            .lock()
            .values()
            .map(|f| f.snapshot())
            .collect();
        flows.sort_by(|a, b| {
            (&a.transport, &a.device, &a.peer, &a.op, &a.memory).cmp(&(
                &b.transport,
                &b.device,
                &b.peer,
                &b.op,
                &b.memory,
            ))
        });
        let mut latency: Vec<_> = self
            .latencies
            .lock()
            .values()
            .flat_map(|l| l.snapshot())
            .collect();
        latency.sort_by(|a, b| (&a.transport, &a.op).cmp(&(&b.transport, &b.op)));
        let names = self.transport_names.read();
        let mut route_changes: Vec<_> = self
            .routes
            .read()
            .values()
            .map(|r| RouteChanges {
                peer: r.peer.clone(),
                memory: r.memory.to_string(),
                transport: r
                    .current
                    .load(Ordering::Relaxed)
                    .checked_sub(1)
                    .and_then(|i| names.get(i).cloned())
                    .unwrap_or_else(|| "staging".into()),
                changes: r.changes.load(Ordering::Relaxed),
            })
            .collect();
        route_changes.sort_by(|a, b| (&a.peer, &a.memory).cmp(&(&b.peer, &b.memory)));
        let (refusals, plugins) = refusals_and_plugin_counters(self.plugins.snapshot());
        MetricsSnapshot {
            engine: String::new(),
            enabled: self.enabled(),
            uptime_seconds: self.started.elapsed().as_secs_f64(),
            flows,
            latency,
            refused: ErrorCode::ALL
                .iter()
                .zip(&self.refused)
                .map(|(c, n)| (c.name().to_string(), n.load(Ordering::Relaxed)))
                .filter(|(_, n)| *n > 0)
                .collect(),
            route_changes,
            registered: Vec::new(),
            gpu_direct: Vec::new(),
            plugins,
            refusals,
        }
    }
}

/// Refusals of every listener: the control listener's (read from its
/// counts, every cause, zeros too) and those plugins report through the
/// host's `count` service as `refused_<cause>` (the plugin's name is the
/// listener); the plugins' other counters, apart.
fn refusals_and_plugin_counters(
    counts: Vec<crate::counters::PluginCount>,
) -> (Vec<RefusalCount>, Vec<PluginCounter>) {
    use ferry_plugins_abi::sdk::admission::{self, Refusal};
    let control = &*crate::control_server::REFUSALS;
    let mut refusals: Vec<RefusalCount> = admission::ALL
        .iter()
        .map(|k| RefusalCount {
            listener: control.listener().to_string(),
            cause: k.cause().to_string(),
            count: control.count(*k),
        })
        .collect();
    let mut plugins = Vec::with_capacity(counts.len());
    for p in counts {
        let cause = p
            .name
            .strip_prefix(admission::COUNTER_PREFIX)
            .and_then(Refusal::from_cause)
            .filter(|_| p.device.is_none());
        match cause {
            Some(k) => refusals.push(RefusalCount {
                listener: p.plugin,
                cause: k.cause().to_string(),
                count: p.value,
            }),
            None => plugins.push(PluginCounter {
                plugin: p.plugin,
                name: p.name,
                device: p.device.unwrap_or_default(),
                value: p.value,
            }),
        }
    }
    (refusals, plugins)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plugin_refusal_counters_become_refusals_and_the_rest_stay() {
        let c = PluginCounters::default();
        c.add("tcp", "refused_auth", None, 3);
        c.add("shm", "refused_peer_user", None, 1);
        c.add("rdma", "nic_pauses", Some("mlx5_0"), 2);
        // Not a known cause: an ordinary plugin counter.
        c.add("acme", "refused_weather", None, 5);
        let (refusals, plugins) = refusals_and_plugin_counters(c.snapshot());
        let get = |l: &str, cause: &str| {
            refusals
                .iter()
                .find(|r| r.listener == l && r.cause == cause)
                .map(|r| r.count)
        };
        assert_eq!(get("tcp", "auth"), Some(3));
        assert_eq!(get("shm", "peer_user"), Some(1));
        // The control listener's every cause is there, counted or not.
        assert_eq!(
            refusals.iter().filter(|r| r.listener == "control").count(),
            8
        );
        let names: Vec<&str> = plugins.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["refused_weather", "nic_pauses"]);
    }

    fn key(segment: u64) -> FlowKey {
        FlowKey {
            transport: 0,
            segment,
            op: 1,
            location: MemoryLocation::Cpu(0),
            mem_kind: 1,
        }
    }

    fn labels(peer: &str) -> FlowLabels {
        FlowLabels {
            transport: "tcp".into(),
            device: "cpu:0".into(),
            peer: peer.into(),
            op: "write",
            memory: "host",
        }
    }

    #[test]
    fn a_reopened_segment_keeps_its_series_and_off_counts_nothing() {
        let m = Metrics::new(true, Arc::default());
        let a = m.flow(key(1), || labels("p")).unwrap();
        let b = m.flow(key(2), || labels("p")).unwrap();
        assert!(Arc::ptr_eq(&a, &b));
        a.add(1, 1, 10);
        assert_eq!(m.snapshot().flows.len(), 1);
        let off = Metrics::new(false, Arc::default());
        assert!(off.flow(key(1), || labels("p")).is_none());
    }

    #[test]
    fn flows_are_bounded() {
        let m = Metrics::new(true, Arc::default());
        for i in 0..MAX_FLOWS as u64 + 50 {
            m.flow(key(i), || labels(&i.to_string())).unwrap();
        }
        let s = m.snapshot();
        assert_eq!(s.flows.len(), MAX_FLOWS + 1);
        assert!(s.flows.iter().any(|f| f.peer == "other"));
    }

    #[test]
    fn route_changes_count_moves_not_first_uses() {
        let m = Metrics::new(true, Arc::default());
        m.set_transport_names(vec!["shm".into(), "tcp".into()]);
        m.route_used(1, 1, 0, || "p".into());
        m.route_used(1, 1, 0, || "p".into());
        m.route_used(1, 1, 1, || "p".into());
        m.route_used(1, 2, 1, || "p".into());
        let r = m.snapshot().route_changes;
        assert_eq!(r.len(), 2);
        assert_eq!((r[0].changes, r[0].transport.as_str()), (1, "tcp"));
        assert_eq!(r[1].changes, 0);
    }
}
