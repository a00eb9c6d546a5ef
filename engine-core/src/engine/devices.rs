//! Devices (GPUs) as the engine knows them: each device plugin's devices,
//! placed in the topology by PCI bus id.

use super::shared::Shared;
use crate::device::Device;
use crate::error::{Error, ErrorCode, Result};
use crate::location::Location;
use crate::topology::{PciAddress, Topology};
use std::sync::Arc;

/// A device as the engine knows it: its plugin's description and where the
/// topology places it.
#[derive(Clone, Debug)]
pub struct Gpu {
    /// Index into the engine's device plugins.
    pub plugin: usize,
    pub info: crate::device::DeviceInfo,
    /// "cuda:N" as the driver numbers it.
    pub location: Location,
    /// The topology's name for the same PCI function (its PCI-order guess).
    pub topology_name: Option<String>,
}

impl Shared {
    /// The device plugin and ordinal serving a device location.
    pub(crate) fn device_of(&self, location: Location) -> Result<(usize, u32)> {
        self.gpus
            .iter()
            .find(|g| g.location == location)
            .map(|g| {
                let ordinal = match g.location {
                    Location::Cuda(o) | Location::Rocm(o) => o,
                    Location::Cpu(n) => n,
                };
                (g.plugin, ordinal)
            })
            .ok_or_else(|| {
                Error::new(
                    ErrorCode::NotFound,
                    format!("no device {location} (`ferry info` lists the devices)"),
                )
            })
    }
}

/// Every device the device plugins report, placed in the topology by PCI
/// bus id (the driver's numbering replaces the topology's PCI-order guess).
pub(crate) fn discover_gpus(devices: &[Arc<Device>], topology: &Topology) -> Vec<Gpu> {
    let mut gpus = Vec::new();
    for (plugin, d) in devices.iter().enumerate() {
        let count = match d.device_count() {
            Ok(n) => n,
            Err(e) => {
                log::warn!("{}: cannot count devices: {e}", d.name);
                continue;
            }
        };
        for ordinal in 0..count {
            let info = match d.device_info(ordinal) {
                Ok(i) => i,
                Err(e) => {
                    log::warn!("{}: device {ordinal}: {e}", d.name);
                    continue;
                }
            };
            let topology_name = info
                .pci_bus_id
                .parse::<PciAddress>()
                .ok()
                .and_then(|pci| topology.gpu_by_pci(&pci))
                .map(|g| g.name.clone());
            let location = match d.name.as_str() {
                "rocm" => Location::Rocm(ordinal),
                _ => Location::Cuda(ordinal),
            };
            log::info!(
                "{location} is {} at PCI {}{}",
                info.name,
                info.pci_bus_id,
                match &topology_name {
                    Some(t) if *t != location.to_string() =>
                        format!(" (the topology's {t}: the driver's numbering wins)"),
                    Some(_) => String::new(),
                    None => " (not found in the sysfs PCI tree)".to_string(),
                }
            );
            gpus.push(Gpu {
                plugin,
                info,
                location,
                topology_name,
            });
        }
    }
    gpus
}
