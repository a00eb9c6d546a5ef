//! A GPU as the engine knows it: its device plugin's description, placed in
//! the host's topology by PCI bus id. Both the start-up plan (from the
//! plugins' probes) and the running engine (from the started plugins) place
//! devices through [`place_gpu`], so the two name every GPU alike.

use ferry_plugins_abi::sdk::DeviceInfo;
use ferry_topology::{GpuVendor, PciAddress, Topology};

use crate::location::Location;

/// A device as the engine knows it: its plugin's description and where the
/// topology places it.
#[derive(Clone, Debug)]
pub struct Gpu {
    /// Index into the engine's device plugins.
    pub plugin: usize,
    pub info: DeviceInfo,
    /// "cuda:N" as the driver numbers it.
    pub location: Location,
    /// The topology's name for the same PCI function (its PCI-order guess).
    pub topology_name: Option<String>,
}

/// A device as its plugin describes it, placed in the topology by PCI bus
/// id: named by the PCI vendor the topology read (cuda:N, rocm:N) with the
/// driver's ordinal, which replaces the topology's PCI-order guess; a
/// device outside the PCI tree keeps the driver's ordinal under cuda.
pub(crate) fn place_gpu(plugin: usize, info: DeviceInfo, topology: &Topology) -> Gpu {
    let placed = info
        .pci_bus_id
        .parse::<PciAddress>()
        .ok()
        .and_then(|pci| topology.gpu_by_pci(&pci));
    let location = match placed.map(|g| g.vendor) {
        Some(GpuVendor::Amd) => Location::Rocm(info.ordinal),
        _ => Location::Cuda(info.ordinal),
    };
    Gpu {
        plugin,
        topology_name: placed.map(|g| g.name.clone()),
        info,
        location,
    }
}
