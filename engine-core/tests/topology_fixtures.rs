//! Topology discovery on every named fixture, with assertions that fail if
//! classification, ranking or spreading is wrong.

use std::path::Path;

use ferry_core::topology::{NicKind, PathClass, Topology, TopologyConfig};
use ferry_topology_fixtures as fixture;

fn discover_named(name: &str) -> (tempfile::TempDir, Topology) {
    let dir = tempfile::tempdir().expect("tempdir");
    fixture::named(name)
        .unwrap_or_else(|| panic!("fixture {name} exists"))
        .write(dir.path())
        .expect("fixture writes");
    let topology = Topology::discover(&TopologyConfig::for_sysfs_root(dir.path()))
        .expect("discovery succeeds");
    (dir, topology)
}

fn first_choice(topology: &Topology, location: &str) -> String {
    topology
        .preferred_nic(location)
        .unwrap_or_else(|| panic!("{location} has a preferred NIC"))
        .name
        .clone()
}

fn preferred_names(topology: &Topology, location: &str) -> Vec<String> {
    topology
        .preferred_nics(location)
        .unwrap_or_else(|| panic!("{location} exists"))
        .iter()
        .map(|ranked| ranked.name.clone())
        .collect()
}

#[test]
fn every_named_fixture_is_described_and_discovers_cleanly() {
    for name in fixture::NAMES {
        assert!(
            fixture::describe(name).is_some(),
            "{name} has a description"
        );
        let (_dir, topology) = discover_named(name);
        assert!(
            topology.warnings().is_empty(),
            "{name}: {:?}",
            topology.warnings()
        );
        let matrix = topology.render_matrix();
        for location in topology.locations() {
            assert!(
                matrix.contains(location),
                "{name}: matrix lacks {location}\n{matrix}"
            );
        }
        for location in topology.locations() {
            let listed = topology
                .preferred_nics(location)
                .expect("location exists")
                .len();
            assert_eq!(
                listed,
                topology.nics().len(),
                "{name}: {location} ranks every NIC"
            );
        }
    }
    assert!(fixture::named("no-such-machine").is_none());
}

#[test]
fn dgx_h100_gives_each_gpu_the_nic_on_its_switch() {
    let (_dir, topology) = discover_named("dgx-h100");
    let expected = [
        ("cuda:0", "0000:1b:00.0", "mlx5_0"),
        ("cuda:1", "0000:43:00.0", "mlx5_3"),
        ("cuda:2", "0000:52:00.0", "mlx5_4"),
        ("cuda:3", "0000:61:00.0", "mlx5_5"),
        ("cuda:4", "0000:9d:00.0", "mlx5_6"),
        ("cuda:5", "0000:c3:00.0", "mlx5_9"),
        ("cuda:6", "0000:d1:00.0", "mlx5_10"),
        ("cuda:7", "0000:df:00.0", "mlx5_11"),
    ];
    // The NVSwitches are NVIDIA devices but not GPUs.
    assert_eq!(topology.gpus().len(), 8);
    for (location, gpu_pci, nic) in expected {
        let gpu = topology.gpu(location).expect("GPU exists");
        assert_eq!(
            gpu.pci.map(|a| a.to_string()).as_deref(),
            Some(gpu_pci),
            "{location}"
        );
        assert_eq!(first_choice(&topology, location), nic, "{location}");
        assert_eq!(
            topology.path_class(location, nic),
            Some(PathClass::Pix),
            "{location}"
        );
    }
    // Another socket's compute NIC is SYS, the same socket's NODE.
    assert_eq!(
        topology.path_class("cuda:0", "mlx5_3"),
        Some(PathClass::Node)
    );
    assert_eq!(
        topology.path_class("cuda:0", "mlx5_6"),
        Some(PathClass::Sys)
    );
    assert_eq!(
        topology.path_class("cuda:4", "mlx5_0"),
        Some(PathClass::Sys)
    );
    // Storage NICs (two dual-function cards) are four NICs, never first.
    let storage = ["mlx5_1", "mlx5_2", "mlx5_7", "mlx5_8"];
    for location in topology.locations() {
        assert!(
            !storage.contains(&first_choice(&topology, location).as_str()),
            "{location}"
        );
    }
    let pci_of = |name: &str| {
        topology
            .nic(name)
            .and_then(|nic| nic.pci)
            .map(|a| a.to_string())
    };
    assert_eq!(pci_of("mlx5_1").as_deref(), Some("0000:29:00.0"));
    assert_eq!(pci_of("mlx5_2").as_deref(), Some("0000:29:00.1"));
    assert_eq!(
        topology.path_class("cuda:0", "mlx5_1"),
        Some(PathClass::Node)
    );
    // Host memory: the socket's NICs are PHB, the fastest first.
    assert_eq!(first_choice(&topology, "cpu:0"), "mlx5_0");
    assert_eq!(first_choice(&topology, "cpu:1"), "mlx5_6");
    assert_eq!(topology.path_class("cpu:0", "mlx5_1"), Some(PathClass::Phb));
    assert_eq!(topology.path_class("cpu:0", "mlx5_6"), Some(PathClass::Sys));

    let mlx5_0 = topology.nic("mlx5_0").expect("mlx5_0");
    assert_eq!(mlx5_0.kind, NicKind::Rdma);
    assert_eq!(mlx5_0.netdevs, ["ibp24s0"]);
    assert_eq!(mlx5_0.numa, Some(0));
    assert_eq!(mlx5_0.speed_mbps, Some(400_000));
    assert_eq!(mlx5_0.link_layer.as_deref(), Some("InfiniBand"));
    assert_eq!(mlx5_0.ports.len(), 1);
    assert_eq!(
        topology
            .nic_by_netdev("enp170s0f1np1")
            .map(|nic| nic.name.as_str()),
        Some("mlx5_8")
    );
    let names: Vec<&str> = topology
        .nics()
        .iter()
        .map(|nic| nic.name.as_str())
        .collect();
    assert_eq!(names.len(), 12);
    assert_eq!(
        names[2..4],
        ["mlx5_2", "mlx5_3"],
        "natural name order: {names:?}"
    );
    assert_eq!(names[11], "mlx5_11");
}

#[test]
fn dgx_h100_json_has_the_documented_shape() {
    let (_dir, topology) = discover_named("dgx-h100");
    let json = topology.to_json();
    for key in [
        "numa_nodes",
        "gpus",
        "nics",
        "paths",
        "preferred",
        "warnings",
    ] {
        assert!(json.get(key).is_some(), "missing {key}");
    }
    assert_eq!(json["numa_nodes"][0]["id"], 0);
    assert_eq!(json["numa_nodes"][0]["cpus"], "0-55,112-167");
    assert_eq!(json["gpus"][0]["name"], "cuda:0");
    assert_eq!(json["gpus"][0]["pci"], "0000:1b:00.0");
    assert_eq!(json["gpus"][0]["numa"], 0);
    let mlx5_0 = json["nics"]
        .as_array()
        .and_then(|nics| nics.iter().find(|nic| nic["name"] == "mlx5_0"))
        .expect("mlx5_0 in JSON");
    assert_eq!(mlx5_0["kind"], "rdma");
    assert_eq!(mlx5_0["pci"], "0000:18:00.0");
    assert_eq!(mlx5_0["numa"], 0);
    assert_eq!(mlx5_0["state"], "active");
    let paths = json["paths"].as_array().expect("paths");
    assert_eq!(paths.len(), (2 + 8) * 12);
    assert!(paths
        .iter()
        .any(|path| path["from"] == "cuda:0" && path["to"] == "mlx5_0" && path["class"] == "PIX"));
    assert_eq!(json["preferred"]["cuda:0"][0], "mlx5_0");
    assert_eq!(
        json["preferred"]["cpu:0"].as_array().map(Vec::len),
        Some(12)
    );
}

#[test]
fn two_nics_for_eight_gpus_follow_the_socket() {
    let (_dir, topology) = discover_named("two-nic-8gpu");
    assert_eq!(topology.gpus().len(), 8);
    assert_eq!(
        topology
            .gpu("cuda:0")
            .and_then(|g| g.pci)
            .map(|a| a.to_string())
            .as_deref(),
        Some("0000:1a:00.0")
    );
    assert_eq!(
        topology
            .gpu("cuda:7")
            .and_then(|g| g.pci)
            .map(|a| a.to_string())
            .as_deref(),
        Some("0000:bc:00.0")
    );
    for ordinal in 0..8 {
        let location = format!("cuda:{ordinal}");
        let (own, other) = if ordinal < 4 {
            ("mlx5_0", "mlx5_1")
        } else {
            ("mlx5_1", "mlx5_0")
        };
        // Spreading must never beat the class: no GPU takes the other socket's NIC.
        assert_eq!(first_choice(&topology, &location), own, "{location}");
        assert_eq!(
            topology.path_class(&location, own),
            Some(PathClass::Node),
            "{location}"
        );
        assert_eq!(
            topology.path_class(&location, other),
            Some(PathClass::Sys),
            "{location}"
        );
    }
    assert_eq!(preferred_names(&topology, "cpu:1"), ["mlx5_1", "mlx5_0"]);
}

#[test]
fn flat_vm_spreads_gpus_over_equally_close_nics() {
    let (_dir, topology) = discover_named("flat-vm");
    assert_eq!(topology.gpus().len(), 2);
    // numa_node -1 on a one-node machine can only mean node 0.
    assert!(topology.gpus().iter().all(|gpu| gpu.numa == Some(0)));
    for location in topology.locations().collect::<Vec<_>>() {
        for nic in topology.nics() {
            assert_eq!(
                topology.path_class(location, &nic.name),
                Some(PathClass::Phb),
                "{location} {}",
                nic.name
            );
        }
    }
    assert_eq!(
        preferred_names(&topology, "cuda:0"),
        ["mlx5_0", "mlx5_1", "eth0"]
    );
    assert_eq!(
        preferred_names(&topology, "cuda:1"),
        ["mlx5_1", "mlx5_0", "eth0"]
    );
    // The virtio interface hangs below virtio0; its PCI function is the parent.
    let eth0 = topology.nic("eth0").expect("eth0");
    assert_eq!(eth0.kind, NicKind::Net);
    assert_eq!(
        eth0.pci.map(|a| a.to_string()).as_deref(),
        Some("0000:00:03.0")
    );
    assert!(topology.nic("lo").is_none());
}

#[test]
fn no_gpu_host_ranks_host_memory_only() {
    let (_dir, topology) = discover_named("no-gpu");
    assert!(topology.gpus().is_empty());
    assert_eq!(topology.locations().collect::<Vec<_>>(), ["cpu:0", "cpu:1"]);
    assert_eq!(
        preferred_names(&topology, "cpu:0"),
        ["mlx5_0", "eno1", "mlx5_1"]
    );
    assert_eq!(
        preferred_names(&topology, "cpu:1"),
        ["mlx5_1", "mlx5_0", "eno1"]
    );
    let eno1 = topology.nic("eno1").expect("eno1");
    assert_eq!(eno1.kind, NicKind::Net);
    assert_eq!(eno1.speed_mbps, Some(10_000));
    assert_eq!(eno1.netdevs, ["eno1"]);
    assert!(topology.preferred_nics("cuda:0").is_none());
}

#[test]
fn a_down_port_is_never_first_even_when_closest() {
    let (_dir, topology) = discover_named("port-down");
    let down = topology.nic("mlx5_0").expect("mlx5_0");
    assert_eq!(down.state.as_str(), "down");
    assert_eq!(
        topology.path_class("cuda:0", "mlx5_0"),
        Some(PathClass::Pix)
    );
    assert_eq!(
        preferred_names(&topology, "cuda:0"),
        ["mlx5_1", "mlx5_2", "mlx5_0"]
    );
    assert_eq!(
        preferred_names(&topology, "cuda:1"),
        ["mlx5_1", "mlx5_2", "mlx5_0"]
    );
    assert_eq!(
        preferred_names(&topology, "cpu:0")
            .last()
            .map(String::as_str),
        Some("mlx5_0")
    );
    let ranked = topology.preferred_nics("cuda:0").expect("cuda:0");
    assert!(ranked[0].usable && !ranked[2].usable);
    assert_eq!(ranked[0].class, PathClass::Phb);
    assert_eq!(ranked[1].class, PathClass::Node);
}

/// Mooncake's heuristic as its topology.cpp has it: among NICs on the GPU's
/// NUMA node (all NICs if none), take those whose realpaths, after the
/// longest common *character* prefix, have the fewest '/' left.
fn slash_counting_choice(root: &Path, gpu_pci: &str, nics: &[(&str, &str)]) -> Vec<String> {
    let realpath = |bdf: &str| {
        std::fs::canonicalize(root.join("bus/pci/devices").join(bdf))
            .expect("realpath")
            .to_string_lossy()
            .into_owned()
    };
    let numa = |bdf: &str| {
        std::fs::read_to_string(root.join("bus/pci/devices").join(bdf).join("numa_node"))
            .expect("numa_node")
            .trim()
            .parse::<i32>()
            .expect("number")
    };
    let distance = |a: &str, b: &str| {
        let common = a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count();
        a[common..].matches('/').count() + b[common..].matches('/').count()
    };
    let gpu_path = realpath(gpu_pci);
    let same_node: Vec<&(&str, &str)> = nics
        .iter()
        .filter(|(_, bdf)| numa(bdf) == numa(gpu_pci))
        .collect();
    let candidates: Vec<&(&str, &str)> = if same_node.is_empty() {
        nics.iter().collect()
    } else {
        same_node
    };
    let best = candidates
        .iter()
        .map(|(_, bdf)| distance(&gpu_path, &realpath(bdf)))
        .min()
        .expect("NICs");
    candidates
        .iter()
        .filter(|(_, bdf)| distance(&gpu_path, &realpath(bdf)) == best)
        .map(|(name, _)| name.to_string())
        .collect()
}

/// GB200-class trays put every GPU and NIC on its own PCI domain. Counting
/// slashes then measures path depth, not distance: the shallow BlueField-3
/// "wins" for every GPU of its socket and the compute NICs are never
/// preferred. Ferry classes all same-socket NICs NODE, prefers the faster
/// RDMA NICs and gives each GPU its own.
#[test]
fn gb200_like_is_where_slash_counting_goes_wrong() {
    let (dir, topology) = discover_named("gb200-like");
    let nics = [
        ("mlx5_0", "0000:03:00.0"),
        ("mlx5_1", "0002:03:00.0"),
        ("mlx5_2", "0006:01:00.0"),
        ("mlx5_3", "0010:03:00.0"),
        ("mlx5_4", "0012:03:00.0"),
        ("mlx5_5", "0016:01:00.0"),
    ];
    let cases = [
        ("cuda:0", "0008:01:00.0", "mlx5_0", "mlx5_2"),
        ("cuda:1", "0009:01:00.0", "mlx5_1", "mlx5_2"),
        ("cuda:2", "0018:01:00.0", "mlx5_3", "mlx5_5"),
        ("cuda:3", "0019:01:00.0", "mlx5_4", "mlx5_5"),
    ];
    for (location, gpu_pci, ferry_choice, slash_choice) in cases {
        assert_eq!(
            topology
                .gpu(location)
                .and_then(|gpu| gpu.pci)
                .map(|a| a.to_string())
                .as_deref(),
            Some(gpu_pci)
        );
        assert_eq!(
            slash_counting_choice(dir.path(), gpu_pci, &nics),
            [slash_choice],
            "{location}"
        );
        assert_eq!(
            first_choice(&topology, location),
            ferry_choice,
            "{location}"
        );
        assert_eq!(
            topology.path_class(location, ferry_choice),
            Some(PathClass::Node)
        );
        assert_eq!(
            topology.path_class(location, slash_choice),
            Some(PathClass::Node)
        );
    }
    assert_eq!(
        topology.path_class("cuda:0", "mlx5_3"),
        Some(PathClass::Sys)
    );
    // GPU-memory NUMA nodes have no CPUs: they borrow the nearest socket's NICs.
    assert_eq!(topology.numa_nodes()[2].nearest_cpu_node, Some(0));
    assert_eq!(topology.numa_nodes()[3].nearest_cpu_node, Some(1));
    assert_eq!(first_choice(&topology, "cpu:2"), "mlx5_0");
    assert_eq!(
        topology.path_class("cpu:2", "mlx5_0"),
        Some(PathClass::Node)
    );
    assert_eq!(topology.path_class("cpu:2", "mlx5_3"), Some(PathClass::Sys));
    assert_eq!(first_choice(&topology, "cpu:3"), "mlx5_3");
}
