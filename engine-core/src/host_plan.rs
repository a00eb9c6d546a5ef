//! The start-up plan: what an engine on this host, with these plugins and
//! this GPU-direct policy, starts and decides, computed from the plugins'
//! probe reports and the topology alone, starting nothing. `Engine::new`
//! executes it (engine/startup.rs); `ferry info` renders it (info.rs); the
//! tests below check it on the topology fixtures.

use crate::gpu::{place_gpu, Gpu};
use crate::gpudirect::{decide, direct_nic, Decision, GpuFacts, HostFacts, PairFacts, Policy};
use ferry_loader::{PluginKind, PluginReport, PluginState};
use ferry_topology::Topology;

/// What an engine starts, and how each GPU's memory is registered.
pub(crate) struct HostPlan {
    /// Enabled transport plugins, in load order: the engine starts each.
    pub(crate) transports: Vec<String>,
    /// Enabled device plugins, in load order: the engine starts each.
    pub(crate) devices: Vec<String>,
    /// What the transports offer for GPU memory.
    pub(crate) host: HostFacts,
    pub(crate) policy: Policy,
    /// Every GPU the device plugins' probes described (ABI 1.6), placed in
    /// the topology, with its decision.
    pub(crate) gpus: Vec<PlannedGpu>,
}

/// One GPU of the plan.
pub(crate) struct PlannedGpu {
    pub(crate) gpu: Gpu,
    /// The device plugin that described it.
    pub(crate) plugin: String,
    /// Its name in the topology (its location when the topology lacks it).
    pub(crate) topology_name: String,
    /// The NIC its memory would go through directly (the one NIC rule).
    pub(crate) nic: Option<PairFacts>,
    /// How its memory is registered for RDMA.
    pub(crate) decision: Decision,
    /// How it would be once a transport registers GPU memory directly.
    pub(crate) with_direct_transport: Decision,
}

impl HostPlan {
    /// The plan for `reports` (every plugin file the loader looked at) on
    /// `topology` under `policy`.
    pub(crate) fn new(reports: &[&PluginReport], topology: &Topology, policy: Policy) -> HostPlan {
        let enabled = |kind: PluginKind| {
            reports
                .iter()
                .filter(move |r| r.kind == kind && r.state == PluginState::Enabled)
        };
        let host = HostFacts::from_reports(reports);
        let able = HostFacts {
            no_transport: None,
            ..host.clone()
        };
        let mut gpus = Vec::new();
        for (plugin, r) in enabled(PluginKind::Device).enumerate() {
            for info in r.devices.iter().filter_map(|d| d.gpu.clone()) {
                let gpu = place_gpu(plugin, info, topology);
                let topology_name = gpu
                    .topology_name
                    .clone()
                    .unwrap_or_else(|| gpu.location.to_string());
                let nic = direct_nic(topology, &topology_name);
                let facts = facts(&gpu);
                gpus.push(PlannedGpu {
                    decision: decide(policy, &facts, &host, nic.as_ref()),
                    with_direct_transport: decide(policy, &facts, &able, nic.as_ref()),
                    plugin: r.name.clone(),
                    topology_name,
                    nic,
                    gpu,
                });
            }
        }
        HostPlan {
            transports: enabled(PluginKind::Transport)
                .map(|r| r.name.clone())
                .collect(),
            devices: enabled(PluginKind::Device)
                .map(|r| r.name.clone())
                .collect(),
            host,
            policy,
            gpus,
        }
    }

    /// The plan's GPU at `location` ("cuda:0"), if a probe described it.
    pub(crate) fn gpu(&self, location: &str) -> Option<&PlannedGpu> {
        self.gpus
            .iter()
            .find(|g| g.gpu.location.to_string() == location)
    }
}

/// What decides a GPU's method, from its driver's description.
pub(crate) fn facts(gpu: &Gpu) -> GpuFacts {
    GpuFacts {
        gpu_direct_rdma: gpu.info.gpu_direct_rdma,
        dmabuf: gpu.info.dmabuf,
        dmabuf_export: gpu.info.dmabuf_export,
    }
}

#[cfg(test)]
#[path = "host_plan_tests.rs"]
mod tests;
