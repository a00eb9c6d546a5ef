//! Ferry's RDMA transport plugin: one-sided RDMA WRITE and READ over RC
//! queue pairs, every request sliced over the NICs the engine's topology
//! ranks closest to the buffer at both ends, with failed slices retried on
//! other NIC pairs and failing NICs paused. GPU memory is registered by
//! DMA-BUF or nvidia-peermem, as the engine asks; connections are set up
//! through plugin messaging over Ferry's control plane.
//!
//! Loaded at run time as `libferry_transport_rdma.so`. libibverbs is never
//! linked: sideway's rdma-mummy-sys dlopens `libibverbs.so.1` when the
//! plugin loads (and quietly answers EOPNOTSUPP when it is missing, which
//! is why probe opens it itself to say so).

mod datapath;
mod health;
mod instance;
mod peer;
mod rails;
mod state;
mod verbs;
pub mod wire;

use ferry_plugins_abi::sdk::{
    Completer, Host, InitParams, MemRegion, PeerInfo, PluginError, PluginResult, ProbeDevice,
    ProbeReport, Registration, TransferRequest, TransportInstance, TransportPlugin,
};
use ferry_plugins_abi::sys;
use std::ffi::CStr;
use std::sync::Arc;

pub use state::Settings;

pub struct RdmaTransport;

/// Whether libibverbs.so.1 loads, and exports ibv_reg_dmabuf_mr.
fn open_libibverbs() -> Result<bool, String> {
    // SAFETY: loading libibverbs runs its constructors, which register
    // providers and open no device; rdma-mummy-sys has loaded it already
    // when it is present.
    let lib = unsafe { libloading::Library::new("libibverbs.so.1") }.map_err(|_| {
        "libibverbs.so.1 not found: install rdma-core's libibverbs (Debian/Ubuntu: libibverbs1, \
         RHEL: libibverbs) to use RDMA"
            .to_string()
    })?;
    // SAFETY: only looks the symbol up; it is never called through this.
    let dmabuf = unsafe { lib.get::<unsafe extern "C" fn()>(b"ibv_reg_dmabuf_mr\0") }.is_ok();
    Ok(dmabuf)
}

/// The sysfs tree the host reads (FERRY_SYSFS_ROOT), for nvidia-peermem.
fn sysfs_root(host: &Host<'_>) -> std::path::PathBuf {
    host.config("sysfs_root")
        .filter(|s| !s.is_empty())
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::PathBuf::from("/sys"))
}

/// The path proving nvidia-peermem is loaded, if one exists.
pub(crate) fn peermem_loaded(host: &Host<'_>) -> Option<String> {
    let root = sysfs_root(host);
    [
        "module/nvidia_peermem",
        "module/nv_peer_mem",
        "kernel/mm/memory_peers/nv_mem/version",
    ]
    .into_iter()
    .map(|p| root.join(p))
    .find(|p| p.exists())
    .map(|p| p.display().to_string())
}

fn report_methods(
    report: &mut ProbeReport<'_>,
    dmabuf: &Result<String, String>,
    peermem: &Result<String, String>,
) {
    // One plugin, both GPU memory methods, each available or not with why:
    // the engine decides GPU-memory registration from these, by their bits.
    for (kind, state) in [
        (sys::FERRY_MEM_CUDA_DMABUF, dmabuf),
        (sys::FERRY_MEM_CUDA_PEERMEM, peermem),
    ] {
        report.add_memory_method(kind, state.as_deref().map_err(String::as_str));
    }
}

/// What rdma declares for a device (plugin.h, ferry_probe_device_t): its
/// active port's speed from the verbs port attributes (lanes x lane rate),
/// and a one-sided write's completion time on that link layer (about 2 us
/// on InfiniBand, 3 us on RoCE, switch hops included). A device without an
/// active port declares nothing.
fn declared_link(port: &verbs::PortFacts) -> (u64, u32) {
    let mbps = (port.speed_gbps * 1000.0).round();
    let bandwidth = if mbps.is_finite() && mbps > 0.0 {
        mbps as u64
    } else {
        0
    };
    let latency = match port.link {
        verbs::Link::InfiniBand => 2_000,
        verbs::Link::Ethernet => 3_000,
    };
    (bandwidth, latency)
}

impl TransportPlugin for RdmaTransport {
    const NAME: &'static CStr = c"rdma";
    const VERSION: &'static CStr = ferry_plugins_abi::c_version!();
    const DESCRIPTION: &'static CStr =
        c"One-sided RDMA over every close NIC; GPU memory by DMA-BUF or nvidia-peermem";
    type Instance = RdmaInstance;

    fn probe(host: &Host<'_>, report: &mut ProbeReport<'_>) -> PluginResult<()> {
        let dmabuf_symbol = match open_libibverbs() {
            Ok(s) => s,
            Err(why) => {
                let off = Err(format!("no RDMA stack ({why})"));
                report_methods(report, &off, &off);
                return Err(PluginError::unavailable(why));
            }
        };
        let names = match verbs::device_names() {
            Ok(n) => n,
            Err(e) => {
                let why = verbs::no_device_reason(&e);
                let off = Err("no RDMA device".to_string());
                report_methods(report, &off, &off);
                return Err(PluginError::unavailable(why));
            }
        };
        if names.is_empty() {
            let off = Err("no RDMA device".to_string());
            report_methods(report, &off, &off);
            return Err(PluginError::unavailable(
                "libibverbs loads, but lists no RDMA device",
            ));
        }
        let topo = host.nics(None).unwrap_or_default();
        let mut usable = Vec::new();
        let mut dmabuf_nics = Vec::new();
        let mut dmabuf_refusals = Vec::new();
        let mut down = Vec::new();
        for name in &names {
            let topo_nic = topo.iter().find(|n| n.name == *name);
            let opened = verbs::open(name).and_then(|ctx| {
                let facts = verbs::facts(&ctx, name)?;
                let dmabuf = if dmabuf_symbol {
                    match ctx.alloc_pd() {
                        Ok(pd) => verbs::dmabuf_probe(&pd),
                        Err(e) => Err(format!("ibv_alloc_pd: {e}")),
                    }
                } else {
                    Err("libibverbs lacks ibv_reg_dmabuf_mr (rdma-core older than v34)".into())
                };
                Ok((facts, dmabuf))
            });
            let (facts, dmabuf) = match opened {
                Ok(x) => x,
                Err(why) => {
                    report.add_missing(&format!("device {name}"), &why);
                    continue;
                }
            };
            let port = facts.ports.iter().find(|p| p.active);
            let mut detail = match port.or(facts.ports.first()) {
                Some(p) => format!(
                    "{}, port {} {}, {:.0} Gb/s, lid {:#x}, {} GIDs",
                    p.link.as_str(),
                    p.num,
                    verbs::port_state_name(p.state),
                    p.speed_gbps,
                    p.lid,
                    p.gids.len()
                ),
                None => "no ports".to_string(),
            };
            detail.push_str(match &dmabuf {
                Ok(()) => ", DMA-BUF: yes",
                Err(_) => ", DMA-BUF: no",
            });
            let mut kinds = sys::FERRY_MEM_HOST;
            if dmabuf.is_ok() {
                kinds |= sys::FERRY_MEM_CUDA_DMABUF;
            }
            let (bandwidth_mbps, latency_ns) = port.map_or((0, 0), declared_link);
            report.add_device(&ProbeDevice {
                name,
                pci_bus_id: topo_nic
                    .map(|n| n.pci_bus_id.as_str())
                    .filter(|p| !p.is_empty()),
                numa_node: topo_nic.and_then(|n| n.numa_node),
                detail: Some(&detail),
                mem_kinds: kinds,
                bandwidth_mbps,
                latency_ns,
                ..Default::default()
            });
            if port.is_none() {
                down.push(name.clone());
                continue;
            }
            usable.push(name.clone());
            match dmabuf {
                Ok(()) => dmabuf_nics.push(name.clone()),
                Err(why) => dmabuf_refusals.push(format!("{name}: {why}")),
            }
        }
        let dmabuf = if !dmabuf_nics.is_empty() {
            Ok(format!(
                "ibv_reg_dmabuf_mr is taken by {}",
                dmabuf_nics.join(", ")
            ))
        } else if usable.is_empty() {
            Err("no usable RDMA device".to_string())
        } else {
            Err(dmabuf_refusals.join("; "))
        };
        let peermem = match peermem_loaded(host) {
            Some(p) if !usable.is_empty() => Ok(format!("nvidia-peermem is loaded ({p})")),
            Some(_) => Err("no usable RDMA device".to_string()),
            None => Err(
                "nvidia-peermem is not loaded (no module/nvidia_peermem, module/nv_peer_mem or \
                 kernel/mm/memory_peers/nv_mem/version under sysfs)"
                    .to_string(),
            ),
        };
        report_methods(report, &dmabuf, &peermem);
        if usable.is_empty() {
            return Err(PluginError::unavailable(format!(
                "no RDMA port is active ({} found: {})",
                names.len(),
                down.join(", ")
            )));
        }
        let mut kinds = sys::FERRY_MEM_HOST;
        if dmabuf.is_ok() {
            kinds |= sys::FERRY_MEM_CUDA_DMABUF;
        }
        if peermem.is_ok() {
            kinds |= sys::FERRY_MEM_CUDA_PEERMEM;
        }
        report.set_capabilities(
            kinds,
            sys::FERRY_SCOPE_SAME_HOST | sys::FERRY_SCOPE_CROSS_HOST,
        );
        Ok(())
    }

    fn init(
        host: Host<'static>,
        params: InitParams,
        completer: Completer,
    ) -> PluginResult<RdmaInstance> {
        open_libibverbs().map_err(PluginError::unavailable)?;
        let inner = state::Inner::start(host, params, completer)?;
        Ok(RdmaInstance { inner })
    }
}

ferry_plugins_abi::export_transport_plugin!(RdmaTransport);

/// One engine's RDMA transport.
pub struct RdmaInstance {
    inner: Arc<state::Inner>,
}

impl TransportInstance for RdmaInstance {
    type Peer = Arc<state::Peer>;

    fn endpoint(&self) -> PluginResult<Vec<u8>> {
        Ok(self.inner.endpoint.encode())
    }

    fn register_memory(&self, region: &MemRegion) -> PluginResult<Registration> {
        self.inner.register(region)
    }

    fn unregister_memory(&self, handle: u64) -> PluginResult<()> {
        self.inner.unregister(handle)
    }

    fn connect(&self, peer: &PeerInfo) -> PluginResult<Arc<state::Peer>> {
        state::Peer::new(&self.inner, peer)
    }

    fn disconnect(&self, peer: Arc<state::Peer>) {
        peer.close();
    }

    fn submit(
        &self,
        peer: &Arc<state::Peer>,
        requests: &[TransferRequest<'_>],
    ) -> PluginResult<()> {
        self.inner.submit(peer, requests)
    }

    fn describe_peer(&self, peer: &Arc<state::Peer>) -> Option<String> {
        Some(peer.describe(&self.inner))
    }

    fn progress(&self) -> usize {
        self.inner.progress()
    }

    fn accepts(&self, peer: &Arc<state::Peer>, remote_key: &[u8]) -> PluginResult<()> {
        peer.accepts(&self.inner, remote_key)
    }

    fn on_peer_request(&self, from: &str, body: &[u8]) -> PluginResult<Vec<u8>> {
        self.inner.on_peer_request(from, body)
    }
}

impl Drop for RdmaInstance {
    fn drop(&mut self) {
        self.inner.shutdown();
    }
}
