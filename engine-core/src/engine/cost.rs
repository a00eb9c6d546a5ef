//! The cost model: how long a route would take to move a request, from
//! what its transport declares about its devices (ABI 1.2: bandwidth and
//! latency per device, and which memory kinds each moves directly), where
//! the memory sits relative to each device, and what the engine measured.
//!
//! time = latency + bytes / the narrowest bandwidth on the path
//!
//! The path of a route is: local memory -> local device (a PCIe path whose
//! class costs bandwidth and latency) -> the link -> the peer's device ->
//! the peer's memory; staged device memory adds a device copy at each
//! staged end. The peer's devices are not in its descriptor, so its end is
//! taken to match ours (the same transport, a device of the same kind).
//! Plugins that declare nothing (ABI 1.0 and 1.1) get conservative figures
//! by the widest scope they reach. Nothing here reads a transport's name.

use ferry_loader::DeviceReport;
use ferry_plugins_abi::sys;
use ferry_topology::{MemoryLocation, PathClass, Topology};

/// Bandwidth and latency of a path or a device.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Figures {
    pub(crate) bandwidth_mbps: f64,
    pub(crate) latency_ns: f64,
}

impl Figures {
    /// Seconds to move `bytes` over this path.
    pub(crate) fn seconds(&self, bytes: u64) -> f64 {
        self.latency_ns * 1e-9 + bytes as f64 * 8.0 / (self.bandwidth_mbps.max(1.0) * 1e6)
    }
}

/// What a transport that declares nothing is assumed to do: a kernel TCP
/// stack over a 10 GbE NIC for one reaching other hosts, a single copy
/// through a kernel for one within a host, a memcpy for one within a
/// process. Low on purpose: a declared figure of the same size wins.
pub(crate) fn scope_default(scopes: u32) -> Figures {
    if scopes & sys::FERRY_SCOPE_CROSS_HOST != 0 {
        Figures {
            bandwidth_mbps: 10_000.0,
            latency_ns: 50_000.0,
        }
    } else if scopes & sys::FERRY_SCOPE_SAME_HOST != 0 {
        Figures {
            bandwidth_mbps: 20_000.0,
            latency_ns: 10_000.0,
        }
    } else {
        Figures {
            bandwidth_mbps: 40_000.0,
            latency_ns: 2_000.0,
        }
    }
}

/// What a device copy of staged memory costs at one end (pinned host
/// memory <-> device memory over PCIe): PCIe Gen4 x16 sustains about
/// 25 GB/s; half of it, and a stream's launch and sync.
pub(crate) const STAGING_COPY: Figures = Figures {
    bandwidth_mbps: 100_000.0,
    latency_ns: 10_000.0,
};

/// The share of a device's bandwidth left, and the latency added, when the
/// memory is `class` away from it (the order of `nvidia-smi topo -m`).
pub(crate) fn class_penalty(class: Option<PathClass>) -> (f64, f64) {
    match class {
        Some(PathClass::Pix) | None | Some(PathClass::Unknown) => (1.0, 0.0),
        Some(PathClass::Pxb) => (0.95, 100.0),
        Some(PathClass::Phb) => (0.85, 300.0),
        Some(PathClass::Node) => (0.8, 500.0),
        Some(PathClass::Sys) => (0.5, 1_500.0),
    }
}

/// One device of a transport as selection uses it: what the plugin
/// declared, and how far each memory location the topology knows is from it.
#[derive(Clone, Debug, Default)]
pub(crate) struct Link {
    pub(crate) device: String,
    /// `FERRY_MEM_*` bits the device serves (0: the plugin did not say).
    pub(crate) mem_kinds: u64,
    pub(crate) bandwidth_mbps: Option<u64>,
    pub(crate) latency_ns: Option<u32>,
    /// (location, path class) for a device the topology knows as a NIC.
    pub(crate) classes: Vec<(MemoryLocation, PathClass)>,
    /// The device is a network interface the kernel flags as loopback: it
    /// reaches nothing outside this host, whatever it declares.
    pub(crate) loopback: bool,
}

impl Link {
    /// A device as its plugin reported it, placed in the topology.
    /// `loopback` names this host's loopback interfaces.
    pub(crate) fn from_report(
        d: &DeviceReport,
        topology: Option<&Topology>,
        loopback: &[String],
    ) -> Link {
        let classes = topology
            .and_then(|t| {
                let nic = t.nic(&d.name).or_else(|| t.nic_by_netdev(&d.name))?;
                Some(
                    t.locations()
                        .filter_map(|l| Some((l.parse().ok()?, t.path_class(l, &nic.name)?)))
                        .collect(),
                )
            })
            .unwrap_or_default();
        Link {
            device: d.name.clone(),
            mem_kinds: d.mem_bits,
            bandwidth_mbps: d.bandwidth_mbps.filter(|b| *b > 0),
            latency_ns: d.latency_ns.filter(|l| *l > 0),
            classes,
            loopback: loopback.contains(&d.name),
        }
    }

    fn class(&self, location: MemoryLocation) -> Option<PathClass> {
        self.classes
            .iter()
            .find(|(l, _)| *l == location)
            .map(|(_, c)| *c)
    }
}

/// The cost of one route, and what it rests on.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Estimate {
    /// The local device (index into the links) the estimate runs through
    /// (`None`: the transport declared no device for this memory).
    pub(crate) device: Option<usize>,
    pub(crate) class: Option<PathClass>,
    /// The path's figures: the narrowest bandwidth, latencies added.
    pub(crate) path: Figures,
    /// Whether the device's figures were declared (else scope defaults).
    pub(crate) declared: bool,
    pub(crate) seconds: f64,
}

/// The best route of one transport for `bytes` of `mem_kind` memory at
/// `location`: over each device that serves that memory (every device when
/// none says), the one with the smallest time; ties go to the first. A
/// route to another host (`cross_host`) leaves through a NIC: never
/// through a loopback interface, and when the topology places some of the
/// devices as NICs, only through those (a loopback interface's figure is
/// no promise for another host).
pub(crate) fn estimate(
    links: &[Link],
    scopes: u32,
    mem_kind: u64,
    location: MemoryLocation,
    bytes: u64,
    cross_host: bool,
) -> Estimate {
    let default = scope_default(scopes);
    let any_serves = links.iter().any(|l| l.mem_kinds & mem_kind != 0);
    let nics_only = cross_host && links.iter().any(|l| !l.classes.is_empty());
    let serving = links.iter().enumerate().filter(|(_, l)| {
        let kind = if any_serves {
            l.mem_kinds & mem_kind != 0
        } else {
            l.mem_kinds == 0
        };
        // To another host: never over loopback, and over NICs where any is placed.
        let reaches = !cross_host || (!l.loopback && (!nics_only || !l.classes.is_empty()));
        kind && reaches
    });
    let mut best: Option<Estimate> = None;
    for (i, l) in serving {
        let class = l.class(location);
        let (share, extra) = class_penalty(class);
        let declared = l.bandwidth_mbps.is_some() || l.latency_ns.is_some();
        let path = Figures {
            // The peer's device is taken to match this one: the narrowest
            // is this one, after the PCIe path from the memory to it.
            bandwidth_mbps: l
                .bandwidth_mbps
                .map_or(default.bandwidth_mbps, |b| b as f64)
                * share,
            latency_ns: l.latency_ns.map_or(default.latency_ns, f64::from) + extra,
        };
        let e = Estimate {
            device: Some(i),
            class,
            path,
            declared,
            seconds: path.seconds(bytes),
        };
        if best.as_ref().is_none_or(|b| e.seconds < b.seconds) {
            best = Some(e);
        }
    }
    best.unwrap_or(Estimate {
        device: None,
        class: None,
        path: default,
        declared: false,
        seconds: default.seconds(bytes),
    })
}

/// A host-memory route with device memory staged at `staged_ends` ends
/// (1 or 2): each adds a device copy, pipelined with the host leg, so the
/// narrowest stage sets the pace and each copy adds its latency.
pub(crate) fn staged(host_leg: &Estimate, staged_ends: u32, bytes: u64) -> Estimate {
    let path = Figures {
        bandwidth_mbps: host_leg
            .path
            .bandwidth_mbps
            .min(STAGING_COPY.bandwidth_mbps),
        latency_ns: host_leg.path.latency_ns + STAGING_COPY.latency_ns * f64::from(staged_ends),
    };
    Estimate {
        path,
        seconds: path.seconds(bytes),
        ..host_leg.clone()
    }
}

/// A bandwidth in operator words: "400 Gbit/s", "2.5 Gbit/s".
pub(crate) fn gbits(mbps: f64) -> String {
    if mbps >= 10_000.0 {
        format!("{:.0} Gbit/s", mbps / 1000.0)
    } else {
        format!("{:.1} Gbit/s", mbps / 1000.0)
    }
}

/// A size in operator words: "4 KiB", "16 MiB".
pub(crate) fn size(bytes: u64) -> String {
    match bytes {
        b if b >= 1 << 30 && b % (1 << 30) == 0 => format!("{} GiB", b >> 30),
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} bytes"),
    }
}

/// A duration in operator words.
pub(crate) fn micros(ns: f64) -> String {
    if ns >= 10_000.0 {
        format!("{:.0} us", ns / 1000.0)
    } else {
        format!("{:.1} us", ns / 1000.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CPU0: MemoryLocation = MemoryLocation::Cpu(0);

    fn link(device: &str, kinds: u64, bw: Option<u64>, lat: Option<u32>) -> Link {
        Link {
            device: device.into(),
            mem_kinds: kinds,
            bandwidth_mbps: bw,
            latency_ns: lat,
            classes: Vec::new(),
            loopback: false,
        }
    }

    #[test]
    fn time_is_latency_plus_bytes_over_bandwidth() {
        let f = Figures {
            bandwidth_mbps: 8_000.0,
            latency_ns: 1_000.0,
        };
        // 1 GB/s: a MB in a millisecond, plus a microsecond.
        assert!((f.seconds(1_000_000) - 0.001_001).abs() < 1e-12);
    }

    #[test]
    fn undeclared_devices_get_the_scope_default() {
        let e = estimate(
            &[link("eth0", 0, None, None)],
            sys::FERRY_SCOPE_CROSS_HOST,
            sys::FERRY_MEM_HOST,
            CPU0,
            1 << 20,
            true,
        );
        assert!(!e.declared);
        assert_eq!(e.path, scope_default(sys::FERRY_SCOPE_CROSS_HOST));
        let none = estimate(&[], sys::FERRY_SCOPE_SAME_HOST, 1, CPU0, 1, false);
        assert_eq!((none.device, none.declared), (None, false));
        assert!(
            scope_default(sys::FERRY_SCOPE_SAME_PROCESS).bandwidth_mbps
                > scope_default(sys::FERRY_SCOPE_CROSS_HOST).bandwidth_mbps
        );
    }

    #[test]
    fn the_device_for_the_memory_kind_and_the_nearest_wins() {
        let mut far = link("mlx5_1", sys::FERRY_MEM_HOST, Some(400_000), Some(2_000));
        far.classes = vec![(CPU0, PathClass::Sys)];
        let mut near = link("mlx5_0", sys::FERRY_MEM_HOST, Some(400_000), Some(2_000));
        near.classes = vec![(CPU0, PathClass::Pix)];
        let gpu_only = link("mlx5_2", sys::FERRY_MEM_CUDA_DMABUF, Some(800_000), Some(1));
        let lo = link("lo", sys::FERRY_MEM_HOST, Some(800_000), Some(1_000));
        let links = [far, near, gpu_only, lo];
        // Within the host the loopback device is fastest; to another host
        // only NICs count.
        let e = estimate(&links, 4, sys::FERRY_MEM_HOST, CPU0, 1 << 24, false);
        assert_eq!(e.device, Some(3));
        let e = estimate(&links, 4, sys::FERRY_MEM_HOST, CPU0, 1 << 24, true);
        assert_eq!(e.device, Some(1));
        assert_eq!(e.class, Some(PathClass::Pix));
        assert!(e.declared);
        // Across the interconnect half the bandwidth is left.
        let e = estimate(&links[..1], 4, sys::FERRY_MEM_HOST, CPU0, 1 << 24, true);
        assert_eq!(e.path.bandwidth_mbps, 200_000.0);
        assert_eq!(e.path.latency_ns, 3_500.0);
    }

    #[test]
    fn a_loopback_interface_never_carries_a_route_to_another_host() {
        // No device is placed as a NIC (a host whose topology lacks its
        // Ethernet port): the loopback interface is still left out.
        let mut lo = link("lo", sys::FERRY_MEM_HOST, Some(40_000), Some(20_000));
        lo.loopback = true;
        let eth = link("eth0", sys::FERRY_MEM_HOST, Some(10_000), Some(30_000));
        let links = [lo, eth];
        let e = estimate(&links, 6, sys::FERRY_MEM_HOST, CPU0, 1 << 22, true);
        assert_eq!(e.device, Some(1));
        let e = estimate(&links, 6, sys::FERRY_MEM_HOST, CPU0, 1 << 22, false);
        assert_eq!(e.device, Some(0));
        // Only loopback: the scope's default, through no device.
        let e = estimate(&links[..1], 6, sys::FERRY_MEM_HOST, CPU0, 1 << 22, true);
        assert_eq!(e.device, None);
    }

    #[test]
    fn staging_adds_a_copy_per_staged_end() {
        let host = estimate(
            &[link("nic", 0, Some(400_000), Some(2_000))],
            4,
            1,
            CPU0,
            1 << 20,
            false,
        );
        let one = staged(&host, 1, 1 << 20);
        let two = staged(&host, 2, 1 << 20);
        assert_eq!(one.path.bandwidth_mbps, STAGING_COPY.bandwidth_mbps);
        assert!(host.seconds < one.seconds && one.seconds < two.seconds);
    }
}
