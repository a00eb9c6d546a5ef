//! PCI addresses and canonical PCI paths, and the one question topology asks of
//! them: how many PCIe switches, host bridges or root complexes separate two
//! PCI functions.
//!
//! A canonical PCI path is the realpath of `<root>/bus/pci/devices/<bdf>` below
//! `<root>/devices`, e.g. `devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0/0000:18:00.0`.
//! It is kept as a list of components, never as a string: counting '/' in
//! path suffixes (as Mooncake does) mistakes path depth for distance.
//!
//! # Counting switches
//!
//! A PCIe switch appears in sysfs as an upstream port whose children are the
//! switch's downstream ports; a device hangs below a downstream port. Walking
//! down from a host bridge (`pciDDDD:BB`), the first function is a root port
//! (part of the host bridge, not a switch), then ports alternate: depth 2 is an
//! upstream port, depth 3 a downstream port of the same switch, depth 4 the next
//! switch's upstream port, and so on. So every bridge at depth >= 2 maps to the
//! switch headed by the upstream port at the even depth at or just above it.
//! The role is a property of the bridge's place in the tree, so both devices
//! of a pair agree on which switch a shared bridge belongs to (NCCL instead
//! skips two levels upward from each device, which gives the same answer for
//! ordinary trees). Reading the PCIe capability from `config` would be exact,
//! but unprivileged readers only get its first 64 bytes, and fake trees have
//! none. The path between two functions traverses the switches of every bridge
//! strictly between them and their lowest common ancestor, plus that ancestor.

use std::fmt;
use std::path::{Component, Path};
use std::str::FromStr;

/// A PCI function address, `domain:bus:device.function`.
///
/// Parsing accepts the sysfs form (`0000:18:00.0`), CUDA/NVML's 8-digit domain
/// form in either case (`00000000:1B:00.0`) and the short `bus:device.function`
/// form (domain 0), so bus ids from drivers compare equal to sysfs ones.
/// Ordering is numeric: PCI bus order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct PciAddress {
    pub domain: u32,
    pub bus: u8,
    pub device: u8,
    pub function: u8,
}

/// Why a string is not a PCI address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PciAddressParseError {
    input: String,
}

impl fmt::Display for PciAddressParseError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "\"{}\" is not a PCI address (expected domain:bus:device.function, e.g. 0000:18:00.0)",
            self.input
        )
    }
}

impl std::error::Error for PciAddressParseError {}

impl PciAddress {
    /// Parses a sysfs directory name: exactly `DDDD:BB:DD.F` with a domain of
    /// 4 to 8 hex digits. Stricter than `FromStr` so that only real PCI
    /// function directories count as PCI components of a path.
    pub(crate) fn from_sysfs_name(name: &str) -> Option<Self> {
        let (domain, rest) = name.split_once(':')?;
        if !(4..=8).contains(&domain.len()) || rest.len() != 7 {
            return None;
        }
        Self::parse_parts(domain, rest)
    }

    fn parse_parts(domain: &str, bus_device_function: &str) -> Option<Self> {
        let (bus, device_function) = bus_device_function.split_once(':')?;
        let (device, function) = device_function.split_once('.')?;
        if bus.len() != 2 || device.len() != 2 || function.len() != 1 {
            return None;
        }
        let all_hex = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_hexdigit());
        if !(all_hex(domain) && all_hex(bus) && all_hex(device) && all_hex(function)) {
            return None;
        }
        let address = PciAddress {
            domain: u32::from_str_radix(domain, 16).ok()?,
            bus: u8::from_str_radix(bus, 16).ok()?,
            device: u8::from_str_radix(device, 16).ok()?,
            function: u8::from_str_radix(function, 16).ok()?,
        };
        (address.device <= 0x1f && address.function <= 7).then_some(address)
    }
}

impl FromStr for PciAddress {
    type Err = PciAddressParseError;

    fn from_str(input: &str) -> Result<Self, Self::Err> {
        let trimmed = input.trim();
        let error = || PciAddressParseError {
            input: input.to_string(),
        };
        let parsed = match trimmed.matches(':').count() {
            2 => {
                let (domain, rest) = trimmed.split_once(':').ok_or_else(error)?;
                if domain.len() > 8 {
                    return Err(error());
                }
                Self::parse_parts(domain, rest)
            }
            1 => Self::parse_parts("0", trimmed),
            _ => None,
        };
        parsed.ok_or_else(error)
    }
}

impl fmt::Display for PciAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

impl serde::Serialize for PciAddress {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

/// One directory level of a canonical PCI path.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PathComponent {
    /// `pciDDDD:BB`: a PCI host bridge, the root of one PCI hierarchy.
    HostBridge(String),
    /// A PCI function (bridge or endpoint).
    Function(PciAddress),
    /// Anything else (ACPI or VMBus parents above a host bridge, ...).
    Other(String),
}

impl PathComponent {
    fn parse(name: &str) -> Self {
        if let Some(address) = PciAddress::from_sysfs_name(name) {
            return PathComponent::Function(address);
        }
        let is_host_bridge = name.strip_prefix("pci").is_some_and(|rest| {
            rest.split_once(':').is_some_and(|(domain, bus)| {
                (4..=8).contains(&domain.len())
                    && bus.len() == 2
                    && domain
                        .bytes()
                        .chain(bus.bytes())
                        .all(|b| b.is_ascii_hexdigit())
            })
        });
        if is_host_bridge {
            PathComponent::HostBridge(name.to_string())
        } else {
            PathComponent::Other(name.to_string())
        }
    }
}

/// The canonical sysfs path of a PCI function, below `<root>/devices`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PciPath {
    components: Vec<PathComponent>,
    /// The path relative to the sysfs root, for display (`devices/pci0000:15/...`).
    display: String,
}

/// How two PCI functions are connected, as far as the PCI tree tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PciRelation {
    /// Below one PCI bridge; `switches` PCIe switches lie on the path.
    BelowCommonBridge { switches: usize },
    /// Only the host bridge is shared.
    SameHostBridge,
    /// No shared host bridge: different root complexes.
    DifferentHostBridges,
}

impl PciPath {
    /// The PCI function at or above `relative` (a canonical path relative to
    /// the sysfs root): the deepest PCI function component. A virtio net
    /// device (`.../0000:00:03.0/virtio2`) or an RDMA sub-function thus maps to
    /// the PCI function that carries it. `None` when the path is not below
    /// `devices/` or holds no PCI function (virtual or platform devices).
    pub(crate) fn containing(relative: &Path) -> Option<Self> {
        let mut names = Vec::new();
        for component in relative.components() {
            match component {
                Component::Normal(name) => names.push(name.to_str()?),
                // Canonical paths have none of these; refuse rather than guess.
                _ => return None,
            }
        }
        if names.first() != Some(&"devices") {
            return None;
        }
        let last_function = names
            .iter()
            .rposition(|name| PciAddress::from_sysfs_name(name).is_some())?;
        let kept = &names[1..=last_function];
        Some(PciPath {
            components: kept.iter().map(|name| PathComponent::parse(name)).collect(),
            display: names[..=last_function].join("/"),
        })
    }

    /// The address of the function this path ends in.
    pub(crate) fn address(&self) -> Option<PciAddress> {
        match self.components.last() {
            Some(PathComponent::Function(address)) => Some(*address),
            _ => None,
        }
    }

    /// The path relative to the sysfs root (`devices/pci0000:15/...`).
    pub(crate) fn display(&self) -> &str {
        &self.display
    }

    /// Where the two functions meet in the PCI tree.
    pub(crate) fn relation(&self, other: &PciPath) -> PciRelation {
        let a = &self.components;
        let b = &other.components;
        let common = a.iter().zip(b).take_while(|(x, y)| x == y).count();
        if common == 0 {
            return PciRelation::DifferentHostBridges;
        }
        match &a[common - 1] {
            PathComponent::HostBridge(_) => PciRelation::SameHostBridge,
            PathComponent::Other(_) => PciRelation::DifferentHostBridges,
            PathComponent::Function(_) => PciRelation::BelowCommonBridge {
                switches: switches_between(a, b, common),
            },
        }
    }
}

/// The number of distinct PCIe switches on the path between the ends of `a`
/// and `b`, whose first `common` components are shared.
fn switches_between(a: &[PathComponent], b: &[PathComponent], common: usize) -> usize {
    // A switch is identified by its upstream port's index; indices below
    // `common` are shared by both paths, others belong to one side only.
    #[derive(PartialEq, Eq, PartialOrd, Ord)]
    enum Owner {
        Shared,
        SideA,
        SideB,
    }
    let mut switches = std::collections::BTreeSet::new();
    let mut note = |path: &[PathComponent], index: usize, side: Owner| {
        if let Some(head) = switch_head(path, index) {
            let owner = if head < common { Owner::Shared } else { side };
            switches.insert((owner, head));
        }
    };
    let lowest_common_ancestor = common - 1;
    // When one function is an ancestor of the other (never for endpoints in
    // practice), the ancestor is an end of the path, not a hop on it.
    if common < a.len() && common < b.len() {
        note(a, lowest_common_ancestor, Owner::Shared);
    }
    for index in common..a.len().saturating_sub(1) {
        note(a, index, Owner::SideA);
    }
    for index in common..b.len().saturating_sub(1) {
        note(b, index, Owner::SideB);
    }
    switches.len()
}

/// The index of the upstream port heading the switch that the bridge at
/// `index` belongs to, or `None` for a root port (part of its host bridge).
fn switch_head(path: &[PathComponent], index: usize) -> Option<usize> {
    if !matches!(path[index], PathComponent::Function(_)) {
        // Something unusual inside a PCI hierarchy (a nested host bridge such
        // as Intel VMD's): count it as one hop of its own.
        return Some(index);
    }
    let host_bridge = path[..index]
        .iter()
        .rposition(|component| !matches!(component, PathComponent::Function(_)));
    let depth = match host_bridge {
        Some(position) => index - position,
        None => index + 1,
    };
    match depth {
        0 | 1 => None,
        even if even % 2 == 0 => Some(index),
        _ => Some(index - 1),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(text: &str) -> PciPath {
        PciPath::containing(Path::new(text)).expect("test path is a PCI path")
    }

    #[test]
    fn parses_every_common_bus_id_spelling() {
        let expected = PciAddress {
            domain: 0,
            bus: 0x1b,
            device: 0,
            function: 0,
        };
        for text in [
            "0000:1b:00.0",
            "00000000:1B:00.0",
            "1b:00.0",
            " 0000:1b:00.0\n",
        ] {
            assert_eq!(text.parse::<PciAddress>(), Ok(expected), "{text}");
        }
        assert_eq!(expected.to_string(), "0000:1b:00.0");
        for bad in [
            "",
            "0000:1b:00",
            "0000:1b:20.0",
            "0000:1b:00.8",
            "zz:00.0",
            "000000000:1b:00.0",
        ] {
            assert!(bad.parse::<PciAddress>().is_err(), "{bad}");
        }
        assert_eq!(PciAddress::from_sysfs_name("1b:00.0"), None);
        assert_eq!(
            PciAddress::from_sysfs_name("10000:01:00.0").map(|a| a.domain),
            Some(0x10000)
        );
    }

    #[test]
    fn orders_by_bus_numerically() {
        let mut addresses: Vec<PciAddress> = ["0000:c3:00.0", "10000:01:00.0", "0000:1b:00.0"]
            .iter()
            .map(|text| text.parse().expect("valid"))
            .collect();
        addresses.sort();
        let texts: Vec<String> = addresses.iter().map(ToString::to_string).collect();
        assert_eq!(texts, ["0000:1b:00.0", "0000:c3:00.0", "10000:01:00.0"]);
    }

    #[test]
    fn containing_walks_up_to_the_pci_function() {
        let virtio = path("devices/pci0000:00/0000:00:03.0/virtio2");
        assert_eq!(
            virtio.address().map(|a| a.to_string()).as_deref(),
            Some("0000:00:03.0")
        );
        assert_eq!(virtio.display(), "devices/pci0000:00/0000:00:03.0");
        assert!(PciPath::containing(Path::new("devices/virtual/net/lo")).is_none());
        assert!(PciPath::containing(Path::new("class/net/eth0")).is_none());
    }

    #[test]
    fn same_switch_is_one_switch() {
        let gpu = path("devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:01.0/0000:1b:00.0");
        let nic = path("devices/pci0000:15/0000:15:01.0/0000:16:00.0/0000:17:00.0/0000:18:00.0");
        assert_eq!(
            gpu.relation(&nic),
            PciRelation::BelowCommonBridge { switches: 1 }
        );
    }

    #[test]
    fn two_switch_levels_are_several_switches() {
        let base = "devices/pci0000:15/0000:15:01.0/0000:16:00.0";
        let gpu = path(&format!(
            "{base}/0000:17:00.0/0000:18:00.0/0000:19:00.0/0000:1a:00.0"
        ));
        let nic = path(&format!(
            "{base}/0000:17:01.0/0000:20:00.0/0000:21:00.0/0000:22:00.0"
        ));
        assert_eq!(
            gpu.relation(&nic),
            PciRelation::BelowCommonBridge { switches: 3 }
        );
        let sibling_under_lower_switch = path(&format!(
            "{base}/0000:17:00.0/0000:18:00.0/0000:19:01.0/0000:1b:00.0"
        ));
        assert_eq!(
            gpu.relation(&sibling_under_lower_switch),
            PciRelation::BelowCommonBridge { switches: 1 }
        );
    }

    #[test]
    fn functions_of_one_device_share_their_port() {
        let port0 = path("devices/pci0000:26/0000:26:01.0/0000:29:00.0");
        let port1 = path("devices/pci0000:26/0000:26:01.0/0000:29:00.1");
        assert_eq!(
            port0.relation(&port1),
            PciRelation::BelowCommonBridge { switches: 0 }
        );
    }

    #[test]
    fn host_bridges_and_root_complexes() {
        let a = path("devices/pci0000:40/0000:40:01.1/0000:41:00.0");
        let b = path("devices/pci0000:40/0000:40:03.1/0000:42:00.0");
        let c = path("devices/pci0000:80/0000:80:01.1/0000:81:00.0");
        assert_eq!(a.relation(&b), PciRelation::SameHostBridge);
        assert_eq!(a.relation(&c), PciRelation::DifferentHostBridges);
        let flat_a = path("devices/pci0000:00/0000:00:04.0");
        let flat_b = path("devices/pci0000:00/0000:00:05.0");
        assert_eq!(flat_a.relation(&flat_b), PciRelation::SameHostBridge);
        // Hyper-V style: a shared VMBus parent is not a shared host bridge.
        let hv_a = path("devices/LNXSYSTM:00/VMBUS:00/guid-a/pci0101:00/0101:00:00.0");
        let hv_b = path("devices/LNXSYSTM:00/VMBUS:00/guid-b/pci0102:00/0102:00:00.0");
        assert_eq!(hv_a.relation(&hv_b), PciRelation::DifferentHostBridges);
    }
}
