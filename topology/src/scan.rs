//! One discovery pass over sysfs: its state (the sysfs handle, the
//! configuration, NUMA nodes and PCI functions found so far, warnings) and
//! what every step of it asks (`discover` for GPUs and the rest,
//! `nic_discovery` for NICs): a NUMA node from a raw value, the PCI
//! function above a path, a warning for a link that leaves the root.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::config::TopologyConfig;
use super::model::NumaNode;
use super::pci::{PciAddress, PciPath};
use super::sysfs::{parse_decimal, parse_hex, Resolved, Sysfs};

/// What sysfs says about one PCI function.
#[derive(Debug, Clone)]
pub(super) struct PciFunction {
    pub(super) address: PciAddress,
    pub(super) path: PciPath,
    pub(super) vendor: Option<u32>,
    pub(super) device: Option<u32>,
    pub(super) class: Option<u32>,
    pub(super) raw_numa: Option<i64>,
    pub(super) physical_function: Option<PciAddress>,
}

pub(super) struct Discovery<'a> {
    pub(super) sysfs: Sysfs,
    pub(super) config: &'a TopologyConfig,
    pub(super) numa_nodes: Vec<NumaNode>,
    pub(super) functions: BTreeMap<PciAddress, PciFunction>,
    pub(super) warnings: Vec<String>,
}

impl Discovery<'_> {
    pub(super) fn resolve_numa(&self, raw: Option<i64>) -> Option<u32> {
        match raw.and_then(|value| u32::try_from(value).ok()) {
            Some(node) => Some(node),
            // With one node, "unknown" can only mean that node.
            None if self.numa_nodes.len() == 1 => Some(self.numa_nodes[0].id),
            None => None,
        }
    }

    pub(super) fn warn_escape(&mut self, link: &Path, target: &Path) {
        self.warnings.push(format!(
            "{} resolves to {}, outside the sysfs root {}; ignored",
            self.sysfs.show(link),
            target.display(),
            self.sysfs.root().display()
        ));
    }

    /// The PCI function at or above a canonical root-relative path.
    pub(super) fn function_containing(&self, canonical: &Path) -> Option<PciFunction> {
        let path = PciPath::containing(canonical)?;
        let address = path.address()?;
        if let Some(known) = self.functions.get(&address) {
            if known.path == path {
                return Some(known.clone());
            }
        }
        let directory = PathBuf::from(path.display());
        let hex = |attribute: &str| {
            self.sysfs
                .read_attribute(&directory.join(attribute))
                .and_then(|text| parse_hex(&text))
        };
        let physical_function = match self.sysfs.resolve(&directory.join("physfn")) {
            Resolved::Inside(target) => PciPath::containing(&target).and_then(|pf| pf.address()),
            _ => None,
        };
        Some(PciFunction {
            address,
            vendor: hex("vendor"),
            device: hex("device"),
            class: hex("class"),
            raw_numa: self
                .sysfs
                .read_attribute(&directory.join("numa_node"))
                .and_then(|text| parse_decimal(&text)),
            physical_function,
            path,
        })
    }
}
