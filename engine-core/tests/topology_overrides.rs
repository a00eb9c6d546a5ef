//! What operators set: CUDA_VISIBLE_DEVICES, FERRY_NICS and the topology file.

use std::path::Path;

use ferry_core::topology::{NicKind, PathClass, Topology, TopologyConfig, TopologyError};
use ferry_topology_fixtures::{self as fixture, PciIds};

fn write_named(name: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().expect("tempdir");
    fixture::named(name)
        .expect("fixture exists")
        .write(dir.path())
        .expect("fixture writes");
    dir
}

fn discover(
    root: &Path,
    adjust: impl FnOnce(&mut TopologyConfig),
) -> Result<Topology, TopologyError> {
    let mut config = TopologyConfig::for_sysfs_root(root);
    adjust(&mut config);
    Topology::discover(&config)
}

fn first_choice(topology: &Topology, location: &str) -> String {
    topology
        .preferred_nic(location)
        .expect("location has a NIC")
        .name
        .clone()
}

fn gpu_pcis(topology: &Topology) -> Vec<String> {
    topology
        .gpus()
        .iter()
        .map(|gpu| gpu.pci.map(|a| a.to_string()).unwrap_or_default())
        .collect()
}

/// Writes `content` as a topology file next to the sysfs tree.
fn topology_file(dir: &Path, content: &str) -> std::path::PathBuf {
    let path = dir.join("topology.json");
    std::fs::write(&path, content).expect("write topology file");
    path
}

#[test]
fn cuda_visible_devices_renumbers_gpus() {
    let dir = write_named("dgx-h100");
    let topology =
        discover(dir.path(), |c| c.cuda_visible_devices = Some("0,2".into())).expect("discovers");
    assert_eq!(gpu_pcis(&topology), ["0000:1b:00.0", "0000:52:00.0"]);
    assert_eq!(first_choice(&topology, "cuda:0"), "mlx5_0");
    assert_eq!(first_choice(&topology, "cuda:1"), "mlx5_4");
    assert!(topology.gpu("cuda:2").is_none());

    let reversed =
        discover(dir.path(), |c| c.cuda_visible_devices = Some("7,0".into())).expect("discovers");
    assert_eq!(gpu_pcis(&reversed), ["0000:df:00.0", "0000:1b:00.0"]);
    assert_eq!(first_choice(&reversed, "cuda:0"), "mlx5_11");

    for hidden in ["", "-1"] {
        let none = discover(dir.path(), |c| c.cuda_visible_devices = Some(hidden.into()))
            .expect("discovers");
        assert!(none.gpus().is_empty(), "{hidden:?}");
        assert!(
            none.warnings().is_empty(),
            "{hidden:?}: {:?}",
            none.warnings()
        );
    }

    let stopped = discover(dir.path(), |c| {
        c.cuda_visible_devices = Some("3,9,1".into())
    })
    .expect("discovers");
    assert_eq!(gpu_pcis(&stopped), ["0000:61:00.0"]);
    assert!(
        stopped.warnings().iter().any(|w| w.contains("\"9\"")),
        "{:?}",
        stopped.warnings()
    );

    let uuid = "GPU-5f3c1d2e-aaaa-bbbb-cccc-0123456789ab";
    let by_uuid =
        discover(dir.path(), |c| c.cuda_visible_devices = Some(uuid.into())).expect("discovers");
    assert_eq!(by_uuid.gpus().len(), 8);
    assert!(
        by_uuid.warnings().iter().any(|w| w.contains(uuid)),
        "{:?}",
        by_uuid.warnings()
    );
}

#[test]
fn ferry_nics_allows_and_denies() {
    let dir = write_named("dgx-h100");
    let allowed = discover(dir.path(), |c| {
        c.nic_filter = Some("mlx5_0,mlx5_3,mlx5_99".into())
    })
    .expect("discovers");
    let names: Vec<&str> = allowed.nics().iter().map(|nic| nic.name.as_str()).collect();
    assert_eq!(names, ["mlx5_0", "mlx5_3"]);
    assert!(
        allowed.warnings().iter().any(|w| w.contains("mlx5_99")),
        "{:?}",
        allowed.warnings()
    );
    assert_eq!(first_choice(&allowed, "cuda:1"), "mlx5_3");

    let denied =
        discover(dir.path(), |c| c.nic_filter = Some("^mlx5_0".into())).expect("discovers");
    assert!(denied.nic("mlx5_0").is_none());
    assert_eq!(denied.nics().len(), 11);
    // cuda:0 loses its PIX NIC and falls back to a NODE compute NIC on its socket.
    assert_eq!(first_choice(&denied, "cuda:0"), "mlx5_3");
    assert_eq!(
        denied.preferred_nic("cuda:0").map(|n| n.class),
        Some(PathClass::Node)
    );

    let nothing = discover(dir.path(), |c| c.nic_filter = Some("eth7".into())).expect("discovers");
    assert!(nothing.nics().is_empty());
    assert_eq!(nothing.preferred_nics("cuda:0").map(<[_]>::len), Some(0));
    assert!(nothing.render_matrix().contains("no NIC"));
}

#[test]
fn topology_file_pins_a_location() {
    let dir = write_named("dgx-h100");
    let file = topology_file(
        dir.path(),
        r#"{"preferred": {"cuda:0": ["mlx5_6", "mlx5_7"], "cuda:9": ["mlx5_0"]}}"#,
    );
    let topology = discover(dir.path(), |c| c.topology_file = Some(file)).expect("discovers");
    let ranked = topology.preferred_nics("cuda:0").expect("cuda:0");
    let names: Vec<&str> = ranked.iter().map(|nic| nic.name.as_str()).collect();
    assert_eq!(names[..3], ["mlx5_6", "mlx5_7", "mlx5_0"]);
    assert!(ranked[0].pinned && ranked[1].pinned && !ranked[2].pinned);
    assert_eq!(ranked[0].class, PathClass::Sys);
    // Other locations keep the computed order.
    assert_eq!(first_choice(&topology, "cuda:1"), "mlx5_3");
    assert!(
        topology.warnings().iter().any(|w| w.contains("cuda:9")),
        "{:?}",
        topology.warnings()
    );
}

#[test]
fn topology_file_cannot_make_a_down_port_first() {
    let dir = write_named("port-down");
    let file = topology_file(
        dir.path(),
        r#"{"preferred": {"cuda:0": ["mlx5_0", "mlx5_2"]}}"#,
    );
    let topology = discover(dir.path(), |c| c.topology_file = Some(file)).expect("discovers");
    let names: Vec<String> = topology
        .preferred_nics("cuda:0")
        .expect("cuda:0")
        .iter()
        .map(|n| n.name.clone())
        .collect();
    assert_eq!(names, ["mlx5_2", "mlx5_1", "mlx5_0"]);
    assert!(topology
        .warnings()
        .iter()
        .any(|w| w.contains("mlx5_0") && w.contains("down")));
}

#[test]
fn topology_file_adds_and_corrects_what_sysfs_cannot_show() {
    let dir = tempfile::tempdir().expect("tempdir");
    // A NIC bound to vfio-pci: a PCI function on cuda:0's switch, no netdev, no RDMA device.
    fixture::named("port-down")
        .expect("fixture exists")
        .pci_device(
            "0000:00:01.0/0000:01:00.0/0000:02:02.0/0000:09:00.0",
            PciIds::INTEL_X710,
        )
        .write(dir.path())
        .expect("fixture writes");
    let file = topology_file(
        dir.path(),
        r#"{
          "nics": [
            {"name": "dpdk0", "kind": "net", "pci": "0000:09:00.0", "state": "active", "speed_mbps": 100000},
            {"name": "efa0", "kind": "rdma", "numa": 0},
            {"name": "mlx5_2", "state": "down"}
          ],
          "gpus": [{"name": "cuda:1", "numa": 0}, {"name": "cuda:5", "pci": "0000:07:00.0"}]
        }"#,
    );
    let topology = discover(dir.path(), |c| c.topology_file = Some(file)).expect("discovers");
    let dpdk = topology.nic("dpdk0").expect("dpdk0 added");
    assert_eq!(dpdk.kind, NicKind::Net);
    assert!(dpdk.from_topology_file);
    assert_eq!(
        dpdk.numa,
        Some(0),
        "NUMA comes from sysfs when the file gives a PCI address"
    );
    // Placed in the PCI tree, it gets a real class: same switch as cuda:0.
    assert_eq!(topology.path_class("cuda:0", "dpdk0"), Some(PathClass::Pix));
    assert_eq!(topology.path_class("cuda:1", "dpdk0"), Some(PathClass::Phb));
    // Without a PCI address only NUMA places it.
    assert_eq!(topology.path_class("cuda:0", "efa0"), Some(PathClass::Node));
    assert_eq!(
        topology.nic("mlx5_2").map(|n| n.state.as_str()),
        Some("down")
    );
    // A GPU added by the file sits where its PCI address is.
    assert_eq!(
        topology.path_class("cuda:5", "mlx5_1"),
        Some(PathClass::Pix)
    );
    assert!(topology
        .gpu("cuda:1")
        .is_some_and(|gpu| gpu.from_topology_file));
}

#[test]
fn topology_file_numa_changes_classes() {
    let dir = write_named("two-nic-8gpu");
    let file = topology_file(dir.path(), r#"{"gpus": [{"name": "cuda:0", "numa": 1}]}"#);
    let topology = discover(dir.path(), |c| c.topology_file = Some(file)).expect("discovers");
    assert_eq!(
        topology.path_class("cuda:0", "mlx5_0"),
        Some(PathClass::Sys)
    );
    assert_eq!(first_choice(&topology, "cuda:0"), "mlx5_1");
}

#[test]
fn bad_topology_files_are_clear_errors() {
    let dir = write_named("flat-vm");
    let cases = [
        (
            "{\n  \"nics\": [\n    {\"name\": \"x\", \"numa\": \"zero\"}\n  ]\n}",
            "line 3",
        ),
        ("{\"preferred\": {\"cuda:0\": [\"mlx5_7\"]}}", "mlx5_7"),
        ("{\"nics\": [{\"name\": \"ghost0\"}]}", "kind"),
        ("{\"preferred\": ", "line 1"),
        ("[]", "line 1"),
    ];
    for (content, needle) in cases {
        let file = topology_file(dir.path(), content);
        let error = discover(dir.path(), |c| c.topology_file = Some(file.clone()))
            .expect_err(content)
            .to_string();
        assert!(
            error.contains(&file.display().to_string()),
            "{content}: {error}"
        );
        assert!(error.contains(needle), "{content}: {error}");
    }
    let missing = dir.path().join("nope.json");
    let error =
        discover(dir.path(), |c| c.topology_file = Some(missing.clone())).expect_err("missing");
    assert!(matches!(
        error,
        TopologyError::TopologyFileUnreadable { .. }
    ));
    assert!(error.to_string().contains(&missing.display().to_string()));
}

#[test]
fn pins_may_name_nics_the_file_adds_or_filtering_removes() {
    let dir = write_named("flat-vm");
    let file = topology_file(
        dir.path(),
        r#"{"nics": [{"name": "ib9", "kind": "rdma", "numa": 0}], "preferred": {"cuda:1": ["ib9", "mlx5_0"]}}"#,
    );
    let topology = discover(dir.path(), |c| {
        c.topology_file = Some(file);
        c.nic_filter = Some("^mlx5_0".into());
    })
    .expect("discovers");
    assert_eq!(first_choice(&topology, "cuda:1"), "ib9");
    assert!(
        topology.warnings().iter().any(|w| w.contains("mlx5_0")),
        "{:?}",
        topology.warnings()
    );
}
