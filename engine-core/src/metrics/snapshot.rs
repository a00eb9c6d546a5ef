//! What the metrics read as at one moment: plain data, serialized as the
//! JSON of `Engine::metrics_json`, `ferry_metrics_json()` and
//! `engine.metrics()`, and rendered as Prometheus text.

use super::histogram::HistogramSnapshot;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// Every metric of one engine.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct MetricsSnapshot {
    /// The engine's segment name.
    pub engine: String,
    /// False when FERRY_METRICS=off: nothing per request is counted.
    pub enabled: bool,
    pub uptime_seconds: f64,
    /// Requests that finished, by transport, local device, peer, op and
    /// memory (how the local buffer was reached: host, dmabuf, peermem,
    /// cuda_ipc, or staged).
    pub flows: Vec<FlowCounts>,
    /// Latency from submit to completion, by transport, op and size class.
    pub latency: Vec<LatencyCounts>,
    /// Requests refused whole by `submit` (nothing moved), by error code.
    pub refused: BTreeMap<String, u64>,
    /// Times selection moved a peer's traffic to another transport.
    pub route_changes: Vec<RouteChanges>,
    /// Memory registered now, by device, transport and how it is registered.
    pub registered: Vec<Registered>,
    /// The GPU-direct decision for each GPU, in words.
    pub gpu_direct: Vec<GpuDirectState>,
    /// What plugins counted (NIC pauses, retries, connections), except
    /// their refusals, which are in `refusals`.
    pub plugins: Vec<PluginCounter>,
    /// Connections refused by each listener (control, and each transport's
    /// data listener), by cause.
    #[serde(default)]
    pub refusals: Vec<RefusalCount>,
}

#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct FlowCounts {
    pub transport: String,
    /// The local buffer's location: cpu:N, cuda:N.
    pub device: String,
    /// The peer's segment name.
    pub peer: String,
    /// read or write.
    pub op: String,
    pub memory: String,
    /// Requests completed, and their bytes.
    pub requests: u64,
    pub bytes: u64,
    /// Requests handed to the transport (adjacent requests coalesce into
    /// one).
    pub submissions: u64,
    /// Requests failed, by error code name (OUT_OF_BOUNDS, CONNECTION...).
    pub failures: BTreeMap<String, u64>,
    pub failed_bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct LatencyCounts {
    pub transport: String,
    pub op: String,
    /// The size class of one submission ("0-4KiB", ... "16MiB+").
    pub size: String,
    pub histogram: HistogramSnapshot,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RouteChanges {
    pub peer: String,
    pub memory: String,
    /// The transport now carrying this traffic.
    pub transport: String,
    pub changes: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Registered {
    pub device: String,
    /// The transport it is registered with, or "none" (staged).
    pub transport: String,
    pub memory: String,
    pub buffers: u64,
    pub bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct GpuDirectState {
    pub device: String,
    pub decision: String,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PluginCounter {
    pub plugin: String,
    pub name: String,
    /// "" when the counter is not per device.
    pub device: String,
    pub value: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RefusalCount {
    /// "control", or the transport whose listener refused ("tcp", "shm").
    pub listener: String,
    /// The short cause: busy, per_source, auth, timeout, integrity,
    /// peer_user, full, protocol.
    pub cause: String,
    pub count: u64,
}
