//! Discovery on this machine's real /sys: it must not fail, and what it finds
//! is printed for a person to check (`cargo test -- --nocapture`).

use std::path::Path;

use ferry_core::topology::{Topology, TopologyConfig};

#[test]
fn real_sysfs_discovers_without_failing() {
    if !Path::new("/sys/bus/pci/devices").is_dir() {
        eprintln!("no /sys/bus/pci on this machine; nothing to check");
        return;
    }
    let topology =
        Topology::discover(&TopologyConfig::for_sysfs_root("/sys")).expect("real /sys is usable");
    println!("{}", topology.render_matrix());
    match serde_json::to_string_pretty(&topology.to_json()) {
        Ok(json) => println!("{json}"),
        Err(error) => panic!("JSON renders: {error}"),
    }
    for warning in topology.warnings() {
        println!("warning: {warning}");
    }
    assert!(!topology.numa_nodes().is_empty());
    assert!(topology.gpus().iter().all(|gpu| gpu.pci.is_some()));
    // Every interface backed by a PCI device is somewhere: a NIC of its own or
    // an RDMA device's netdev (unless it is an SR-IOV VF or a representor).
    let Ok(entries) = std::fs::read_dir("/sys/class/net") else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let device = entry.path().join("device");
        let is_plain_pci = std::fs::canonicalize(&device)
            .map(|target| target.starts_with("/sys/devices/pci") && !device.join("physfn").exists())
            .unwrap_or(false);
        let representor = std::fs::read_to_string(entry.path().join("phys_port_name"))
            .map(|port| port.trim().contains("vf") || port.trim().contains("sf"))
            .unwrap_or(false);
        if is_plain_pci && !representor {
            assert!(
                topology.nic_by_netdev(&name).is_some(),
                "{name} is not in the topology"
            );
        }
    }
}
