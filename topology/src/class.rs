//! Path classes, named as `nvidia-smi topo -m` names them, and the rules that
//! give one to each (memory location, NIC) pair.
//!
//! Unknown NUMA placement (sysfs `numa_node` = -1 on a machine with several
//! nodes) counts as "same node": it can only soften SYS into NODE, never turn
//! every pair into SYS, which would make the ranking useless on exactly the
//! VMs that report -1.

use std::fmt;

use super::pci::{PciPath, PciRelation};

/// How far a NIC is from a memory location; smaller is closer.
///
/// The order is the ranking order: `Pix < Pxb < Phb < Node < Sys < Unknown`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PathClass {
    /// Through at most one PCIe switch (or the same PCIe port).
    Pix,
    /// Through several PCIe switches, without crossing a host bridge.
    Pxb,
    /// Through a PCIe host bridge (for `cpu:N` rows: the NIC hangs off node N).
    Phb,
    /// Between host bridges of one NUMA node.
    Node,
    /// Across the interconnect between NUMA nodes (UPI, xGMI, ...).
    Sys,
    /// Nothing is known about where one side sits.
    Unknown,
}

impl PathClass {
    /// Every class, closest first.
    pub const ALL: [PathClass; 6] = [
        PathClass::Pix,
        PathClass::Pxb,
        PathClass::Phb,
        PathClass::Node,
        PathClass::Sys,
        PathClass::Unknown,
    ];

    /// The `nvidia-smi topo -m` spelling: "PIX", "PXB", "PHB", "NODE", "SYS";
    /// "UNKNOWN" for [`PathClass::Unknown`].
    pub fn as_str(&self) -> &'static str {
        match self {
            PathClass::Pix => "PIX",
            PathClass::Pxb => "PXB",
            PathClass::Phb => "PHB",
            PathClass::Node => "NODE",
            PathClass::Sys => "SYS",
            PathClass::Unknown => "UNKNOWN",
        }
    }

    /// The value used for path classes in Ferry's C ABI: PIX=1, PXB=2, PHB=3,
    /// NODE=4, SYS=5, UNKNOWN=0.
    pub fn as_abi(&self) -> u32 {
        match self {
            PathClass::Unknown => 0,
            PathClass::Pix => 1,
            PathClass::Pxb => 2,
            PathClass::Phb => 3,
            PathClass::Node => 4,
            PathClass::Sys => 5,
        }
    }

    /// The inverse of [`PathClass::as_abi`]; `None` for values no class has.
    pub fn from_abi(value: u32) -> Option<PathClass> {
        PathClass::ALL
            .into_iter()
            .find(|class| class.as_abi() == value)
    }

    /// One line saying what the class means, for legends.
    pub fn description(&self) -> &'static str {
        match self {
            PathClass::Pix => "through at most one PCIe switch",
            PathClass::Pxb => "through several PCIe switches, no host bridge",
            PathClass::Phb => "through a PCIe host bridge (for cpu:N, a NIC on node N)",
            PathClass::Node => "between PCIe host bridges of one NUMA node",
            PathClass::Sys => "across the interconnect between NUMA nodes",
            PathClass::Unknown => "placement unknown",
        }
    }
}

impl fmt::Display for PathClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where a PCI device sits, as far as discovery could tell.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Placement<'a> {
    pub pci_path: Option<&'a PciPath>,
    pub numa: Option<u32>,
}

impl Placement<'_> {
    fn is_unknown(&self) -> bool {
        self.pci_path.is_none() && self.numa.is_none()
    }
}

/// The class of the path between two PCI devices (a GPU and a NIC).
pub(crate) fn classify_devices(a: Placement<'_>, b: Placement<'_>) -> PathClass {
    if a.is_unknown() || b.is_unknown() {
        return PathClass::Unknown;
    }
    if let (Some(path_a), Some(path_b)) = (a.pci_path, b.pci_path) {
        match path_a.relation(path_b) {
            PciRelation::BelowCommonBridge { switches } if switches <= 1 => return PathClass::Pix,
            PciRelation::BelowCommonBridge { .. } => return PathClass::Pxb,
            PciRelation::SameHostBridge => return PathClass::Phb,
            PciRelation::DifferentHostBridges => {}
        }
    }
    match (a.numa, b.numa) {
        (Some(x), Some(y)) if x != y => PathClass::Sys,
        _ => PathClass::Node,
    }
}

/// What a NUMA node's memory is attached to, for `cpu:N` rows.
#[derive(Debug, Clone, Copy)]
pub(crate) struct MemoryNode {
    pub id: u32,
    pub has_cpus: bool,
    /// For a CPU-less node (CXL or GPU memory exposed as a node): the nearest
    /// node with CPUs, whose host bridges serve it.
    pub nearest_cpu_node: Option<u32>,
}

/// The class of the path between host memory on a NUMA node and a NIC.
pub(crate) fn classify_host_memory(node: MemoryNode, nic: Placement<'_>) -> PathClass {
    if nic.is_unknown() {
        return PathClass::Unknown;
    }
    let local = if node.has_cpus {
        PathClass::Phb
    } else {
        PathClass::Node
    };
    match nic.numa {
        None => local,
        Some(nic_node) if nic_node == node.id => local,
        Some(nic_node) => match (node.has_cpus, node.nearest_cpu_node) {
            (false, Some(home)) if home == nic_node => PathClass::Node,
            (false, None) => PathClass::Node,
            _ => PathClass::Sys,
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    fn path(text: &str) -> PciPath {
        PciPath::containing(Path::new(text)).expect("test path is a PCI path")
    }

    #[test]
    fn abi_values_round_trip() {
        for class in PathClass::ALL {
            assert_eq!(PathClass::from_abi(class.as_abi()), Some(class));
        }
        assert_eq!(PathClass::Pix.as_abi(), 1);
        assert_eq!(PathClass::Sys.as_abi(), 5);
        assert_eq!(PathClass::Unknown.as_abi(), 0);
        assert!(PathClass::Pix < PathClass::Pxb && PathClass::Node < PathClass::Sys);
    }

    #[test]
    fn unknown_numa_is_not_sys() {
        let gpu = path("devices/pci0000:00/0000:00:01.0/0000:01:00.0");
        let nic = path("devices/pci0000:80/0000:80:01.0/0000:81:00.0");
        let with = |numa_a, numa_b| {
            classify_devices(
                Placement {
                    pci_path: Some(&gpu),
                    numa: numa_a,
                },
                Placement {
                    pci_path: Some(&nic),
                    numa: numa_b,
                },
            )
        };
        assert_eq!(with(Some(0), Some(1)), PathClass::Sys);
        assert_eq!(with(Some(0), Some(0)), PathClass::Node);
        assert_eq!(with(None, Some(1)), PathClass::Node);
        assert_eq!(with(None, None), PathClass::Node);
        let nowhere = Placement {
            pci_path: None,
            numa: None,
        };
        assert_eq!(
            classify_devices(
                Placement {
                    pci_path: Some(&gpu),
                    numa: None
                },
                nowhere
            ),
            PathClass::Unknown
        );
    }

    #[test]
    fn host_memory_rows() {
        let socket0 = MemoryNode {
            id: 0,
            has_cpus: true,
            nearest_cpu_node: Some(0),
        };
        let cxl = MemoryNode {
            id: 2,
            has_cpus: false,
            nearest_cpu_node: Some(1),
        };
        let on = |numa| Placement {
            pci_path: None,
            numa,
        };
        assert_eq!(classify_host_memory(socket0, on(Some(0))), PathClass::Phb);
        assert_eq!(classify_host_memory(socket0, on(Some(1))), PathClass::Sys);
        assert_eq!(classify_host_memory(socket0, on(None)), PathClass::Unknown);
        assert_eq!(classify_host_memory(cxl, on(Some(1))), PathClass::Node);
        assert_eq!(classify_host_memory(cxl, on(Some(0))), PathClass::Sys);
    }
}
