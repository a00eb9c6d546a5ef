//! How GPU memory gets registered for RDMA, decided per GPU (and per GPU/NIC
//! pair once a NIC is known), in the order DESIGN.md sets out:
//!
//! 1. policy: FERRY_GPU_DIRECT=auto|dmabuf|peermem|off;
//! 2. the GPU supports GPUDirect RDMA (CUDA attribute 116);
//! 3. an RDMA stack exists (libibverbs);
//! 4. the path from GPU to NIC is PXB or better (else the traffic would
//!    cross host bridges or sockets, and staging is faster and safer);
//! 5. DMA-BUF: the GPU supports it (attribute 124), the driver exports it,
//!    libibverbs has ibv_reg_dmabuf_mr, and the NIC accepts it (a probe
//!    registration with fd -1 answers EBADF, not EOPNOTSUPP);
//! 6. nvidia-peermem: its kernel module is loaded;
//! 7. otherwise staging through pinned host memory.
//!
//! Every tier that is skipped carries its reason, so `ferry info` can say
//! why the better methods were not used. The trial registration that is the
//! final word belongs to the RDMA transport.

use crate::topology::PathClass;
use std::path::Path;

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

/// What the host offers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostFacts {
    /// The path that shows nvidia-peermem is loaded, if one does.
    pub peermem: Option<String>,
    /// libibverbs: Err(why not) or Ok(whether it exports ibv_reg_dmabuf_mr).
    pub verbs: Result<bool, String>,
    /// Why no enabled transport registers GPU memory directly (the rdma
    /// plugin is disabled, or none is installed); `None` when one does.
    pub no_transport: Option<String>,
}

impl HostFacts {
    /// What this host offers, found under `sysfs_root`; `no_transport` from
    /// the plugins (see [`no_direct_transport`]).
    pub fn detect(sysfs_root: &Path, no_transport: Option<String>) -> HostFacts {
        HostFacts {
            peermem: detect_peermem(sysfs_root),
            verbs: detect_verbs(),
            no_transport,
        }
    }
}

/// Why none of these plugins registers GPU memory directly, or `None` when
/// an enabled transport offers DMA-BUF or nvidia-peermem registration.
pub fn no_direct_transport(set: &ferry_loader::PluginSet) -> Option<String> {
    use ferry_loader::{PluginKind, PluginState};
    use ferry_plugins_abi::sys;
    let direct = sys::FERRY_MEM_CUDA_DMABUF | sys::FERRY_MEM_CUDA_PEERMEM;
    let transports: Vec<_> = set
        .plugins
        .iter()
        .filter(|p| p.report.kind == PluginKind::Transport)
        .collect();
    if transports.iter().any(|p| {
        p.report.state == PluginState::Enabled && p.report.capabilities.mem_bits & direct != 0
    }) {
        return None;
    }
    // The transport that would have moved GPU memory directly: one that
    // says which GPU-memory capability it lacks here (by the capability's
    // name, never the plugin's), enabled ones first.
    let would = |p: &&&ferry_loader::Plugin| {
        p.report.state != PluginState::Shadowed
            && p.report
                .missing
                .iter()
                .any(|m| m.capability.starts_with("cuda") || m.capability.starts_with("rdma+"))
    };
    let direct_capable = transports
        .iter()
        .filter(|p| p.report.state == PluginState::Enabled)
        .find(would)
        .or_else(|| transports.iter().find(would));
    Some(match direct_capable {
        Some(p) if p.report.state == PluginState::Enabled => format!(
            "the {} transport registers no GPU memory here ({})",
            p.report.name,
            p.report
                .missing
                .iter()
                .filter(|m| m.capability.starts_with("cuda") || m.capability.starts_with("rdma+"))
                .map(|m| m.reason.as_str())
                .collect::<Vec<_>>()
                .join("; ")
        ),
        Some(p) => format!(
            "the {} transport is disabled: {}",
            p.report.name, p.report.reason
        ),
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
    let dmabuf_symbol = match &host.verbs {
        Ok(sym) => *sym,
        Err(why) => {
            both(&mut skipped, format!("no RDMA stack ({why})"));
            return staged(skipped);
        }
    };
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
    } else if !dmabuf_symbol {
        Some("libibverbs lacks ibv_reg_dmabuf_mr (rdma-core older than v34)".into())
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
        Some(_) => Decision {
            method: Method::PeerMem,
            skipped,
        },
        None => {
            skipped.push((
                Method::PeerMem,
                "nvidia-peermem is not loaded (no module/nvidia_peermem, module/nv_peer_mem or \
                 kernel/mm/memory_peers/nv_mem/version under sysfs)"
                    .into(),
            ));
            staged(skipped)
        }
    }
}

/// Which of the paths that prove nvidia-peermem exists under `sysfs_root`.
pub fn detect_peermem(sysfs_root: &Path) -> Option<String> {
    [
        "module/nvidia_peermem",
        "module/nv_peer_mem",
        "kernel/mm/memory_peers/nv_mem/version",
    ]
    .into_iter()
    .map(|p| sysfs_root.join(p))
    .find(|p| p.exists())
    .map(|p| p.display().to_string())
}

/// Whether libibverbs loads here and exports ibv_reg_dmabuf_mr. Loading it
/// has no side effect beyond mapping the library (it opens no device).
pub fn detect_verbs() -> Result<bool, String> {
    // SAFETY: loading the system's libibverbs runs only its constructors,
    // which register providers; no device is opened.
    let lib = unsafe { libloading::Library::new("libibverbs.so.1") }
        .map_err(|_| "libibverbs.so.1 not found".to_string())?;
    // SAFETY: only asks whether the symbol exists; it is never called here.
    let sym = unsafe { lib.get::<unsafe extern "C" fn()>(b"ibv_reg_dmabuf_mr\0") }.is_ok();
    Ok(sym)
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

    fn host(peermem: bool, verbs: Result<bool, String>) -> HostFacts {
        HostFacts {
            peermem: peermem.then(|| "/sys/module/nvidia_peermem".into()),
            verbs,
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
        let d = decide(Policy::Auto, &gpu(), &host(false, Ok(true)), None);
        assert_eq!(d.method, Method::DmaBuf);
        assert!(d.skipped.is_empty());
    }

    #[test]
    fn each_missing_dmabuf_piece_falls_back_to_peermem_with_its_reason() {
        type Case = (
            GpuFacts,
            Result<bool, String>,
            Option<PairFacts>,
            &'static str,
        );
        let cases: Vec<Case> = vec![
            (
                GpuFacts {
                    dmabuf: Some(false),
                    ..gpu()
                },
                Ok(true),
                None,
                "attribute 124 is 0",
            ),
            (
                GpuFacts {
                    dmabuf_export: false,
                    ..gpu()
                },
                Ok(true),
                None,
                "cannot export",
            ),
            (gpu(), Ok(false), None, "lacks ibv_reg_dmabuf_mr"),
            (
                gpu(),
                Ok(true),
                Some(pair(
                    PathClass::Pix,
                    Some(Err("mlx5_0 answers EOPNOTSUPP".into())),
                )),
                "EOPNOTSUPP",
            ),
        ];
        for (g, verbs, p, why) in cases {
            let d = decide(Policy::Auto, &g, &host(true, verbs.clone()), p.as_ref());
            assert_eq!(d.method, Method::PeerMem, "{why}");
            assert_eq!(d.skipped.len(), 1);
            assert!(d.skipped[0].1.contains(why), "{:?}", d.skipped);
            let d = decide(Policy::Auto, &g, &host(false, verbs), p.as_ref());
            assert_eq!(d.method, Method::Staged);
            assert!(d
                .explain()
                .contains("not nvidia-peermem: nvidia-peermem is not loaded"));
        }
    }

    #[test]
    fn gates_before_either_method() {
        let no_gdr = GpuFacts {
            gpu_direct_rdma: Some(false),
            ..gpu()
        };
        let d = decide(Policy::Auto, &no_gdr, &host(true, Ok(true)), None);
        assert_eq!(d.method, Method::Staged);
        assert!(d.explain().contains("attribute 116 is 0"));
        let d = decide(
            Policy::Auto,
            &gpu(),
            &host(true, Err("libibverbs.so.1 not found".into())),
            None,
        );
        assert_eq!(d.method, Method::Staged);
        assert!(d.explain().contains("no RDMA stack"));
        let no_rdma = HostFacts {
            no_transport: Some("the rdma transport is disabled: no RDMA device".into()),
            ..host(true, Ok(true))
        };
        let d = decide(Policy::Auto, &gpu(), &no_rdma, None);
        assert_eq!(d.method, Method::Staged);
        assert!(d
            .explain()
            .contains("not DMA-BUF: the rdma transport is disabled"));
        let far = pair(PathClass::Sys, Some(Ok(())));
        let d = decide(Policy::Auto, &gpu(), &host(true, Ok(true)), Some(&far));
        assert_eq!(d.method, Method::Staged);
        assert!(
            d.explain().contains("the path to mlx5_0 is SYS"),
            "{}",
            d.explain()
        );
        let near = pair(PathClass::Pxb, Some(Ok(())));
        assert_eq!(
            decide(Policy::Auto, &gpu(), &host(true, Ok(true)), Some(&near)).method,
            Method::DmaBuf
        );
    }

    #[test]
    fn policy_is_obeyed() {
        let h = host(true, Ok(true));
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

    #[test]
    fn peermem_is_found_through_the_sysfs_root() {
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(detect_peermem(dir.path()), None);
        std::fs::create_dir_all(dir.path().join("kernel/mm/memory_peers/nv_mem")).unwrap();
        std::fs::write(
            dir.path().join("kernel/mm/memory_peers/nv_mem/version"),
            "1.0",
        )
        .unwrap();
        assert!(detect_peermem(dir.path())
            .unwrap()
            .ends_with("nv_mem/version"));
        std::fs::create_dir_all(dir.path().join("module/nvidia_peermem")).unwrap();
        assert!(detect_peermem(dir.path())
            .unwrap()
            .ends_with("module/nvidia_peermem"));
    }
}
