//! Discovery from sysfs, in order: NUMA nodes, PCI functions, GPUs, NICs
//! (see `nic_discovery`), then the topology file, `FERRY_NICS` and SR-IOV
//! pruning, then classes and ranking. Nothing here fails on a missing or
//! garbled sysfs piece: it degrades and, where an operator would want to
//! know, records a warning.

use std::collections::BTreeMap;
use std::path::Path;

use super::class::{classify_devices, classify_host_memory, MemoryNode, PathClass, Placement};
use super::config::TopologyConfig;
use super::error::TopologyError;
use super::model::{
    natural_order, Gpu, GpuVendor, LinkState, MemoryLocation, Nic, NicKind, NumaNode, Topology,
};
use super::nic_discovery::prune_virtual_functions;
use super::nic_filter::NicFilter;
use super::override_file::TopologyFile;
use super::pci::PciAddress;
use super::rank::{rank_locations, RankInput};
use super::scan::{Discovery, PciFunction};
use super::sysfs::{Resolved, Sysfs};
use super::visible::visible_gpu_indices;

/// PCI base classes that GPUs use: display controller (0x03), and processing
/// accelerator (0x12), which some AMD Instinct parts report.
const GPU_BASE_CLASSES: [u32; 2] = [0x03, 0x12];

impl Topology {
    /// Discovers the topology under `config.sysfs_root`. Logs only at debug
    /// level; the caller decides what to say about the result and the
    /// [`Topology::warnings`].
    pub fn discover(config: &TopologyConfig) -> Result<Topology, TopologyError> {
        discover(config)
    }
}

pub(crate) fn discover(config: &TopologyConfig) -> Result<Topology, TopologyError> {
    // A bad topology file is the operator's to fix: fail before touching sysfs.
    let file = config
        .topology_file
        .as_deref()
        .map(TopologyFile::load)
        .transpose()?;
    let sysfs = Sysfs::open(&config.sysfs_root)?;
    let mut discovery = Discovery {
        sysfs,
        config,
        numa_nodes: Vec::new(),
        functions: BTreeMap::new(),
        warnings: Vec::new(),
    };
    discovery.numa_nodes = discovery.discover_numa_nodes();
    discovery.functions = discovery.discover_pci_functions();

    let mut gpus = discovery.discover_gpus();
    let mut nics = discovery.discover_nics();
    let mut pins: Vec<(MemoryLocation, Vec<String>)> = Vec::new();
    if let Some(file) = &file {
        discovery.apply_file_nics(file, &mut nics)?;
        discovery.apply_file_gpus(file, &mut gpus);
        check_pins(file, &nics)?;
        pins = file.preferred.clone();
    }
    discovery.filter_nics(&mut nics);
    prune_virtual_functions(
        &mut nics,
        config.nic_filter.as_deref().and_then(NicFilter::parse),
    );
    nics.sort_by(|a, b| {
        a.kind
            .cmp(&b.kind)
            .then_with(|| natural_order(&a.name, &b.name))
    });

    let mut locations: Vec<String> = discovery
        .numa_nodes
        .iter()
        .map(|node| MemoryLocation::Cpu(node.id).to_string())
        .collect();
    locations.extend(gpus.iter().map(|gpu| gpu.name.clone()));

    let classes = classify_all(&discovery.numa_nodes, &gpus, &nics);
    let pins_by_location = discovery.usable_pins(pins, &locations, &nics);
    let preferred = rank_locations(&mut RankInput {
        locations: &locations,
        gpu_location_count: gpus.len(),
        nics: &nics,
        classes: &classes,
        pins: &pins_by_location,
        warnings: &mut discovery.warnings,
    });

    Ok(Topology {
        sysfs_root: discovery.sysfs.root().to_path_buf(),
        numa_nodes: discovery.numa_nodes,
        gpus,
        nics,
        locations,
        classes,
        preferred,
        warnings: discovery.warnings,
    })
}

impl Discovery<'_> {
    fn discover_numa_nodes(&mut self) -> Vec<NumaNode> {
        let base = Path::new("devices/system/node");
        let mut ids: Vec<u32> = self
            .sysfs
            .list(base)
            .iter()
            .filter_map(|name| {
                let id: u32 = name.strip_prefix("node")?.parse().ok()?;
                (format!("node{id}") == *name).then_some(id)
            })
            .collect();
        ids.sort_unstable();
        let mut distances = Vec::new();
        let mut nodes: Vec<NumaNode> = ids
            .iter()
            .map(|&id| {
                let directory = base.join(format!("node{id}"));
                let cpus = self
                    .sysfs
                    .read_attribute(&directory.join("cpulist"))
                    .unwrap_or_default();
                let distance: Option<Vec<u32>> = self
                    .sysfs
                    .read_attribute(&directory.join("distance"))
                    .and_then(|text| text.split_whitespace().map(|d| d.parse().ok()).collect());
                distances.push(distance.unwrap_or_default());
                NumaNode {
                    id,
                    cpus,
                    nearest_cpu_node: None,
                }
            })
            .collect();
        if nodes.is_empty() {
            let cpus = self
                .sysfs
                .read_attribute(Path::new("devices/system/cpu/online"))
                .unwrap_or_default();
            self.warnings.push(format!(
                "no NUMA nodes under {}; assuming one node 0 with CPUs \"{cpus}\"",
                self.sysfs.show(base)
            ));
            return vec![NumaNode {
                id: 0,
                cpus,
                nearest_cpu_node: Some(0),
            }];
        }
        let cpu_nodes: Vec<(usize, u32)> = nodes
            .iter()
            .enumerate()
            .filter(|(_, node)| node.has_cpus())
            .map(|(index, node)| (index, node.id))
            .collect();
        for (index, node) in nodes.iter_mut().enumerate() {
            node.nearest_cpu_node = if node.has_cpus() {
                Some(node.id)
            } else {
                // `distance` lists one entry per online node, in id order.
                let row = &distances[index];
                let by_distance = (row.len() == ids.len())
                    .then(|| {
                        cpu_nodes
                            .iter()
                            .min_by_key(|(i, id)| (row[*i], *id))
                            .map(|(_, id)| *id)
                    })
                    .flatten();
                by_distance.or(match cpu_nodes.as_slice() {
                    [(_, only)] => Some(*only),
                    _ => None,
                })
            };
        }
        nodes
    }

    fn discover_pci_functions(&mut self) -> BTreeMap<PciAddress, PciFunction> {
        let base = Path::new("bus/pci/devices");
        let names = self.sysfs.list(base);
        if names.is_empty() {
            self.warnings.push(format!(
                "no PCI devices under {}: no GPU can be found, and NICs get no PCI path",
                self.sysfs.show(base)
            ));
        }
        let mut functions = BTreeMap::new();
        for name in names {
            if PciAddress::from_sysfs_name(&name).is_none() {
                log::debug!("topology: ignoring {name} in bus/pci/devices: not a PCI address");
                continue;
            }
            let link = base.join(&name);
            if let Some(function) = self.function_at_link(&link) {
                functions.insert(function.address, function);
            }
        }
        functions
    }

    /// The PCI function a device link leads to, refusing links that leave the root.
    fn function_at_link(&mut self, link: &Path) -> Option<PciFunction> {
        match self.sysfs.resolve(link) {
            Resolved::Inside(target) => self.function_containing(&target),
            Resolved::Outside(target) => {
                self.warn_escape(link, &target);
                None
            }
            Resolved::Missing => None,
        }
    }

    fn discover_gpus(&mut self) -> Vec<Gpu> {
        let mut by_vendor: BTreeMap<GpuVendor, Vec<PciFunction>> = BTreeMap::new();
        for function in self.functions.values() {
            let Some(vendor) = function.vendor.and_then(GpuVendor::from_pci_vendor_id) else {
                continue;
            };
            let is_gpu_class = function
                .class
                .is_some_and(|class| GPU_BASE_CLASSES.contains(&(class >> 16)));
            if !is_gpu_class {
                continue;
            }
            if function.physical_function.is_some() {
                // The host's CUDA does not enumerate vGPU/SR-IOV VFs of its GPUs.
                log::debug!(
                    "topology: skipping GPU virtual function {}",
                    function.address
                );
                continue;
            }
            by_vendor.entry(vendor).or_default().push(function.clone());
        }
        let mut gpus = Vec::new();
        for (vendor, functions) in by_vendor {
            // `functions` is in PCI bus order (BTreeMap by address).
            let visible = match vendor {
                GpuVendor::Nvidia => {
                    let mut models: Vec<u32> = functions.iter().filter_map(|f| f.device).collect();
                    models.sort_unstable();
                    models.dedup();
                    if models.len() > 1 {
                        let ids: Vec<String> =
                            models.iter().map(|id| format!("0x{id:04x}")).collect();
                        self.warnings.push(format!(
                            "NVIDIA GPUs of {} different models ({}): cuda:N follows PCI bus order, \
                             which CUDA only guarantees with CUDA_DEVICE_ORDER=PCI_BUS_ID",
                            models.len(),
                            ids.join(", ")
                        ));
                    }
                    visible_gpu_indices(
                        self.config.cuda_visible_devices.as_deref(),
                        functions.len(),
                        &mut self.warnings,
                    )
                }
                // ROCm's own visibility variables are the ROCm device plugin's business.
                GpuVendor::Amd => (0..functions.len()).collect(),
            };
            for (ordinal, index) in visible.into_iter().enumerate() {
                let function = &functions[index];
                let ordinal = u32::try_from(ordinal).unwrap_or(u32::MAX);
                gpus.push(Gpu {
                    ordinal,
                    name: format!("{}:{ordinal}", vendor.location_prefix()),
                    vendor,
                    pci: Some(function.address),
                    pci_device_id: function.device.and_then(|id| u16::try_from(id).ok()),
                    numa: self.resolve_numa(function.raw_numa),
                    sysfs_path: Some(function.path.display().to_string()),
                    from_topology_file: false,
                    pci_path: Some(function.path.clone()),
                });
            }
        }
        gpus
    }

    fn apply_file_nics(
        &mut self,
        file: &TopologyFile,
        nics: &mut Vec<Nic>,
    ) -> Result<(), TopologyError> {
        for entry in &file.nics {
            let index = match nics.iter().position(|nic| nic.name == entry.name) {
                Some(index) => index,
                None => {
                    let Some(kind) = entry.kind else {
                        return Err(file.invalid(format!(
                            "NIC {} is not in sysfs, so its entry needs \"kind\": \"rdma\" or \"net\"",
                            entry.name
                        )));
                    };
                    nics.push(Nic {
                        name: entry.name.clone(),
                        kind,
                        pci: None,
                        numa: None,
                        netdevs: if kind == NicKind::Net {
                            vec![entry.name.clone()]
                        } else {
                            Vec::new()
                        },
                        ports: Vec::new(),
                        state: LinkState::Unknown,
                        link_layer: None,
                        speed_mbps: None,
                        physical_function: None,
                        sysfs_path: None,
                        from_topology_file: true,
                        pci_path: None,
                    });
                    nics.len() - 1
                }
            };
            let placement = entry.pci.map(|address| self.place(address, &entry.name));
            let nic = &mut nics[index];
            nic.from_topology_file = true;
            if let Some(kind) = entry.kind {
                nic.kind = kind;
            }
            if let Some((address, function)) = placement {
                nic.pci = Some(address);
                nic.numa = function
                    .as_ref()
                    .and_then(|f| self.resolve_numa(f.raw_numa));
                nic.sysfs_path = function.as_ref().map(|f| f.path.display().to_string());
                nic.physical_function = function.as_ref().and_then(|f| f.physical_function);
                nic.pci_path = function.map(|f| f.path);
            }
            if let Some(numa) = entry.numa {
                nic.numa = numa;
            }
            if let Some(state) = entry.state {
                nic.state = state;
            }
            if let Some(speed) = entry.speed_mbps {
                nic.speed_mbps = Some(speed);
            }
            if let Some(netdevs) = &entry.netdevs {
                nic.netdevs = netdevs.clone();
            }
        }
        Ok(())
    }

    /// The sysfs function at a PCI address a topology file names, if any.
    fn place(&mut self, address: PciAddress, what: &str) -> (PciAddress, Option<PciFunction>) {
        let function = self.functions.get(&address).cloned();
        if function.is_none() {
            self.warnings.push(format!(
                "topology file places {what} at PCI {address}, which sysfs does not show; \
                 its path classes come from NUMA placement only"
            ));
        }
        (address, function)
    }

    fn apply_file_gpus(&mut self, file: &TopologyFile, gpus: &mut Vec<Gpu>) {
        for entry in &file.gpus {
            let (vendor, ordinal) = match entry.location {
                MemoryLocation::Cuda(ordinal) => (GpuVendor::Nvidia, ordinal),
                MemoryLocation::Rocm(ordinal) => (GpuVendor::Amd, ordinal),
                // Validated when the file was read.
                MemoryLocation::Cpu(_) => continue,
            };
            let name = entry.location.to_string();
            let placement = entry.pci.map(|address| self.place(address, &name));
            let index = match gpus.iter().position(|gpu| gpu.name == name) {
                Some(index) => index,
                None => {
                    gpus.push(Gpu {
                        ordinal,
                        name: name.clone(),
                        vendor,
                        pci: None,
                        pci_device_id: None,
                        numa: None,
                        sysfs_path: None,
                        from_topology_file: true,
                        pci_path: None,
                    });
                    gpus.len() - 1
                }
            };
            let gpu = &mut gpus[index];
            gpu.from_topology_file = true;
            if let Some((address, function)) = placement {
                gpu.pci = Some(address);
                gpu.numa = function
                    .as_ref()
                    .and_then(|f| self.resolve_numa(f.raw_numa));
                gpu.pci_device_id = function
                    .as_ref()
                    .and_then(|f| f.device)
                    .and_then(|id| u16::try_from(id).ok());
                gpu.sysfs_path = function.as_ref().map(|f| f.path.display().to_string());
                gpu.pci_path = function.map(|f| f.path);
            }
            if let Some(numa) = entry.numa {
                gpu.numa = numa;
            }
        }
        gpus.sort_by_key(|gpu| (gpu.vendor, gpu.ordinal));
    }

    fn filter_nics(&mut self, nics: &mut Vec<Nic>) {
        let Some(filter) = self.config.nic_filter.as_deref().and_then(NicFilter::parse) else {
            return;
        };
        self.warnings
            .extend(filter.unknown_names(nics.iter().map(|nic| nic.name.as_str())));
        nics.retain(|nic| {
            let keep = filter.keeps(&nic.name);
            if !keep {
                log::debug!("topology: FERRY_NICS removes {}", nic.name);
            }
            keep
        });
        if nics.is_empty() {
            self.warnings.push(
                "FERRY_NICS leaves no NIC: every location's preferred list is empty".to_string(),
            );
        }
    }

    /// Pins by location index, minus NICs that filtering removed.
    fn usable_pins(
        &mut self,
        pins: Vec<(MemoryLocation, Vec<String>)>,
        locations: &[String],
        nics: &[Nic],
    ) -> BTreeMap<usize, Vec<usize>> {
        let mut by_location = BTreeMap::new();
        for (location, names) in pins {
            let location_name = location.to_string();
            let Some(location_index) = locations.iter().position(|name| *name == location_name)
            else {
                self.warnings.push(format!(
                    "topology file pins NICs for {location_name}, which this host does not have"
                ));
                continue;
            };
            let mut indices = Vec::new();
            for name in names {
                match nics.iter().position(|nic| nic.name == name) {
                    Some(index) => indices.push(index),
                    None => self.warnings.push(format!(
                        "topology file pins {name} for {location_name}, but FERRY_NICS or SR-IOV \
                         pruning removed it"
                    )),
                }
            }
            by_location.insert(location_index, indices);
        }
        by_location
    }
}

/// Every name a pin uses must be a NIC in sysfs or in the file.
fn check_pins(file: &TopologyFile, nics: &[Nic]) -> Result<(), TopologyError> {
    for (location, names) in &file.preferred {
        for name in names {
            if !nics.iter().any(|nic| nic.name == *name) {
                let mut known: Vec<&str> = nics.iter().map(|nic| nic.name.as_str()).collect();
                known.sort_by(|a, b| natural_order(a, b));
                return Err(file.invalid(format!(
                    "\"preferred\" for {location} names {name}, which is neither in sysfs nor in \
                     \"nics\" (known NICs: {})",
                    if known.is_empty() {
                        "none".to_string()
                    } else {
                        known.join(", ")
                    }
                )));
            }
        }
    }
    Ok(())
}

/// `classes[location][nic]`, locations being `cpu:N` rows then GPUs.
fn classify_all(numa_nodes: &[NumaNode], gpus: &[Gpu], nics: &[Nic]) -> Vec<Vec<PathClass>> {
    fn placement(nic: &Nic) -> Placement<'_> {
        Placement {
            pci_path: nic.pci_path.as_ref(),
            numa: nic.numa,
        }
    }
    let host_rows = numa_nodes.iter().map(|node| {
        let memory = MemoryNode {
            id: node.id,
            has_cpus: node.has_cpus(),
            nearest_cpu_node: node.nearest_cpu_node,
        };
        nics.iter()
            .map(|nic| classify_host_memory(memory, placement(nic)))
            .collect()
    });
    let gpu_rows = gpus.iter().map(|gpu| {
        let gpu_placement = Placement {
            pci_path: gpu.pci_path.as_ref(),
            numa: gpu.numa,
        };
        nics.iter()
            .map(|nic| classify_devices(gpu_placement, placement(nic)))
            .collect()
    });
    host_rows.chain(gpu_rows).collect()
}
