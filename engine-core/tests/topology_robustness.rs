//! Discovery on hostile or unusual trees: links leaving the root, garbage
//! attributes, empty roots, VFs, multi-port and software RDMA devices,
//! unknown NUMA on multi-node machines, mixed GPU vendors.

use std::fs;
use std::os::unix::fs::symlink;
use std::path::Path;

use ferry_core::topology::{NicKind, PathClass, Topology, TopologyConfig, TopologyError};
use ferry_topology_fixtures::{
    self as fixture, PciIds, SysfsBuilder, EDR_100, ETHERNET, HDR_200, INFINIBAND, PORT_ACTIVE,
    PORT_DOWN,
};

fn discover(root: &Path) -> Topology {
    Topology::discover(&TopologyConfig::for_sysfs_root(root)).expect("discovery succeeds")
}

fn write(builder: SysfsBuilder) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    builder.write(dir.path()).expect("fixture writes");
    dir
}

fn nic_names(topology: &Topology) -> Vec<&str> {
    topology
        .nics()
        .iter()
        .map(|nic| nic.name.as_str())
        .collect()
}

#[test]
fn links_leaving_the_root_are_ignored_with_a_warning() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().join("sys");
    fixture::named("flat-vm")
        .expect("fixture")
        .write(&root)
        .expect("writes");
    // A GPU-looking PCI function outside the root.
    let outside = dir.path().join("outside/0000:99:00.0");
    fs::create_dir_all(&outside).expect("mkdir");
    for (attribute, value) in [
        ("vendor", "0x10de"),
        ("device", "0x2330"),
        ("class", "0x030200"),
        ("numa_node", "0"),
    ] {
        fs::write(outside.join(attribute), value).expect("write");
    }
    symlink(
        "../../../../outside/0000:99:00.0",
        root.join("bus/pci/devices/0000:99:00.0"),
    )
    .expect("symlink");
    // An RDMA device whose `device` leaves the root, and one whose class link does.
    fs::create_dir_all(root.join("class/infiniband/evil0")).expect("mkdir");
    symlink(
        "../../../../outside/0000:99:00.0",
        root.join("class/infiniband/evil0/device"),
    )
    .expect("symlink");
    symlink("../../../outside", root.join("class/infiniband/evil1")).expect("symlink");
    symlink(
        "../../../outside/0000:99:00.0",
        root.join("class/net/evil2"),
    )
    .expect("symlink");

    let topology = discover(&root);
    assert_eq!(
        topology.gpus().len(),
        2,
        "the outside GPU is not discovered"
    );
    for evil in ["evil0", "evil1", "evil2"] {
        assert!(topology.nic(evil).is_none(), "{evil}");
    }
    for link in [
        "bus/pci/devices/0000:99:00.0",
        "class/infiniband/evil0/device",
        "class/infiniband/evil1",
        "class/net/evil2",
    ] {
        assert!(
            topology
                .warnings()
                .iter()
                .any(|w| w.contains(link) && w.contains("outside the sysfs root")),
            "{link}: {:?}",
            topology.warnings()
        );
    }
}

#[test]
fn garbage_attributes_degrade_instead_of_failing() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    fixture::named("dgx-h100")
        .expect("fixture")
        .write(root)
        .expect("writes");
    let gpu1 = root.join("bus/pci/devices/0000:43:00.0");
    let gpu2 = root.join("bus/pci/devices/0000:52:00.0");
    let mlx5_0_port = root.join("class/infiniband/mlx5_0/ports/1");
    fs::write(gpu1.join("class"), "0xZZ\n").expect("write");
    fs::write(gpu2.join("numa_node"), "banana").expect("write");
    fs::write(mlx5_0_port.join("state"), [0u8, 1, 2, 0xff]).expect("write");
    fs::write(mlx5_0_port.join("rate"), "NaN Gb/sec").expect("write");
    fs::write(
        root.join("devices/system/node/node0/cpulist"),
        "x".repeat(100_000),
    )
    .expect("write");
    fs::remove_file(root.join("bus/pci/devices/0000:61:00.0/vendor")).expect("remove");
    fs::create_dir(root.join("bus/pci/devices/0000:61:00.0/vendor")).expect("mkdir");
    fs::create_dir_all(root.join("class/infiniband/mlx5_3/ports/not-a-number")).expect("mkdir");
    fs::write(root.join("bus/pci/devices/not-a-bdf"), "").expect("write");
    symlink("loop", root.join("class/net/loop")).expect("symlink");

    let topology = discover(root);
    let pcis: Vec<String> = topology
        .gpus()
        .iter()
        .filter_map(|gpu| gpu.pci)
        .map(|a| a.to_string())
        .collect();
    assert!(
        !pcis.contains(&"0000:43:00.0".to_string()),
        "garbage class is not a GPU"
    );
    assert!(
        !pcis.contains(&"0000:61:00.0".to_string()),
        "unreadable vendor is not a GPU"
    );
    assert!(pcis.contains(&"0000:52:00.0".to_string()));
    let gpu_with_bad_numa = topology
        .gpus()
        .iter()
        .find(|gpu| gpu.pci.map(|a| a.to_string()) == Some("0000:52:00.0".into()));
    assert_eq!(gpu_with_bad_numa.and_then(|gpu| gpu.numa), None);
    let mlx5_0 = topology.nic("mlx5_0").expect("mlx5_0 still there");
    assert_eq!(mlx5_0.state.as_str(), "unknown");
    assert_eq!(mlx5_0.speed_mbps, None);
    assert_eq!(topology.nic("mlx5_3").map(|nic| nic.ports.len()), Some(1));
    assert_eq!(
        topology.numa_nodes()[0].cpus,
        "",
        "an oversized attribute reads as absent"
    );
    let _ = topology.render_matrix();
    let _ = topology.to_json();
}

#[test]
fn an_empty_root_is_not_an_error_but_a_missing_one_is() {
    let dir = tempfile::tempdir().expect("tempdir");
    let topology = discover(dir.path());
    assert!(topology.gpus().is_empty() && topology.nics().is_empty());
    assert_eq!(topology.locations().collect::<Vec<_>>(), ["cpu:0"]);
    assert!(
        topology.warnings().iter().any(|w| w.contains("NUMA")),
        "{:?}",
        topology.warnings()
    );

    let missing = dir.path().join("no-such-sysfs");
    let error =
        Topology::discover(&TopologyConfig::for_sysfs_root(&missing)).expect_err("missing root");
    assert!(matches!(error, TopologyError::UnusableSysfsRoot { .. }));
    let message = error.to_string();
    assert!(
        message.contains(&missing.display().to_string()) && message.contains("FERRY_SYSFS_ROOT"),
        "{message}"
    );

    let file = dir.path().join("a-file");
    fs::write(&file, "").expect("write");
    assert!(Topology::discover(&TopologyConfig::for_sysfs_root(&file)).is_err());
}

#[test]
fn unknown_numa_on_a_multi_node_machine_is_never_sys() {
    let dir = write(
        SysfsBuilder::new()
            .numa_node(0, "0-3")
            .numa_node(1, "4-7")
            .host_bridge("0000:00", -1)
            .host_bridge("0000:80", -1)
            .gpu("0000:00:02.0/0000:01:00.0")
            .rdma_nic(
                "mlx5_0",
                "0000:80:02.0/0000:81:00.0",
                PORT_ACTIVE,
                INFINIBAND,
                HDR_200,
            )
            .rdma_nic(
                "mlx5_1",
                "0000:00:03.0/0000:02:00.0",
                PORT_ACTIVE,
                INFINIBAND,
                HDR_200,
            ),
    );
    let topology = discover(dir.path());
    assert_eq!(topology.gpu("cuda:0").and_then(|gpu| gpu.numa), None);
    assert_eq!(topology.nic("mlx5_0").and_then(|nic| nic.numa), None);
    assert_eq!(
        topology.path_class("cuda:0", "mlx5_0"),
        Some(PathClass::Node)
    );
    assert_eq!(
        topology.path_class("cuda:0", "mlx5_1"),
        Some(PathClass::Phb)
    );
    for location in ["cpu:0", "cpu:1"] {
        assert_eq!(
            topology.path_class(location, "mlx5_0"),
            Some(PathClass::Phb),
            "{location}"
        );
    }
    assert!(!topology.to_json()["paths"]
        .as_array()
        .expect("paths")
        .iter()
        .any(|path| path["class"] == "SYS"));
    assert_eq!(topology.to_json()["gpus"][0]["numa"], -1);
}

#[test]
fn multi_port_rdma_device_is_one_nic_with_its_best_port() {
    let dir = write(
        SysfsBuilder::new()
            .numa_node(0, "0-7")
            .host_bridge("0000:00", 0)
            .rdma_nic(
                "mlx4_0",
                "0000:00:02.0/0000:03:00.0",
                PORT_DOWN,
                INFINIBAND,
                "40 Gb/sec (4X QDR)",
            )
            .rdma_port("mlx4_0", 2, PORT_ACTIVE, ETHERNET, "10 Gb/sec (1X QDR)")
            .netdev("eth1", "0000:03:00.0")
            .netdev("eth2", "0000:03:00.0"),
    );
    let topology = discover(dir.path());
    assert_eq!(nic_names(&topology), ["mlx4_0"]);
    let nic = topology.nic("mlx4_0").expect("mlx4_0");
    assert_eq!(nic.ports.len(), 2);
    assert_eq!(nic.state.as_str(), "active");
    assert_eq!(nic.link_layer.as_deref(), Some("Ethernet"));
    assert_eq!(nic.speed_mbps, Some(10_000));
    assert_eq!(nic.best_port().map(|port| port.number), Some(2));
    assert_eq!(nic.netdevs, ["eth1", "eth2"]);
}

#[test]
fn virtual_functions_are_dropped_only_when_their_pf_is_listed() {
    let host = SysfsBuilder::new()
        .numa_node(0, "0-7")
        .host_bridge("0000:3a", 0)
        .rdma_nic(
            "mlx5_0",
            "0000:3a:00.0/0000:3b:00.0",
            PORT_ACTIVE,
            ETHERNET,
            EDR_100,
        )
        .pci_device("0000:3a:00.0/0000:3b:00.2", PciIds::CONNECTX7_VF)
        .rdma_device("mlx5_2", "0000:3b:00.2", PORT_ACTIVE, ETHERNET, EDR_100)
        .virtual_function("0000:3b:00.2", "0000:3b:00.0")
        .representor("pf0vf0", "0000:3b:00.0", "pf0vf0")
        .netdev("enp59s0f0np0", "0000:3b:00.0");
    let dir = write(host.clone());
    let topology = discover(dir.path());
    assert_eq!(nic_names(&topology), ["mlx5_0"]);
    assert_eq!(
        topology.nic("mlx5_0").map(|nic| nic.netdevs.clone()),
        Some(vec!["enp59s0f0np0".to_string()])
    );

    let both = Topology::discover(&TopologyConfig {
        nic_filter: Some("mlx5_0,mlx5_2".into()),
        ..TopologyConfig::for_sysfs_root(dir.path())
    })
    .expect("discovers");
    assert_eq!(nic_names(&both), ["mlx5_0", "mlx5_2"]);
    assert_eq!(
        both.nic("mlx5_2")
            .and_then(|nic| nic.physical_function)
            .map(|a| a.to_string())
            .as_deref(),
        Some("0000:3b:00.0")
    );

    // The PF without an RDMA device (bound to vfio-pci, say): the VF is the NIC.
    let vf_only = write(
        SysfsBuilder::new()
            .numa_node(0, "0-7")
            .host_bridge("0000:3a", 0)
            .pci_device("0000:3a:00.0/0000:3b:00.0", PciIds::CONNECTX7_ETH)
            .pci_device("0000:3a:00.0/0000:3b:00.2", PciIds::CONNECTX7_VF)
            .rdma_device("mlx5_2", "0000:3b:00.2", PORT_ACTIVE, ETHERNET, EDR_100)
            .virtual_function("0000:3b:00.2", "0000:3b:00.0"),
    );
    let topology = discover(vf_only.path());
    assert_eq!(nic_names(&topology), ["mlx5_2"]);
    assert!(topology
        .nic("mlx5_2")
        .is_some_and(|nic| nic.is_virtual_function()));
}

#[test]
fn software_rdma_sits_where_its_netdev_sits() {
    let dir = write(
        SysfsBuilder::new()
            .numa_node(0, "0-1")
            .host_bridge("0000:00", -1)
            .virtio_net("eth0", "0000:00:03.0", 2)
            .soft_rdma("rxe0", "eth0", "10 Gb/sec (1X QDR)"),
    );
    let topology = discover(dir.path());
    assert_eq!(nic_names(&topology), ["rxe0"]);
    let rxe = topology.nic("rxe0").expect("rxe0");
    assert_eq!(rxe.kind, NicKind::Rdma);
    assert_eq!(
        rxe.pci.map(|a| a.to_string()).as_deref(),
        Some("0000:00:03.0")
    );
    assert_eq!(rxe.netdevs, ["eth0"]);
    assert_eq!(
        topology.nic_by_netdev("eth0").map(|nic| nic.name.as_str()),
        Some("rxe0")
    );
    assert_eq!(topology.path_class("cpu:0", "rxe0"), Some(PathClass::Phb));
}

#[test]
fn amd_gpus_do_not_shift_cuda_ordinals() {
    let dir = write(
        SysfsBuilder::new()
            .numa_node(0, "0-7")
            .host_bridge("0000:00", 0)
            .pci_device("0000:00:01.0/0000:01:00.0", PciIds::AMD_MI300X)
            .pci_device("0000:00:02.0/0000:02:00.0", PciIds::NVIDIA_A100)
            .gpu("0000:00:03.0/0000:03:00.0")
            .rdma_nic(
                "mlx5_0",
                "0000:00:04.0/0000:04:00.0",
                PORT_ACTIVE,
                INFINIBAND,
                HDR_200,
            ),
    );
    let topology = discover(dir.path());
    let names: Vec<&str> = topology
        .gpus()
        .iter()
        .map(|gpu| gpu.name.as_str())
        .collect();
    assert_eq!(names, ["cuda:0", "cuda:1", "rocm:0"]);
    assert_eq!(
        topology
            .gpu("cuda:0")
            .and_then(|g| g.pci)
            .map(|a| a.to_string())
            .as_deref(),
        Some("0000:02:00.0")
    );
    assert_eq!(
        topology
            .gpu("rocm:0")
            .and_then(|g| g.pci)
            .map(|a| a.to_string())
            .as_deref(),
        Some("0000:01:00.0")
    );
    // Two NVIDIA models: PCI order is only CUDA's order with CUDA_DEVICE_ORDER=PCI_BUS_ID.
    assert!(
        topology
            .warnings()
            .iter()
            .any(|w| w.contains("CUDA_DEVICE_ORDER")),
        "{:?}",
        topology.warnings()
    );
    assert_eq!(
        topology
            .preferred_nic("rocm:0")
            .map(|nic| nic.name.as_str()),
        Some("mlx5_0")
    );
    let by_pci = "00000000:02:00.0".parse().expect("CUDA-style bus id");
    assert_eq!(
        topology.gpu_by_pci(&by_pci).map(|gpu| gpu.name.as_str()),
        Some("cuda:0")
    );
}

#[test]
fn gpus_sharing_tied_nics_take_them_round_robin() {
    let dir = write(
        SysfsBuilder::new()
            .numa_node(0, "0-15")
            .host_bridge("0000:00", 0)
            .gpu("0000:00:04.0")
            .gpu("0000:00:05.0")
            .gpu("0000:00:06.0")
            .gpu("0000:00:07.0")
            .gpu("0000:00:08.0")
            .rdma_nic("mlx5_0", "0000:00:10.0", PORT_ACTIVE, INFINIBAND, HDR_200)
            .rdma_nic("mlx5_1", "0000:00:11.0", PORT_ACTIVE, INFINIBAND, HDR_200)
            .rdma_nic("mlx5_2", "0000:00:12.0", PORT_ACTIVE, INFINIBAND, HDR_200)
            .net_nic("eno1", "0000:00:13.0", "up", 1_000),
    );
    let topology = discover(dir.path());
    let firsts: Vec<String> = (0..5)
        .map(|ordinal| {
            let location = format!("cuda:{ordinal}");
            topology
                .preferred_nic(&location)
                .expect("has a NIC")
                .name
                .clone()
        })
        .collect();
    assert_eq!(firsts, ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_0", "mlx5_1"]);
    // The rest of the tied NICs follow cyclically, then the slower net NIC.
    let cuda2: Vec<&str> = topology
        .preferred_nics("cuda:2")
        .expect("cuda:2")
        .iter()
        .map(|nic| nic.name.as_str())
        .collect();
    assert_eq!(cuda2, ["mlx5_2", "mlx5_0", "mlx5_1", "eno1"]);
    // Host memory is not spread: one row per node.
    assert_eq!(
        topology.preferred_nic("cpu:0").map(|nic| nic.name.as_str()),
        Some("mlx5_0")
    );
}
