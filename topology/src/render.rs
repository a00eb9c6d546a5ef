//! The two ways a topology is shown: JSON for programs (`ferry topology
//! --json`) and a matrix for people, laid out like `nvidia-smi topo -m`.

use serde_json::{json, Map, Value};

use super::class::PathClass;
use super::Topology;

impl Topology {
    /// The topology as JSON:
    ///
    /// ```json
    /// {"numa_nodes": [{"id": 0, "cpus": "0-55"}],
    ///  "gpus": [{"name": "cuda:0", "pci": "0000:18:00.0", "numa": 0, ...}],
    ///  "nics": [{"name": "mlx5_0", "kind": "rdma", "pci": "0000:19:00.0", "numa": 0,
    ///            "state": "active", ...}],
    ///  "paths": [{"from": "cuda:0", "to": "mlx5_0", "class": "PIX"}],
    ///  "preferred": {"cuda:0": ["mlx5_0", "mlx5_3"], "cpu:0": ["mlx5_0"]},
    ///  "warnings": [], "sysfs_root": "/sys"}
    /// ```
    ///
    /// Unknown values: `"numa": -1` (as sysfs writes it), `"pci": null`.
    /// Each `preferred` list is best first and holds every NIC.
    pub fn to_json(&self) -> Value {
        let numa = |node: Option<u32>| node.map_or(json!(-1), |id| json!(id));
        let pci = |address: Option<super::PciAddress>| {
            address.map_or(Value::Null, |a| json!(a.to_string()))
        };
        let numa_nodes: Vec<Value> = self
            .numa_nodes
            .iter()
            .map(|node| json!({"id": node.id, "cpus": node.cpus, "nearest_cpu_node": node.nearest_cpu_node}))
            .collect();
        let gpus: Vec<Value> = self
            .gpus
            .iter()
            .map(|gpu| {
                json!({
                    "name": gpu.name,
                    "ordinal": gpu.ordinal,
                    "vendor": gpu.vendor.as_str(),
                    "pci": pci(gpu.pci),
                    "pci_device_id": gpu.pci_device_id.map(|id| format!("0x{id:04x}")),
                    "numa": numa(gpu.numa),
                    "sysfs_path": gpu.sysfs_path,
                    "from_topology_file": gpu.from_topology_file,
                })
            })
            .collect();
        let nics: Vec<Value> = self
            .nics
            .iter()
            .map(|nic| {
                let ports: Vec<Value> = nic
                    .ports
                    .iter()
                    .map(|port| {
                        json!({
                            "port": port.number,
                            "state": port.state.as_str(),
                            "link_layer": port.link_layer,
                            "rate": port.rate,
                            "speed_mbps": port.speed_mbps,
                        })
                    })
                    .collect();
                json!({
                    "name": nic.name,
                    "kind": nic.kind.as_str(),
                    "pci": pci(nic.pci),
                    "numa": numa(nic.numa),
                    "state": nic.state.as_str(),
                    "link_layer": nic.link_layer,
                    "speed_mbps": nic.speed_mbps,
                    "netdevs": nic.netdevs,
                    "ports": ports,
                    "physical_function": pci(nic.physical_function),
                    "sysfs_path": nic.sysfs_path,
                    "from_topology_file": nic.from_topology_file,
                })
            })
            .collect();
        let mut paths = Vec::new();
        let mut preferred = Map::new();
        for (row, location) in self.locations.iter().enumerate() {
            for (column, nic) in self.nics.iter().enumerate() {
                let class = self.classes[row][column];
                paths.push(json!({"from": location, "to": nic.name, "class": class.as_str()}));
            }
            let names: Vec<&str> = self.preferred[row]
                .iter()
                .map(|ranked| ranked.name.as_str())
                .collect();
            preferred.insert(location.clone(), json!(names));
        }
        json!({
            "sysfs_root": self.sysfs_root.display().to_string(),
            "numa_nodes": numa_nodes,
            "gpus": gpus,
            "nics": nics,
            "paths": paths,
            "preferred": preferred,
            "warnings": self.warnings,
        })
    }

    /// A table like `nvidia-smi topo -m`: memory locations as rows, NICs as
    /// columns, the class in each cell, the NUMA node and the chosen NIC last,
    /// then a legend and one line per NIC and GPU.
    pub fn render_matrix(&self) -> String {
        let mut header = vec![String::new()];
        header.extend(self.nics.iter().map(|nic| nic.name.clone()));
        header.push("NUMA".to_string());
        header.push("Chosen NIC".to_string());
        let mut rows = vec![header];
        for (row, location) in self.locations.iter().enumerate() {
            let mut cells = vec![location.clone()];
            cells.extend(
                self.classes[row]
                    .iter()
                    .map(|class| class.as_str().to_string()),
            );
            cells.push(
                self.location_numa(location)
                    .map_or("-".to_string(), |id| id.to_string()),
            );
            cells.push(
                self.preferred[row]
                    .first()
                    .map_or("-".to_string(), |best| best.name.clone()),
            );
            rows.push(cells);
        }
        let columns = rows[0].len();
        let widths: Vec<usize> = (0..columns)
            .map(|column| {
                rows.iter()
                    .map(|cells| cells[column].len())
                    .max()
                    .unwrap_or(0)
            })
            .collect();
        let mut out = String::new();
        for cells in &rows {
            let line: Vec<String> = cells
                .iter()
                .zip(&widths)
                .map(|(cell, width)| format!("{cell:<width$}"))
                .collect();
            out.push_str(line.join("  ").trim_end());
            out.push('\n');
        }
        if self.nics.is_empty() {
            out.push_str("\n(no NIC found)\n");
        }
        out.push_str("\nLegend:\n");
        for class in PathClass::ALL {
            out.push_str(&format!(
                "  {:<7} = {}\n",
                class.as_str(),
                class.description()
            ));
        }
        out.push_str("  Chosen NIC = first of the location's preferred list; down NICs are never chosen first\n");
        if !self.nics.is_empty() {
            out.push_str("\nNICs:\n");
        }
        for nic in &self.nics {
            let mut details = vec![
                nic.kind.as_str().to_string(),
                nic.pci
                    .map_or("pci ?".to_string(), |address| address.to_string()),
                format!(
                    "numa {}",
                    nic.numa.map_or("?".to_string(), |id| id.to_string())
                ),
                nic.state.as_str().to_string(),
            ];
            if let Some(link_layer) = &nic.link_layer {
                details.push(link_layer.clone());
            }
            if let Some(speed) = nic.speed_mbps {
                details.push(format!("{} Gb/s", speed as f64 / 1000.0));
            }
            if !nic.netdevs.is_empty() && nic.netdevs != [nic.name.clone()] {
                details.push(format!("netdevs {}", nic.netdevs.join(",")));
            }
            if let Some(pf) = nic.physical_function {
                details.push(format!("VF of {pf}"));
            }
            out.push_str(&format!("  {:<12} {}\n", nic.name, details.join("  ")));
        }
        if !self.gpus.is_empty() {
            out.push_str("\nGPUs:\n");
        }
        for gpu in &self.gpus {
            out.push_str(&format!(
                "  {:<12} {}  {}  numa {}\n",
                gpu.name,
                gpu.vendor.as_str(),
                gpu.pci
                    .map_or("pci ?".to_string(), |address| address.to_string()),
                gpu.numa.map_or("?".to_string(), |id| id.to_string())
            ));
        }
        out
    }

    fn location_numa(&self, location: &str) -> Option<u32> {
        match location.parse::<super::MemoryLocation>() {
            Ok(super::MemoryLocation::Cpu(node)) => Some(node),
            _ => self.gpu(location).and_then(|gpu| gpu.numa),
        }
    }
}
