//! The things topology discovery finds: NUMA nodes, GPUs, NICs and their
//! ports, and the names of memory locations (`cpu:N`, `cuda:N`, `rocm:N`).
//! Plain data with public fields; `#[non_exhaustive]` so fields can be added.

use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use super::class::PathClass;
use super::config::DEFAULT_SYSFS_ROOT;
use super::pci::{PciAddress, PciPath};

/// A NUMA node from `/sys/devices/system/node/nodeN`.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct NumaNode {
    pub id: u32,
    /// The node's `cpulist` as the kernel prints it (`0-55,112-167`); empty
    /// for a CPU-less node (CXL memory, GPU memory on Grace systems).
    pub cpus: String,
    /// For a CPU-less node, the nearest node with CPUs (from `distance`).
    pub nearest_cpu_node: Option<u32>,
}

impl NumaNode {
    /// Whether the node has CPUs; CPU-less nodes are memory expanders.
    pub fn has_cpus(&self) -> bool {
        !self.cpus.trim().is_empty()
    }
}

/// Who made a GPU; it decides which ordinal space the GPU is numbered in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum GpuVendor {
    /// PCI vendor 0x10de; numbered `cuda:N`.
    Nvidia,
    /// PCI vendor 0x1002; numbered `rocm:N`, so that an AMD card never shifts
    /// CUDA ordinals on a mixed host.
    Amd,
}

impl GpuVendor {
    pub fn as_str(&self) -> &'static str {
        match self {
            GpuVendor::Nvidia => "nvidia",
            GpuVendor::Amd => "amd",
        }
    }

    pub fn pci_vendor_id(&self) -> u16 {
        match self {
            GpuVendor::Nvidia => 0x10de,
            GpuVendor::Amd => 0x1002,
        }
    }

    /// The prefix of this vendor's memory location names.
    pub fn location_prefix(&self) -> &'static str {
        match self {
            GpuVendor::Nvidia => "cuda",
            GpuVendor::Amd => "rocm",
        }
    }

    pub(crate) fn from_pci_vendor_id(id: u32) -> Option<Self> {
        match id {
            0x10de => Some(GpuVendor::Nvidia),
            0x1002 => Some(GpuVendor::Amd),
            _ => None,
        }
    }
}

/// A GPU, numbered as its runtime would number it.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Gpu {
    /// The runtime ordinal N of `cuda:N` / `rocm:N`.
    pub ordinal: u32,
    /// `cuda:N` for NVIDIA, `rocm:N` for AMD.
    pub name: String,
    pub vendor: GpuVendor,
    /// `None` only for a GPU added by a topology file without a PCI address.
    pub pci: Option<PciAddress>,
    /// The PCI device id (`0x2330` for an H100 SXM); lets callers notice mixed models.
    pub pci_device_id: Option<u16>,
    /// `None` when unknown (sysfs `numa_node` -1 on a multi-node machine).
    pub numa: Option<u32>,
    /// The canonical PCI path below the sysfs root, for diagnostics.
    pub sysfs_path: Option<String>,
    /// Whether a topology file added or changed this GPU.
    pub from_topology_file: bool,
    pub(crate) pci_path: Option<PciPath>,
}

/// What kind of NIC: RDMA-capable or a plain network interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum NicKind {
    /// An RDMA device (`/sys/class/infiniband/<name>`); its netdevs ride along.
    Rdma,
    /// A network interface with no RDMA device on its PCI function.
    Net,
}

impl NicKind {
    pub fn as_str(&self) -> &'static str {
        match self {
            NicKind::Rdma => "rdma",
            NicKind::Net => "net",
        }
    }
}

impl FromStr for NicKind {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "rdma" => Ok(NicKind::Rdma),
            "net" => Ok(NicKind::Net),
            other => Err(format!(
                "\"{other}\" is not a NIC kind (expected \"rdma\" or \"net\")"
            )),
        }
    }
}

/// The state of an RDMA port or a network interface.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LinkState {
    /// RDMA ACTIVE (or ACTIVE_DEFER); netdev operstate "up".
    Active,
    /// RDMA ARMED: configured, not yet passing traffic.
    Armed,
    /// RDMA INIT: waiting for a subnet manager; netdev operstate "testing".
    Init,
    /// RDMA DOWN; netdev "down", "lowerlayerdown", "notpresent", "dormant".
    Down,
    /// Nothing readable, or netdev operstate "unknown" (some virtual NICs
    /// say so while working fine).
    Unknown,
}

impl LinkState {
    pub fn as_str(&self) -> &'static str {
        match self {
            LinkState::Active => "active",
            LinkState::Armed => "armed",
            LinkState::Init => "init",
            LinkState::Down => "down",
            LinkState::Unknown => "unknown",
        }
    }

    /// Whether traffic may flow. Unusable NICs are ranked last everywhere.
    pub fn is_usable(&self) -> bool {
        matches!(self, LinkState::Active | LinkState::Unknown)
    }

    /// Smaller is better: which port state represents a multi-port device.
    pub(crate) fn preference(&self) -> u8 {
        match self {
            LinkState::Active => 0,
            LinkState::Unknown => 1,
            LinkState::Armed => 2,
            LinkState::Init => 3,
            LinkState::Down => 4,
        }
    }

    /// Parses an RDMA port `state` attribute (`4: ACTIVE`).
    pub(crate) fn from_rdma_state(text: &str) -> Self {
        let name = text.split_once(':').map_or(text, |(_, name)| name).trim();
        match name.to_ascii_uppercase().as_str() {
            "ACTIVE" | "ACTIVE_DEFER" => LinkState::Active,
            "ARMED" => LinkState::Armed,
            "INIT" => LinkState::Init,
            "DOWN" | "NOP" => LinkState::Down,
            _ => match text.split(':').next().map(str::trim) {
                Some("4") | Some("5") => LinkState::Active,
                Some("3") => LinkState::Armed,
                Some("2") => LinkState::Init,
                Some("0") | Some("1") => LinkState::Down,
                _ => LinkState::Unknown,
            },
        }
    }

    /// Parses a netdev `operstate` attribute.
    pub(crate) fn from_operstate(text: &str) -> Self {
        match text.trim() {
            "up" => LinkState::Active,
            "down" | "lowerlayerdown" | "notpresent" | "dormant" => LinkState::Down,
            "testing" => LinkState::Init,
            _ => LinkState::Unknown,
        }
    }
}

/// One port of an RDMA device (`/sys/class/infiniband/<dev>/ports/<n>`).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RdmaPort {
    /// The verbs port number (from 1).
    pub number: u32,
    pub state: LinkState,
    /// "InfiniBand" or "Ethernet" (RoCE), as sysfs says it.
    pub link_layer: Option<String>,
    /// The `rate` text, e.g. "400 Gb/sec (4X NDR)".
    pub rate: Option<String>,
    /// The rate in Mbit/s.
    pub speed_mbps: Option<u64>,
}

/// A NIC: one RDMA device, or one network interface without RDMA.
///
/// Decisions: an RDMA device is one NIC however many ports it has (path
/// classes belong to its PCI function, which all ports share); its state,
/// link layer and speed are those of its best port (active first, then
/// fastest), and `ports` lists them all so the transport can pick the port.
/// A dual-port card exposing two PCI functions is two RDMA devices, so two
/// NICs. A network interface whose PCI function carries an RDMA device is
/// listed in that device's `netdevs`, not as a NIC of its own.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Nic {
    /// The RDMA device name (`mlx5_0`) or interface name (`eth0`).
    pub name: String,
    pub kind: NicKind,
    pub pci: Option<PciAddress>,
    /// `None` when unknown (sysfs `numa_node` -1 on a multi-node machine).
    pub numa: Option<u32>,
    /// Network interfaces on this NIC (for `net` NICs: the NIC itself).
    pub netdevs: Vec<String>,
    /// RDMA ports; empty for `net` NICs.
    pub ports: Vec<RdmaPort>,
    pub state: LinkState,
    pub link_layer: Option<String>,
    pub speed_mbps: Option<u64>,
    /// For an SR-IOV virtual function: its physical function.
    pub physical_function: Option<PciAddress>,
    /// The canonical PCI path below the sysfs root, for diagnostics.
    pub sysfs_path: Option<String>,
    /// Whether a topology file added or changed this NIC.
    pub from_topology_file: bool,
    pub(crate) pci_path: Option<PciPath>,
}

impl Nic {
    /// Whether this NIC is an SR-IOV virtual function.
    pub fn is_virtual_function(&self) -> bool {
        self.physical_function.is_some()
    }

    /// The first active RDMA port, the one a transport should open.
    pub fn best_port(&self) -> Option<&RdmaPort> {
        self.ports.iter().min_by_key(|port| {
            (
                port.state.preference(),
                std::cmp::Reverse(port.speed_mbps),
                port.number,
            )
        })
    }
}

/// One entry of a preferred-NIC list.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct RankedNic {
    pub name: String,
    pub class: PathClass,
    /// False for NICs whose ports are down; those always come last.
    pub usable: bool,
    /// Whether a topology file pinned this NIC for the location.
    pub pinned: bool,
}

/// A memory location name: `cpu:N` (NUMA node N), `cuda:N`, `rocm:N`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum MemoryLocation {
    Cpu(u32),
    Cuda(u32),
    Rocm(u32),
}

impl FromStr for MemoryLocation {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        let parsed = text.split_once(':').and_then(|(kind, index)| {
            let index: u32 = index.parse().ok()?;
            match kind {
                "cpu" => Some(MemoryLocation::Cpu(index)),
                "cuda" => Some(MemoryLocation::Cuda(index)),
                "rocm" => Some(MemoryLocation::Rocm(index)),
                _ => None,
            }
        });
        parsed.ok_or_else(|| {
            format!("\"{text}\" is not a memory location (expected cpu:N, cuda:N or rocm:N)")
        })
    }
}

impl fmt::Display for MemoryLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MemoryLocation::Cpu(node) => write!(f, "cpu:{node}"),
            MemoryLocation::Cuda(ordinal) => write!(f, "cuda:{ordinal}"),
            MemoryLocation::Rocm(ordinal) => write!(f, "rocm:{ordinal}"),
        }
    }
}

/// Compares names the way people read them: `mlx5_2` before `mlx5_10`.
pub(crate) fn natural_order(a: &str, b: &str) -> std::cmp::Ordering {
    fn chunks(text: &str) -> impl Iterator<Item = (bool, &str)> {
        let mut rest = text;
        std::iter::from_fn(move || {
            let first = rest.chars().next()?;
            let digits = first.is_ascii_digit();
            let end = rest
                .find(|c: char| c.is_ascii_digit() != digits)
                .unwrap_or(rest.len());
            let (chunk, tail) = rest.split_at(end);
            rest = tail;
            Some((digits, chunk))
        })
    }
    let mut left = chunks(a);
    let mut right = chunks(b);
    loop {
        match (left.next(), right.next()) {
            (None, None) => return a.cmp(b),
            (None, Some(_)) => return std::cmp::Ordering::Less,
            (Some(_), None) => return std::cmp::Ordering::Greater,
            (Some((true, x)), Some((true, y))) => {
                let x = x.trim_start_matches('0');
                let y = y.trim_start_matches('0');
                let order = x.len().cmp(&y.len()).then_with(|| x.cmp(y));
                if order.is_ne() {
                    return order;
                }
            }
            (Some((_, x)), Some((_, y))) => {
                let order = x.cmp(y);
                if order.is_ne() {
                    return order;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn natural_order_puts_10_after_2() {
        let mut names = vec!["mlx5_10", "mlx5_2", "eth0", "mlx5_1", "mlx5_bond_0"];
        names.sort_by(|a, b| natural_order(a, b));
        assert_eq!(
            names,
            ["eth0", "mlx5_1", "mlx5_2", "mlx5_10", "mlx5_bond_0"]
        );
    }

    #[test]
    fn parses_port_states_and_operstates() {
        assert_eq!(LinkState::from_rdma_state("4: ACTIVE"), LinkState::Active);
        assert_eq!(LinkState::from_rdma_state("1: DOWN"), LinkState::Down);
        assert_eq!(LinkState::from_rdma_state("2: INIT"), LinkState::Init);
        assert_eq!(LinkState::from_rdma_state("5"), LinkState::Active);
        assert_eq!(
            LinkState::from_rdma_state("\u{fffd}garbage"),
            LinkState::Unknown
        );
        assert_eq!(LinkState::from_operstate("up"), LinkState::Active);
        assert_eq!(LinkState::from_operstate("lowerlayerdown"), LinkState::Down);
        assert_eq!(LinkState::from_operstate("unknown"), LinkState::Unknown);
        assert!(LinkState::Unknown.is_usable() && !LinkState::Init.is_usable());
    }

    #[test]
    fn memory_locations_round_trip() {
        for text in ["cpu:0", "cuda:7", "rocm:1"] {
            let location: MemoryLocation = text.parse().expect("valid");
            assert_eq!(location.to_string(), text);
        }
        for bad in ["gpu:0", "cuda0", "cuda:-1", "cpu:", ""] {
            assert!(bad.parse::<MemoryLocation>().is_err(), "{bad}");
        }
    }
}

/// What discovery found, with every pair classified and every location ranked.
#[derive(Debug, Clone)]
pub struct Topology {
    pub(super) sysfs_root: PathBuf,
    pub(super) numa_nodes: Vec<NumaNode>,
    pub(super) gpus: Vec<Gpu>,
    pub(super) nics: Vec<Nic>,
    /// `cpu:N` rows, then GPUs.
    pub(super) locations: Vec<String>,
    /// `classes[location][nic]`.
    pub(super) classes: Vec<Vec<PathClass>>,
    /// `preferred[location]`, best first.
    pub(super) preferred: Vec<Vec<RankedNic>>,
    pub(super) warnings: Vec<String>,
}

impl Topology {
    /// A topology that knows nothing (no sysfs could be read).
    pub fn empty() -> Topology {
        Topology {
            sysfs_root: PathBuf::from(DEFAULT_SYSFS_ROOT),
            numa_nodes: Vec::new(),
            gpus: Vec::new(),
            nics: Vec::new(),
            locations: Vec::new(),
            classes: Vec::new(),
            preferred: Vec::new(),
            warnings: Vec::new(),
        }
    }

    /// The canonical sysfs root that was read.
    pub fn sysfs_root(&self) -> &Path {
        &self.sysfs_root
    }

    /// NUMA nodes by id.
    pub fn numa_nodes(&self) -> &[NumaNode] {
        &self.numa_nodes
    }

    /// GPUs: `cuda:N` by ordinal, then `rocm:N`.
    pub fn gpus(&self) -> &[Gpu] {
        &self.gpus
    }

    /// NICs: RDMA devices, then network interfaces, each in natural name order.
    pub fn nics(&self) -> &[Nic] {
        &self.nics
    }

    /// Things an operator may want to know: links leaving the root, NIC names
    /// in `FERRY_NICS` that do not exist, unresolvable `CUDA_VISIBLE_DEVICES`
    /// entries, ...
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Memory location names: `cpu:N` for each NUMA node, then `cuda:N` and
    /// `rocm:N` for each GPU.
    pub fn locations(&self) -> impl Iterator<Item = &str> {
        self.locations.iter().map(String::as_str)
    }

    /// The GPU called `name` (`cuda:0`).
    pub fn gpu(&self, name: &str) -> Option<&Gpu> {
        self.gpus.iter().find(|gpu| gpu.name == name)
    }

    /// The GPU at a PCI address (any spelling [`PciAddress`] parses).
    pub fn gpu_by_pci(&self, address: &PciAddress) -> Option<&Gpu> {
        self.gpus
            .iter()
            .find(|gpu| gpu.pci.as_ref() == Some(address))
    }

    /// The NIC called `name` (`mlx5_0`, `eth0`).
    pub fn nic(&self, name: &str) -> Option<&Nic> {
        self.nics.iter().find(|nic| nic.name == name)
    }

    /// The NIC that owns network interface `netdev` (an RDMA device for its
    /// netdevs, or the `net` NIC of that name).
    pub fn nic_by_netdev(&self, netdev: &str) -> Option<&Nic> {
        self.nics
            .iter()
            .find(|nic| nic.netdevs.iter().any(|name| name == netdev))
    }

    /// The NICs on a PCI function.
    pub fn nics_by_pci<'a>(&'a self, address: &'a PciAddress) -> impl Iterator<Item = &'a Nic> {
        self.nics
            .iter()
            .filter(move |nic| nic.pci.as_ref() == Some(address))
    }

    /// The class of the path between a memory location and a NIC; `None`
    /// when either name is unknown.
    pub fn path_class(&self, location: &str, nic: &str) -> Option<PathClass> {
        let row = self.locations.iter().position(|name| name == location)?;
        let column = self
            .nics
            .iter()
            .position(|candidate| candidate.name == nic)?;
        self.classes.get(row)?.get(column).copied()
    }

    /// The NICs for memory at `location`, best first (every NIC appears; down
    /// ones last). `None` when the location does not exist on this host.
    pub fn preferred_nics(&self, location: &str) -> Option<&[RankedNic]> {
        let row = self.locations.iter().position(|name| name == location)?;
        self.preferred.get(row).map(Vec::as_slice)
    }

    /// The chosen NIC for `location`: the first of its preferred list.
    pub fn preferred_nic(&self, location: &str) -> Option<&RankedNic> {
        self.preferred_nics(location)?.first()
    }
}
