//! NIC discovery: RDMA devices from `class/infiniband`, network interfaces
//! from `class/net`, matched by the device they sit on, so that an RDMA
//! device's interfaces become its `netdevs` and only interfaces without RDMA
//! become NICs of kind `net`.

use std::path::{Path, PathBuf};

use super::model::{LinkState, Nic, NicKind, RdmaPort};
use super::nic_filter::NicFilter;
use super::pci::PciAddress;
use super::scan::{Discovery, PciFunction};
use super::sysfs::{parse_decimal, Resolved};

/// A network interface backed by a device, before it is matched with RDMA devices.
#[derive(Debug)]
struct RawNetdev {
    name: String,
    /// The canonical directory its `device` link points to (root-relative).
    device_dir: PathBuf,
    function: Option<PciFunction>,
    state: LinkState,
    link_layer: Option<String>,
    speed_mbps: Option<u64>,
}

/// An RDMA device before its netdevs are attached.
#[derive(Debug)]
struct RawRdma {
    nic: Nic,
    device_dir: Option<PathBuf>,
    /// For software RDMA (rxe, siw): the netdev it runs over.
    parent_netdev: Option<String>,
}

impl Discovery<'_> {
    pub(super) fn discover_nics(&mut self) -> Vec<Nic> {
        let mut rdma = self.discover_rdma_devices();
        let netdevs = self.discover_netdevs();
        let mut nics = Vec::new();
        let mut net_nics = Vec::new();
        for netdev in netdevs {
            let owner = rdma
                .iter()
                .position(|device| {
                    device.device_dir.as_deref() == Some(netdev.device_dir.as_path())
                })
                .or_else(|| {
                    let address = netdev.function.as_ref()?.address;
                    rdma.iter()
                        .position(|device| device.nic.pci == Some(address))
                })
                .or_else(|| {
                    rdma.iter().position(|device| {
                        device.parent_netdev.as_deref() == Some(netdev.name.as_str())
                    })
                });
            match owner {
                Some(index) => {
                    let device = &mut rdma[index];
                    if device.nic.pci.is_none() {
                        // Software RDMA sits where its netdev sits.
                        if let Some(function) = &netdev.function {
                            device.nic.pci = Some(function.address);
                            device.nic.numa = self.resolve_numa(function.raw_numa);
                            device.nic.sysfs_path = Some(function.path.display().to_string());
                            device.nic.pci_path = Some(function.path.clone());
                        }
                    }
                    device.nic.netdevs.push(netdev.name);
                }
                None => net_nics.push(self.net_nic(netdev)),
            }
        }
        nics.extend(rdma.into_iter().map(|device| device.nic));
        for nic in net_nics {
            if nics.iter().any(|existing: &Nic| existing.name == nic.name) {
                self.warnings.push(format!(
                    "network interface {} has the name of an RDMA device; the interface is ignored",
                    nic.name
                ));
            } else {
                nics.push(nic);
            }
        }
        nics
    }

    fn net_nic(&self, netdev: RawNetdev) -> Nic {
        let function = netdev.function;
        Nic {
            netdevs: vec![netdev.name.clone()],
            name: netdev.name,
            kind: NicKind::Net,
            pci: function.as_ref().map(|f| f.address),
            numa: function
                .as_ref()
                .and_then(|f| self.resolve_numa(f.raw_numa)),
            ports: Vec::new(),
            state: netdev.state,
            link_layer: netdev.link_layer,
            speed_mbps: netdev.speed_mbps,
            physical_function: function.as_ref().and_then(|f| f.physical_function),
            sysfs_path: function.as_ref().map(|f| f.path.display().to_string()),
            from_topology_file: false,
            pci_path: function.map(|f| f.path),
        }
    }

    /// The entries of a sysfs class directory that resolve inside the
    /// tree (an escaping link is warned about and skipped).
    fn class_entries(&mut self, base: &Path) -> Vec<(String, std::path::PathBuf)> {
        let mut out = Vec::new();
        for name in self.sysfs.list(base) {
            let class_dir = base.join(&name);
            match self.sysfs.resolve(&class_dir) {
                Resolved::Inside(_) => out.push((name, class_dir)),
                Resolved::Outside(target) => self.warn_escape(&class_dir, &target),
                Resolved::Missing => {}
            }
        }
        out
    }

    fn discover_rdma_devices(&mut self) -> Vec<RawRdma> {
        let base = Path::new("class/infiniband");
        let mut devices = Vec::new();
        for (name, class_dir) in self.class_entries(base) {
            let device_link = class_dir.join("device");
            let (device_dir, function, parent_netdev) = match self.sysfs.resolve(&device_link) {
                Resolved::Inside(target) => {
                    let function = self.function_containing(&target);
                    (Some(target), function, None)
                }
                Resolved::Outside(target) => {
                    self.warn_escape(&device_link, &target);
                    continue;
                }
                // rxe names its netdev in `parent`; siw has neither: it stays unplaced.
                Resolved::Missing => (
                    None,
                    None,
                    self.sysfs.read_attribute(&class_dir.join("parent")),
                ),
            };
            let ports = self.read_ports(&class_dir);
            let best = ports.iter().min_by_key(|port| {
                (
                    port.state.preference(),
                    std::cmp::Reverse(port.speed_mbps),
                    port.number,
                )
            });
            let nic = Nic {
                name: name.clone(),
                kind: NicKind::Rdma,
                pci: function.as_ref().map(|f| f.address),
                numa: function
                    .as_ref()
                    .and_then(|f| self.resolve_numa(f.raw_numa)),
                netdevs: Vec::new(),
                state: best.map_or(LinkState::Unknown, |port| port.state),
                link_layer: best.and_then(|port| port.link_layer.clone()),
                speed_mbps: best.and_then(|port| port.speed_mbps),
                ports,
                physical_function: function.as_ref().and_then(|f| f.physical_function),
                sysfs_path: function.as_ref().map(|f| f.path.display().to_string()),
                from_topology_file: false,
                pci_path: function.map(|f| f.path),
            };
            devices.push(RawRdma {
                nic,
                device_dir,
                parent_netdev,
            });
        }
        devices
    }

    fn read_ports(&self, class_dir: &Path) -> Vec<RdmaPort> {
        let ports_dir = class_dir.join("ports");
        let mut ports: Vec<RdmaPort> = self
            .sysfs
            .list(&ports_dir)
            .iter()
            .filter_map(|name| {
                let number: u32 = name.parse().ok()?;
                let port_dir = ports_dir.join(name);
                let read = |attribute: &str| self.sysfs.read_attribute(&port_dir.join(attribute));
                let rate = read("rate");
                Some(RdmaPort {
                    number,
                    state: read("state")
                        .map_or(LinkState::Unknown, |text| LinkState::from_rdma_state(&text)),
                    link_layer: read("link_layer"),
                    speed_mbps: rate.as_deref().and_then(parse_rate_mbps),
                    rate,
                })
            })
            .collect();
        ports.sort_by_key(|port| port.number);
        ports
    }

    fn discover_netdevs(&mut self) -> Vec<RawNetdev> {
        let base = Path::new("class/net");
        let mut netdevs = Vec::new();
        for (name, class_dir) in self.class_entries(base) {
            let device_link = class_dir.join("device");
            let device_dir = match self.sysfs.resolve(&device_link) {
                Resolved::Inside(target) => target,
                Resolved::Outside(target) => {
                    self.warn_escape(&device_link, &target);
                    continue;
                }
                Resolved::Missing => {
                    // lo, bridges, bonds, VLANs, veth: no device of their own.
                    log::debug!("topology: {name} has no device; not a NIC");
                    continue;
                }
            };
            let read = |attribute: &str| self.sysfs.read_attribute(&class_dir.join(attribute));
            if let Some(port_name) = read("phys_port_name").filter(|port| is_representor(port)) {
                log::debug!("topology: {name} is switchdev representor {port_name}; not a NIC");
                continue;
            }
            let link_layer = match read("type").and_then(|text| parse_decimal(&text)) {
                Some(1) => Some("Ethernet".to_string()),
                Some(32) => Some("InfiniBand".to_string()),
                _ => None,
            };
            let speed_mbps = read("speed")
                .and_then(|text| parse_decimal(&text))
                .and_then(|speed| u64::try_from(speed).ok())
                .filter(|speed| *speed > 0);
            netdevs.push(RawNetdev {
                function: self.function_containing(&device_dir),
                device_dir,
                state: read("operstate")
                    .map_or(LinkState::Unknown, |text| LinkState::from_operstate(&text)),
                link_layer,
                speed_mbps,
                name,
            });
        }
        netdevs
    }
}

/// Drops an SR-IOV virtual function when its physical function is a NIC too:
/// on a host that sees both, the PF reaches everything the VFs do and VFs are
/// usually meant for guests or containers. A VF whose PF is not visible (inside
/// a VM or a container given only the VF) is a NIC like any other, and an
/// allow list that names a VF keeps it.
pub(super) fn prune_virtual_functions(nics: &mut Vec<Nic>, filter: Option<NicFilter>) {
    let physical: Vec<PciAddress> = nics
        .iter()
        .filter(|nic| !nic.is_virtual_function())
        .filter_map(|nic| nic.pci)
        .collect();
    nics.retain(|nic| {
        let Some(pf) = nic.physical_function else {
            return true;
        };
        let keep = !physical.contains(&pf)
            || filter
                .as_ref()
                .is_some_and(|filter| filter.names_explicitly(&nic.name));
        if !keep {
            log::debug!(
                "topology: {} is a VF of {pf}, which is listed; skipping it",
                nic.name
            );
        }
        keep
    });
}

/// Whether a `phys_port_name` belongs to a switchdev representor (`pf0vf3`,
/// `pf0sf1`, `c1pf0vf2`) rather than to a port of its own.
fn is_representor(port_name: &str) -> bool {
    let without_controller = port_name
        .strip_prefix('c')
        .map(|rest| rest.trim_start_matches(|c: char| c.is_ascii_digit()))
        .unwrap_or(port_name);
    without_controller.starts_with("pf")
        && (without_controller.contains("vf") || without_controller.contains("sf"))
}

/// Parses an RDMA `rate` attribute ("400 Gb/sec (4X NDR)", "2.5 Gb/sec (1X SDR)") in Mbit/s.
pub(crate) fn parse_rate_mbps(rate: &str) -> Option<u64> {
    let mut words = rate.split_whitespace();
    let value: f64 = words.next()?.parse().ok()?;
    let unit = words.next()?;
    let scale = if unit.starts_with("Tb") {
        1_000_000.0
    } else if unit.starts_with("Gb") {
        1_000.0
    } else if unit.starts_with("Mb") {
        1.0
    } else {
        return None;
    };
    let mbps = value * scale;
    // Rejects NaN, negatives and absurd values that garbage can parse to.
    (mbps.is_finite() && (0.0..1e12).contains(&mbps)).then(|| mbps.round() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_rates() {
        assert_eq!(parse_rate_mbps("400 Gb/sec (4X NDR)"), Some(400_000));
        assert_eq!(parse_rate_mbps("2.5 Gb/sec (1X SDR)"), Some(2_500));
        assert_eq!(parse_rate_mbps("100 Mb/sec"), Some(100));
        assert_eq!(parse_rate_mbps("NaN Gb/sec"), None);
        assert_eq!(parse_rate_mbps("-5 Gb/sec"), None);
        assert_eq!(parse_rate_mbps("1e300 Gb/sec"), None);
        assert_eq!(parse_rate_mbps("fast"), None);
    }

    #[test]
    fn recognises_representors() {
        for name in ["pf0vf3", "pf1sf0", "c1pf0vf2"] {
            assert!(is_representor(name), "{name}");
        }
        for name in ["p0", "p1", "pf0", ""] {
            assert!(!is_representor(name), "{name}");
        }
    }
}
