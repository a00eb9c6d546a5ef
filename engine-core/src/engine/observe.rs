//! The metrics as the engine reads them out: the counters, plus what only
//! the engine knows (its name, registered memory and how, the GPU-direct
//! decisions), and the endpoint that serves them (FERRY_METRICS_LISTEN).
//!
//! Reaches in Shared: `devices`, `gpu_direct`, `memory`, `metrics`, `node`, `transports`.

use super::shared::Shared;
use crate::error::Result;
use crate::metrics::snapshot::{GpuDirectState, Registered};
use crate::metrics::{memory_label, prometheus, MetricsServer, MetricsSnapshot};
use std::collections::BTreeMap;
use std::sync::Arc;

impl Shared {
    pub(crate) fn metrics_snapshot(&self) -> MetricsSnapshot {
        let mut s = self.metrics.snapshot();
        s.engine = self.node.name.clone();
        let mut registered: BTreeMap<(String, String, &'static str), (u64, u64)> = BTreeMap::new();
        for b in self.memory.all() {
            let device = b.location.to_string();
            let mut add = |transport: String, memory: &'static str| {
                let e = registered
                    .entry((device.clone(), transport, memory))
                    .or_default();
                e.0 += 1;
                e.1 += b.len;
            };
            if b.registrations.is_empty() {
                add("none".into(), "staged");
            }
            for r in &b.registrations {
                let name = self
                    .transports
                    .get(r.transport)
                    .map(|t| t.name.clone())
                    .unwrap_or_default();
                add(name, memory_label(r.mem_kind));
            }
        }
        s.registered = registered
            .into_iter()
            .map(
                |((device, transport, memory), (buffers, bytes))| Registered {
                    device,
                    transport,
                    memory: memory.to_string(),
                    buffers,
                    bytes,
                },
            )
            .collect();
        s.gpu_direct = self
            .devices
            .gpus
            .iter()
            .filter_map(|g| {
                let device = g.location.to_string();
                let decision = self.gpu_direct.explain(&device)?;
                Some(GpuDirectState { device, decision })
            })
            .collect();
        s
    }
}

/// Serves `shared`'s metrics on `listen` for as long as the engine lives.
pub(crate) fn serve_metrics(shared: &Arc<Shared>, listen: &str) -> Result<MetricsServer> {
    let weak = Arc::downgrade(shared);
    let server = MetricsServer::start(
        listen,
        Arc::new(move |path: &str| {
            let shared = weak.upgrade()?;
            match path {
                "/metrics" => Some((
                    prometheus::CONTENT_TYPE,
                    prometheus::render(&shared.metrics_snapshot()),
                )),
                "/metrics.json" => Some((
                    "application/json",
                    serde_json::to_string(&shared.metrics_snapshot()).unwrap_or_default(),
                )),
                "/" => Some((
                    "text/plain; charset=utf-8",
                    format!(
                        "Ferry engine {}: /metrics (Prometheus text), /metrics.json\n",
                        shared.node.name
                    ),
                )),
                _ => None,
            }
        }),
    )?;
    // Announced in the descriptor (for `ferry top SEGMENT`): on a wildcard
    // address, at the host peers reach the control listener on.
    let bound = server.local_addr();
    let advertised = if bound.ip().is_unspecified() {
        let control = &shared.node.control_addr;
        let host = control
            .rsplit_once(':')
            .map_or(control.as_str(), |(h, _)| h);
        format!("{host}:{}", bound.port())
    } else {
        bound.to_string()
    };
    shared.metrics.set_advertised(advertised);
    shared.publish();
    Ok(server)
}
