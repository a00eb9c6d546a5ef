//! The start-up plan on the topology fixtures, from plugin reports alone:
//! what starts, and each GPU's method under the one NIC rule.

use super::*;
use crate::gpudirect::Method;
use ferry_loader::{Capabilities, DeviceReport, DirOrigin, MemoryMethod, Stage};
use ferry_plugins_abi::sdk::DeviceInfo;
use ferry_plugins_abi::sys;
use ferry_topology::TopologyConfig;
use ferry_topology_fixtures::*;

fn topology(machine: SysfsBuilder) -> (tempfile::TempDir, Topology) {
    let dir = tempfile::tempdir().unwrap();
    machine.write(dir.path()).unwrap();
    let t = Topology::discover(&TopologyConfig::for_sysfs_root(dir.path())).unwrap();
    (dir, t)
}

fn report(name: &str, kind: PluginKind, state: PluginState) -> PluginReport {
    PluginReport {
        name: name.into(),
        kind,
        state,
        stage: Stage::Probed,
        reason: format!("{name}: as the test says"),
        path: format!("/plugins/libferry_{name}.so").into(),
        origin: DirOrigin::Env,
        version: None,
        description: None,
        abi: None,
        capabilities: Capabilities::default(),
        devices: Vec::new(),
        missing: Vec::new(),
        memory_methods: Vec::new(),
        notes: Vec::new(),
        load_us: None,
        probe_us: None,
        probe_source: None,
        shadows: Vec::new(),
    }
}

/// A device plugin whose probe describes every GPU of `t` (driver ordinals
/// in PCI order), each with these attributes.
fn gpus_of(t: &Topology, dmabuf: bool, gdr: bool) -> PluginReport {
    let mut r = report("cuda", PluginKind::Device, PluginState::Enabled);
    r.devices = t
        .gpus()
        .iter()
        .enumerate()
        .map(|(i, g)| DeviceReport {
            name: format!("cuda:{i}"),
            pci: g.pci.map(|p| p.to_string()),
            numa: None,
            detail: None,
            memory: Vec::new(),
            mem_bits: sys::FERRY_MEM_CUDA_STAGED,
            bandwidth_mbps: None,
            latency_ns: None,
            gpu: Some(DeviceInfo {
                ordinal: i as u32,
                name: "Test GPU".into(),
                pci_bus_id: g.pci.map(|p| p.to_string()).unwrap_or_default(),
                uuid: format!("GPU-test-{i}"),
                total_memory: 1 << 34,
                gpu_direct_rdma: Some(gdr),
                dmabuf: Some(dmabuf),
                dmabuf_export: dmabuf,
            }),
        })
        .collect();
    r
}

/// An RDMA-like transport that registers GPU memory by DMA-BUF, or says
/// why it cannot.
fn direct_transport(state: PluginState, dmabuf: Result<&str, &str>) -> PluginReport {
    let mut r = report("vendor-rdma", PluginKind::Transport, state);
    r.memory_methods.push(MemoryMethod {
        kind: sys::FERRY_MEM_CUDA_DMABUF,
        memory: "cuda-dmabuf".into(),
        available: dmabuf.is_ok(),
        detail: dmabuf.unwrap_or_else(|why| why).into(),
    });
    if state == PluginState::Enabled && dmabuf.is_ok() {
        r.capabilities.mem_bits = sys::FERRY_MEM_HOST | sys::FERRY_MEM_CUDA_DMABUF;
    }
    r
}

fn tcp() -> PluginReport {
    let mut r = report("tcp", PluginKind::Transport, PluginState::Enabled);
    r.capabilities.mem_bits = sys::FERRY_MEM_HOST;
    r
}

fn plan_of(reports: &[PluginReport], t: &Topology, policy: Policy) -> HostPlan {
    let refs: Vec<&PluginReport> = reports.iter().collect();
    HostPlan::new(&refs, t, policy)
}

#[test]
fn enabled_plugins_start_in_load_order_and_others_do_not() {
    let (_d, t) = topology(named("dgx-h100").unwrap());
    let reports = [
        tcp(),
        report("shm", PluginKind::Transport, PluginState::Enabled),
        direct_transport(PluginState::Disabled, Err("no RDMA device")),
        report("old-cuda", PluginKind::Device, PluginState::Shadowed),
        gpus_of(&t, true, true),
    ];
    let plan = plan_of(&reports, &t, Policy::Auto);
    assert_eq!(plan.transports, ["tcp", "shm"]);
    assert_eq!(plan.devices, ["cuda"]);
    assert_eq!(plan.gpus.len(), t.gpus().len());
}

#[test]
fn with_a_direct_transport_every_gpu_of_a_dgx_takes_dma_buf_through_its_own_nic() {
    let (_d, t) = topology(named("dgx-h100").unwrap());
    let reports = [
        tcp(),
        direct_transport(PluginState::Enabled, Ok("DMA-BUF registration works")),
        gpus_of(&t, true, true),
    ];
    let plan = plan_of(&reports, &t, Policy::Auto);
    assert_eq!(plan.gpus.len(), 8);
    for g in &plan.gpus {
        assert_eq!(
            g.decision.method,
            Method::DmaBuf,
            "{}",
            g.decision.explain()
        );
        let nic = g.nic.as_ref().expect("a direct NIC");
        let nearest = &t.preferred_nics(&g.topology_name).unwrap()[0];
        assert_eq!(nic.nic, nearest.name, "{}", g.gpu.location);
        assert!(nic.class <= ferry_topology::PathClass::Pxb);
    }
}

#[test]
fn each_gpu_kind_and_policy_gets_its_rung_of_the_ladder() {
    let (_d, t) = topology(named("dgx-h100").unwrap());
    let rdma = || direct_transport(PluginState::Enabled, Ok("works"));
    let cases = [
        (true, true, Policy::Auto, Method::DmaBuf),
        (true, true, Policy::Off, Method::Staged),
        // DMA-BUF refused by the GPU; peermem is not offered by the transport.
        (false, true, Policy::Auto, Method::Staged),
        (false, false, Policy::Auto, Method::Staged),
    ];
    for (dmabuf, gdr, policy, want) in cases {
        let plan = plan_of(&[rdma(), gpus_of(&t, dmabuf, gdr)], &t, policy);
        for g in &plan.gpus {
            assert_eq!(
                g.decision.method,
                want,
                "dmabuf {dmabuf}, gdr {gdr}, {policy:?}: {}",
                g.decision.explain()
            );
        }
    }
}

#[test]
fn without_a_direct_transport_gpus_are_staged_and_say_why() {
    let (_d, t) = topology(named("dgx-h100").unwrap());
    for (reports, why) in [
        (
            vec![tcp(), gpus_of(&t, true, true)],
            "no transport plugin that registers GPU memory",
        ),
        (
            vec![
                tcp(),
                direct_transport(PluginState::Disabled, Err("libibverbs not found")),
                gpus_of(&t, true, true),
            ],
            "the vendor-rdma transport is disabled",
        ),
    ] {
        let plan = plan_of(&reports, &t, Policy::Auto);
        assert!(
            plan.host.no_transport.as_deref().unwrap().contains(why),
            "{:?}",
            plan.host.no_transport
        );
        for g in &plan.gpus {
            assert_eq!(g.decision.method, Method::Staged);
            assert!(
                g.decision.explain().contains(why),
                "{}",
                g.decision.explain()
            );
        }
    }
}

#[test]
fn with_every_rdma_nic_down_there_is_no_direct_nic() {
    let (_d, t) = topology(named("all-rdma-down").unwrap());
    let reports = [
        direct_transport(PluginState::Enabled, Ok("works")),
        gpus_of(&t, true, true),
    ];
    let plan = plan_of(&reports, &t, Policy::Auto);
    assert_eq!(plan.gpus.len(), 1);
    assert_eq!(plan.gpus[0].nic, None);
}

#[test]
fn a_port_down_nic_gives_way_to_the_next_usable_rdma_nic() {
    let (_d, t) = topology(named("port-down").unwrap());
    let reports = [
        direct_transport(PluginState::Enabled, Ok("works")),
        gpus_of(&t, true, true),
    ];
    let plan = plan_of(&reports, &t, Policy::Auto);
    let g = plan.gpu("cuda:0").expect("cuda:0");
    let nic = g.nic.as_ref().expect("a usable RDMA NIC");
    assert_ne!(nic.nic, "mlx5_0");
    assert!(t.nic(&nic.nic).unwrap().state.is_usable());
}

#[test]
fn many_nearer_plain_nics_do_not_hide_the_rdma_nic() {
    let (_d, t) = topology(named("crowded-plain-nics").unwrap());
    let reports = [
        direct_transport(PluginState::Enabled, Ok("works")),
        gpus_of(&t, true, true),
    ];
    let plan = plan_of(&reports, &t, Policy::Auto);
    let g = plan.gpu("cuda:0").expect("cuda:0");
    assert_eq!(g.nic.as_ref().unwrap().nic, "mlx5_0");
    // mlx5_0 sits across the host bridge: too far for GPUDirect.
    assert_eq!(
        g.decision.method,
        Method::Staged,
        "{}",
        g.decision.explain()
    );
}

#[test]
fn every_fixture_plans_one_entry_per_gpu_the_probe_described() {
    for name in NAMES {
        let (_d, t) = topology(named(name).unwrap());
        let reports = [tcp(), gpus_of(&t, true, true)];
        let plan = plan_of(&reports, &t, Policy::Auto);
        assert_eq!(plan.gpus.len(), t.gpus().len(), "{name}");
        for (i, g) in plan.gpus.iter().enumerate() {
            let found = plan
                .gpu(&format!("cuda:{i}"))
                .expect("found by its location");
            assert_eq!(found.gpu.info, g.gpu.info, "{name}");
            assert!(
                t.gpu(&g.topology_name).is_some(),
                "{name}: {}",
                g.topology_name
            );
        }
    }
}
