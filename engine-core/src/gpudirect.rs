//! How GPU memory gets registered for RDMA, decided per GPU (and per GPU/NIC
//! pair once a NIC is known), in the order docs/gpu.md sets out:
//!
//! 1. policy: FERRY_GPU_DIRECT=auto|dmabuf|peermem|off;
//! 2. the GPU supports GPUDirect RDMA (CUDA attribute 116);
//! 3. a transport registers GPU memory here (it reports how, per memory
//!    kind, at probe: ABI 1.5 memory methods);
//! 4. the path from GPU to NIC is PXB or better (else the traffic would
//!    cross host bridges or sockets, and staging is faster and safer);
//! 5. DMA-BUF: the GPU supports it (attribute 124), the driver exports it,
//!    the transport reports DMA-BUF registration available, and the NIC
//!    accepts it (the transport's probe registration);
//! 6. nvidia-peermem: the transport reports it available;
//! 7. otherwise staging through pinned host memory.
//!
//! Every tier that is skipped carries its reason, so `ferry info` can say
//! why the better methods were not used. The trial registration that is the
//! final word belongs to the RDMA transport.

use ferry_loader::PluginReport;
use ferry_topology::{NicKind, PathClass, Topology};

/// FERRY_GPU_DIRECT, the `gpu_direct` setting of EngineConfig.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Policy {
    Auto,
    DmaBuf,
    PeerMem,
    Off,
}

impl Policy {
    pub fn parse(text: &str) -> Result<Policy, String> {
        match text.trim().to_ascii_lowercase().as_str() {
            "" | "auto" => Ok(Policy::Auto),
            "dmabuf" | "dma-buf" => Ok(Policy::DmaBuf),
            "peermem" | "nvidia-peermem" => Ok(Policy::PeerMem),
            "off" | "0" | "none" | "staged" => Ok(Policy::Off),
            other => Err(format!(
                "gpu_direct (FERRY_GPU_DIRECT) {other:?}: expected auto, dmabuf, peermem or off"
            )),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Policy::Auto => "auto",
            Policy::DmaBuf => "dmabuf",
            Policy::PeerMem => "peermem",
            Policy::Off => "off",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Method {
    DmaBuf,
    PeerMem,
    Staged,
}

impl Method {
    pub fn as_str(self) -> &'static str {
        match self {
            Method::DmaBuf => "DMA-BUF",
            Method::PeerMem => "nvidia-peermem",
            Method::Staged => "staging through pinned host memory",
        }
    }
}

/// What the GPU's driver says.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct GpuFacts {
    /// Attribute 116; `None` when the driver cannot say.
    pub gpu_direct_rdma: Option<bool>,
    /// Attribute 124; `None` when the driver cannot say.
    pub dmabuf: Option<bool>,
    /// The driver can export a DMA-BUF fd (cuMemGetHandleForAddressRange).
    pub dmabuf_export: bool,
}

/// What the host offers for GPU memory, as the transports reported it at
/// probe (memory methods, by FERRY_MEM_* bit): the core detects none of it
/// itself.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostFacts {
    /// DMA-BUF registration: Ok(how) or Err(why not), in the transport's words.
    pub dmabuf: Result<String, String>,
    /// nvidia-peermem registration, the same way.
    pub peermem: Result<String, String>,
    /// Why no enabled transport registers GPU memory directly (the plugin
    /// that would is disabled, or none is installed); `None` when one does.
    pub no_transport: Option<String>,
}

/// The FERRY_MEM_* bits of direct GPU-memory registration.
pub const DIRECT: u64 =
    ferry_plugins_abi::sys::FERRY_MEM_CUDA_DMABUF | ferry_plugins_abi::sys::FERRY_MEM_CUDA_PEERMEM;

impl HostFacts {
    /// What the transports of `reports` reported: for each method, an
    /// available report of an enabled transport first, else the first
    /// reason it is not (enabled transports first), else that none reports it.
    pub fn from_reports(reports: &[&PluginReport]) -> HostFacts {
        HostFacts {
            dmabuf: method_fact(
                reports,
                ferry_plugins_abi::sys::FERRY_MEM_CUDA_DMABUF,
                "DMA-BUF",
            ),
            peermem: method_fact(
                reports,
                ferry_plugins_abi::sys::FERRY_MEM_CUDA_PEERMEM,
                "nvidia-peermem",
            ),
            no_transport: no_direct_transport(reports),
        }
    }
}

/// Transports that are not shadowed, enabled ones first.
fn transports<'a>(reports: &[&'a PluginReport]) -> Vec<&'a PluginReport> {
    use ferry_loader::{PluginKind, PluginState};
    let mut t: Vec<&PluginReport> = reports
        .iter()
        .copied()
        .filter(|r| r.kind == PluginKind::Transport)
        .filter(|r| r.state != PluginState::Shadowed)
        .collect();
    t.sort_by_key(|r| r.state != PluginState::Enabled);
    t
}

fn method_fact(reports: &[&PluginReport], bit: u64, name: &str) -> Result<String, String> {
    use ferry_loader::PluginState;
    let found: Vec<_> = transports(reports)
        .into_iter()
        .flat_map(|r| {
            r.memory_methods
                .iter()
                .filter(move |m| m.kind == bit)
                .map(move |m| (r, m))
        })
        .collect();
    if let Some((r, m)) = found
        .iter()
        .find(|(r, m)| m.available && r.state == PluginState::Enabled)
    {
        return Ok(format!("{}: {}", r.name, m.detail));
    }
    match found.iter().find(|(_, m)| !m.available).or(found.first()) {
        Some((r, m)) => Err(format!("{}: {}", r.name, m.detail)),
        None => Err(format!(
            "no transport plugin reports registering GPU memory by {name}"
        )),
    }
}

/// Why none of these plugins registers GPU memory directly, or `None` when
/// an enabled transport offers DMA-BUF or nvidia-peermem registration.
fn no_direct_transport(reports: &[&PluginReport]) -> Option<String> {
    use ferry_loader::PluginState;
    let transports = transports(reports);
    if transports
        .iter()
        .any(|r| r.state == PluginState::Enabled && r.capabilities.mem_bits & DIRECT != 0)
    {
        return None;
    }
    // The transport that would have moved GPU memory directly: one that
    // reported a direct memory method (by its bit, never a name), enabled
    // ones first.
    let would = transports
        .iter()
        .find(|r| r.memory_methods.iter().any(|m| m.kind & DIRECT != 0));
    Some(match would {
        Some(r) if r.state == PluginState::Enabled => format!(
            "the {} transport registers no GPU memory here ({})",
            r.name,
            r.memory_methods
                .iter()
                .filter(|m| m.kind & DIRECT != 0 && !m.available)
                .map(|m| format!("{}: {}", m.memory, m.detail))
                .collect::<Vec<_>>()
                .join("; ")
        ),
        Some(r) => format!("the {} transport is disabled: {}", r.name, r.reason),
        None => {
            "no transport plugin that registers GPU memory (an RDMA one) is installed".to_string()
        }
    })
}

/// A GPU/NIC pair, once a NIC is known.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PairFacts {
    pub nic: String,
    pub class: PathClass,
    /// The NIC's answer to a DMA-BUF probe registration: Ok (EBADF: it
    /// takes DMA-BUF), Err(why not), or None when not probed.
    pub nic_dmabuf: Option<Result<(), String>>,
}

/// The NIC a GPU's memory would go through directly: the first usable RDMA
/// NIC in the location's whole ranking (nearest first, NICs whose ports are
/// down never). The one rule: the engine decides with it and `ferry info`
/// reports with it, so they cannot name different methods.
pub fn direct_nic(topology: &Topology, location: &str) -> Option<PairFacts> {
    topology
        .preferred_nics(location)?
        .iter()
        .find(|r| {
            r.usable
                && topology
                    .nic(&r.name)
                    .is_some_and(|n| n.kind == NicKind::Rdma)
        })
        .map(|r| PairFacts {
            nic: r.name.clone(),
            class: r.class,
            nic_dmabuf: None,
        })
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Decision {
    pub method: Method,
    /// Each better method that was skipped, and why.
    pub skipped: Vec<(Method, String)>,
}

impl Decision {
    /// One line: the method and the reasons for skipping the better ones.
    pub fn explain(&self) -> String {
        let mut s = self.method.as_str().to_string();
        for (m, why) in &self.skipped {
            s.push_str(&format!("; not {}: {why}", m.as_str()));
        }
        s
    }
}

/// Decides how one GPU's memory is registered (for one NIC when `pair`).
pub fn decide(
    policy: Policy,
    gpu: &GpuFacts,
    host: &HostFacts,
    pair: Option<&PairFacts>,
) -> Decision {
    let mut skipped = Vec::new();
    let both = |skipped: &mut Vec<(Method, String)>, why: String| {
        skipped.push((Method::DmaBuf, why.clone()));
        skipped.push((Method::PeerMem, why));
    };
    let staged = |skipped| Decision {
        method: Method::Staged,
        skipped,
    };
    if policy == Policy::Off {
        both(&mut skipped, "FERRY_GPU_DIRECT=off".into());
        return staged(skipped);
    }
    if gpu.gpu_direct_rdma == Some(false) {
        both(
            &mut skipped,
            "this GPU does not support GPUDirect RDMA (CUDA attribute 116 is 0)".into(),
        );
        return staged(skipped);
    }
    if let Some(why) = &host.no_transport {
        both(&mut skipped, why.clone());
        return staged(skipped);
    }
    if let Some(p) = pair {
        if p.class > PathClass::Pxb {
            both(
                &mut skipped,
                format!(
                    "the path to {} is {} ({}); GPUDirect needs PXB or better",
                    p.nic,
                    p.class.as_str(),
                    p.class.description()
                ),
            );
            return staged(skipped);
        }
    }

    // DMA-BUF.
    let dmabuf_refusal = if policy == Policy::PeerMem {
        Some("FERRY_GPU_DIRECT=peermem".to_string())
    } else if gpu.dmabuf == Some(false) {
        Some("this GPU or driver does not support DMA-BUF (CUDA attribute 124 is 0)".into())
    } else if gpu.dmabuf.is_none() {
        Some("the driver cannot say whether DMA-BUF is supported (attribute 124 unknown: driver older than CUDA 11.7?)".into())
    } else if !gpu.dmabuf_export {
        Some("the driver cannot export DMA-BUF (cuMemGetHandleForAddressRange is missing)".into())
    } else if let Err(why) = &host.dmabuf {
        Some(why.clone())
    } else {
        match pair.and_then(|p| p.nic_dmabuf.clone()) {
            Some(Err(why)) => Some(why),
            _ => None,
        }
    };
    match dmabuf_refusal {
        None => {
            return Decision {
                method: Method::DmaBuf,
                skipped,
            }
        }
        Some(why) => skipped.push((Method::DmaBuf, why)),
    }

    // nvidia-peermem.
    if policy == Policy::DmaBuf {
        skipped.push((Method::PeerMem, "FERRY_GPU_DIRECT=dmabuf".into()));
        return staged(skipped);
    }
    match &host.peermem {
        Ok(_) => Decision {
            method: Method::PeerMem,
            skipped,
        },
        Err(why) => {
            skipped.push((Method::PeerMem, why.clone()));
            staged(skipped)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu() -> GpuFacts {
        GpuFacts {
            gpu_direct_rdma: Some(true),
            dmabuf: Some(true),
            dmabuf_export: true,
        }
    }

    /// The host as the rdma plugin would report it: DMA-BUF `Ok` or why
    /// not, nvidia-peermem loaded or not.
    fn host(peermem: bool, dmabuf: Result<&str, &str>) -> HostFacts {
        HostFacts {
            dmabuf: dmabuf.map(String::from).map_err(String::from),
            peermem: if peermem {
                Ok("rdma: nvidia-peermem is loaded".into())
            } else {
                Err("rdma: nvidia-peermem is not loaded".into())
            },
            no_transport: None,
        }
    }

    fn pair(class: PathClass, nic_dmabuf: Option<Result<(), String>>) -> PairFacts {
        PairFacts {
            nic: "mlx5_0".into(),
            class,
            nic_dmabuf,
        }
    }

    #[test]
    fn a_capable_gpu_and_stack_use_dmabuf() {
        let d = decide(Policy::Auto, &gpu(), &host(false, Ok("dmabuf")), None);
        assert_eq!(d.method, Method::DmaBuf);
        assert!(d.skipped.is_empty());
    }

    #[test]
    fn each_missing_dmabuf_piece_falls_back_to_peermem_with_its_reason() {
        type Case = (
            GpuFacts,
            Result<&'static str, &'static str>,
            Option<PairFacts>,
            &'static str,
        );
        let cases: Vec<Case> = vec![
            (
                GpuFacts {
                    dmabuf: Some(false),
                    ..gpu()
                },
                Ok("dmabuf"),
                None,
                "attribute 124 is 0",
            ),
            (
                GpuFacts {
                    dmabuf_export: false,
                    ..gpu()
                },
                Ok("dmabuf"),
                None,
                "cannot export",
            ),
            (
                gpu(),
                Err("rdma: libibverbs lacks ibv_reg_dmabuf_mr"),
                None,
                "lacks ibv_reg_dmabuf_mr",
            ),
            (
                gpu(),
                Ok("dmabuf"),
                Some(pair(
                    PathClass::Pix,
                    Some(Err("mlx5_0 answers EOPNOTSUPP".into())),
                )),
                "EOPNOTSUPP",
            ),
        ];
        for (g, verbs, p, why) in cases {
            let d = decide(Policy::Auto, &g, &host(true, verbs), p.as_ref());
            assert_eq!(d.method, Method::PeerMem, "{why}");
            assert_eq!(d.skipped.len(), 1);
            assert!(d.skipped[0].1.contains(why), "{:?}", d.skipped);
            let d = decide(Policy::Auto, &g, &host(false, verbs), p.as_ref());
            assert_eq!(d.method, Method::Staged);
            assert!(d
                .explain()
                .contains("not nvidia-peermem: rdma: nvidia-peermem is not loaded"));
        }
    }

    #[test]
    fn gates_before_either_method() {
        let no_gdr = GpuFacts {
            gpu_direct_rdma: Some(false),
            ..gpu()
        };
        let d = decide(Policy::Auto, &no_gdr, &host(true, Ok("dmabuf")), None);
        assert_eq!(d.method, Method::Staged);
        assert!(d.explain().contains("attribute 116 is 0"));
        let no_rdma = HostFacts {
            no_transport: Some("the rdma transport is disabled: no RDMA device".into()),
            ..host(true, Ok("dmabuf"))
        };
        let d = decide(Policy::Auto, &gpu(), &no_rdma, None);
        assert_eq!(d.method, Method::Staged);
        assert!(d
            .explain()
            .contains("not DMA-BUF: the rdma transport is disabled"));
        let far = pair(PathClass::Sys, Some(Ok(())));
        let d = decide(Policy::Auto, &gpu(), &host(true, Ok("dmabuf")), Some(&far));
        assert_eq!(d.method, Method::Staged);
        assert!(
            d.explain().contains("the path to mlx5_0 is SYS"),
            "{}",
            d.explain()
        );
        let near = pair(PathClass::Pxb, Some(Ok(())));
        assert_eq!(
            decide(Policy::Auto, &gpu(), &host(true, Ok("dmabuf")), Some(&near)).method,
            Method::DmaBuf
        );
    }

    #[test]
    fn policy_is_obeyed() {
        let h = host(true, Ok("dmabuf"));
        assert_eq!(decide(Policy::Off, &gpu(), &h, None).method, Method::Staged);
        assert_eq!(
            decide(Policy::PeerMem, &gpu(), &h, None).method,
            Method::PeerMem
        );
        let d = decide(
            Policy::DmaBuf,
            &GpuFacts {
                dmabuf: Some(false),
                ..gpu()
            },
            &h,
            None,
        );
        assert_eq!(d.method, Method::Staged);
        assert!(d.explain().contains("FERRY_GPU_DIRECT=dmabuf"));
        assert!(Policy::parse("sometimes").is_err());
        assert_eq!(Policy::parse("DMABUF").unwrap(), Policy::DmaBuf);
    }

    fn topology(machine: ferry_topology_fixtures::SysfsBuilder) -> (tempfile::TempDir, Topology) {
        let dir = tempfile::tempdir().unwrap();
        machine.write(dir.path()).unwrap();
        let t = Topology::discover(&ferry_topology::TopologyConfig::for_sysfs_root(dir.path()))
            .unwrap();
        (dir, t)
    }

    #[test]
    fn the_direct_nic_is_the_nearest_usable_rdma_one_of_the_whole_ranking() {
        use ferry_topology_fixtures::*;
        // cuda:0's own switch holds mlx5_0, whose port is down: the direct
        // NIC is the next usable RDMA NIC, wherever it ranks.
        let (_d, t) = topology(named("port-down").unwrap());
        let nic = direct_nic(&t, "cuda:0").unwrap().nic;
        assert_ne!(nic, "mlx5_0");
        assert!(t.nic(&nic).unwrap().state.is_usable());

        // Every RDMA NIC down: none, so the engine stages (and info says so).
        let (_d, t) = topology(named("all-rdma-down").unwrap());
        assert_eq!(direct_nic(&t, "cuda:0"), None);

        // Five plain Ethernet NICs on the GPU's switch, nearer than the RDMA
        // NIC on another root port: the RDMA NIC still is the direct one
        // (looking only at the nearest four would find none).
        let (_d, t) = topology(named("crowded-plain-nics").unwrap());
        let ranked = t.preferred_nics("cuda:0").unwrap();
        assert!(
            ranked.iter().take(5).all(|r| r.name.starts_with("eth")),
            "{ranked:?}"
        );
        assert_eq!(direct_nic(&t, "cuda:0").unwrap().nic, "mlx5_0");
    }
}
