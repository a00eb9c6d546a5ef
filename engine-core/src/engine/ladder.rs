//! The GPU-direct ladder: how each GPU's memory is registered with RDMA
//! transports. Decided per GPU at start (docs/gpu.md's tiers: DMA-BUF >
//! nvidia-peermem > staging, judged against the GPU's closest RDMA NIC),
//! then proven per transport by a trial registration that falls back one
//! step when it fails. Before the NICs, transports that share device
//! memory with same-host peers themselves (cuda-ipc) register it.

use crate::device::Device;
use crate::gpu::Gpu;
use crate::gpudirect::{decide, direct_nic, Decision, HostFacts, Method, Policy};
use crate::host_plan::{facts, HostPlan};
use crate::memory::TransportRegistration;
use crate::transport::{RegionSpec, Transport};
use ferry_plugins_abi::sys;
use ferry_topology::Topology;
use parking_lot::Mutex;
use std::collections::{HashMap, HashSet};

pub(crate) struct GpuDirect {
    /// How each device's memory ("cuda:0") would be registered for RDMA.
    decisions: HashMap<String, Decision>,
    /// The host facts and the policy behind the decisions.
    pub(crate) host: HostFacts,
    pub(crate) policy: Policy,
    /// (device, transport, method) whose trial registration failed: not
    /// tried again.
    failures: Mutex<Vec<(String, usize, Method)>>,
    /// (device, transport, method) successes already logged.
    logged: Mutex<HashSet<(String, usize, Method)>>,
    /// (device, transport, shared) outcomes of same-host sharing logged.
    ipc_logged: Mutex<HashSet<(String, usize, bool)>>,
}

impl GpuDirect {
    /// How each started GPU's memory is registered for RDMA (docs/gpu.md's
    /// tiers, judged against the GPU's direct NIC): the start-up plan's
    /// decision, which `ferry info` shows too; decided here only for a GPU
    /// the probe did not describe the same way (a plugin older than ABI
    /// 1.6). Logged once per GPU.
    pub(crate) fn from_plan(plan: &HostPlan, gpus: &[Gpu], topology: &Topology) -> GpuDirect {
        let mut out = HashMap::new();
        for g in gpus {
            let location = g.location.to_string();
            let driver = facts(g);
            let d = match plan.gpu(&location) {
                Some(p) if facts(&p.gpu) == driver => p.decision.clone(),
                planned => {
                    log::info!(
                        "{location}: {}; deciding from what the started driver says",
                        if planned.is_some() {
                            "the driver now describes it differently from its probe"
                        } else {
                            "its plugin's probe did not describe it"
                        }
                    );
                    let topo_name = g.topology_name.clone().unwrap_or_else(|| location.clone());
                    let pair = direct_nic(topology, &topo_name);
                    decide(plan.policy, &driver, &plan.host, pair.as_ref())
                }
            };
            log::info!("{location} memory for RDMA: {}", d.explain());
            out.insert(location, d);
        }
        GpuDirect {
            decisions: out,
            host: plan.host.clone(),
            policy: plan.policy,
            failures: Mutex::new(Vec::new()),
            logged: Mutex::new(HashSet::new()),
            ipc_logged: Mutex::new(HashSet::new()),
        }
    }

    /// Registers device memory with a transport that shares it with
    /// same-host peers itself (`FERRY_MEM_CUDA_IPC`: CUDA IPC handles or VMM
    /// fds, copied by the GPU's copy engines), before any NIC is asked.
    /// `None` when `t` does not share device memory or refused this buffer
    /// (the reason is logged once per device and transport; same-host peers
    /// then stage it).
    pub(crate) fn register_ipc(
        &self,
        i: usize,
        t: &Transport,
        spec: &RegionSpec<'_>,
    ) -> Option<TransportRegistration> {
        if t.mem_kinds & sys::FERRY_MEM_CUDA_IPC == 0 {
            return None;
        }
        let attempt = RegionSpec {
            mem_kind: sys::FERRY_MEM_CUDA_IPC,
            dmabuf: None,
            ..*spec
        };
        let outcome = t.register(&attempt);
        let first = self
            .ipc_logged
            .lock()
            .insert((spec.location.to_string(), i, outcome.is_ok()));
        match outcome {
            Ok((handle, key)) => {
                if first {
                    log::info!(
                        "{}: {} memory is shared with same-host peers directly (the GPU's copy \
                         engines move it; no staging)",
                        t.name,
                        spec.location
                    );
                }
                Some(TransportRegistration {
                    transport: i,
                    handle,
                    key,
                    mem_kind: sys::FERRY_MEM_CUDA_IPC,
                })
            }
            Err(e) => {
                let msg = format!(
                    "{}: cannot share {} memory at {:#x} with same-host peers ({}); they stage it \
                     through host memory",
                    t.name, spec.location, spec.addr, e.message
                );
                if first {
                    log::info!("{msg}");
                } else {
                    log::debug!("{msg}");
                }
                None
            }
        }
    }

    /// Why memory of `location` is registered the way it is, if it is a GPU
    /// this engine knows.
    pub(crate) fn explain(&self, location: &str) -> Option<String> {
        self.decisions.get(location).map(|d| d.explain())
    }

    /// Registers device memory directly with transport `t` (an RDMA NIC
    /// reading and writing GPU memory), by the methods the GPU-direct
    /// decision allows, best first: DMA-BUF, then nvidia-peermem. The trial
    /// registration is the ground truth: a method that fails falls back one
    /// step (and is not tried again for this device), and `None` means the
    /// memory is staged through host memory for this transport.
    pub(crate) fn register(
        &self,
        i: usize,
        t: &Transport,
        device: &Device,
        spec: &RegionSpec<'_>,
    ) -> Option<TransportRegistration> {
        let direct = sys::FERRY_MEM_CUDA_DMABUF | sys::FERRY_MEM_CUDA_PEERMEM;
        if t.mem_kinds & direct == 0 {
            return None;
        }
        let ladder = self.methods(spec.location);
        let failed_before: Vec<Method> = self
            .failures
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
                if self.logged.lock().insert(key) {
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
                match export_dmabuf(device, spec) {
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
                    self.log_registered(i, t, spec.location, *method, first_try);
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
                    self.failures
                        .lock()
                        .push((spec.location.to_string(), i, *method));
                }
            }
        }
        None
    }

    /// Says once per device, transport and method that trial registration
    /// succeeded, and whether better methods failed first.
    fn log_registered(&self, i: usize, t: &Transport, location: &str, method: Method, first: bool) {
        if self.logged.lock().insert((location.to_string(), i, method)) {
            log::info!(
                "{}: {location} memory is registered by {} (trial registration succeeded{})",
                t.name,
                method.as_str(),
                if first {
                    ""
                } else {
                    "; better methods failed, see above"
                }
            );
        }
    }

    /// The direct registration methods the GPU-direct decision allows for
    /// device memory at `location`, best first.
    fn methods(&self, location: &str) -> Vec<Method> {
        let Some(d) = self.decisions.get(location) else {
            return Vec::new();
        };
        match d.method {
            Method::DmaBuf => {
                let mut m = vec![Method::DmaBuf];
                if self.host.peermem.is_ok() && self.policy != Policy::DmaBuf {
                    m.push(Method::PeerMem);
                }
                m
            }
            Method::PeerMem => vec![Method::PeerMem],
            Method::Staged => Vec::new(),
        }
    }
}

/// Exports `spec`'s device memory as a DMA-BUF fd (owned here) and its
/// offset in it, or why not.
fn export_dmabuf(
    device: &Device,
    spec: &RegionSpec<'_>,
) -> std::result::Result<(std::os::fd::OwnedFd, u64), String> {
    match device.export_dmabuf(spec.addr, spec.len) {
        Ok((fd, offset)) if fd >= 0 => {
            use std::os::fd::FromRawFd;
            // SAFETY: the device plugin hands us a fresh fd that nothing
            // else owns (its export contract); OwnedFd closes it once.
            let fd = unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) };
            Ok((fd, offset))
        }
        Ok(_) => Err("the device plugin exported no fd".to_string()),
        Err(e) => Err(e.message),
    }
}
