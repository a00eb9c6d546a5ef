//! What `ferry info` says about GPUs: with no driver (the cuda plugin
//! disabled with its reason, ordinals guessed from PCI order) and with a
//! driver (the fake GPU plugin standing in for cuda), whose ordinals and
//! attributes replace the guess and drive the GPU-direct decision. Runs on
//! the fake sysfs tree of an 8-GPU, 8-NIC DGX-class host.

use ferry_tests::{fake_gpu_dir, ferry_bin};
use serde_json::Value;
use std::path::Path;
use std::process::Command;

fn fixture() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(ferry_bin())
        .args(["topology", "--write-fixture", "dgx-h100"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    dir
}

fn info(sysfs: &Path, envs: &[(&str, &str)]) -> Value {
    let mut cmd = Command::new(ferry_bin());
    cmd.args(["info", "--json"])
        .env("FERRY_SYSFS_ROOT", sysfs)
        .env_remove("CUDA_VISIBLE_DEVICES")
        .env_remove("FERRY_GPU_DIRECT")
        .env_remove("FERRY_PLUGIN_PATH");
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let out = cmd.output().unwrap();
    assert!(out.status.success(), "{out:?}");
    serde_json::from_slice(&out.stdout).unwrap()
}

fn plugin<'a>(v: &'a Value, name: &str) -> &'a Value {
    v["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .find(|p| p["name"] == name)
        .unwrap_or_else(|| panic!("no plugin {name} in {v:#}"))
}

fn gpu<'a>(v: &'a Value, name: &str) -> &'a Value {
    v["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .find(|g| g["name"] == name)
        .unwrap_or_else(|| panic!("no GPU {name} in {v:#}"))
}

fn nearest(g: &Value) -> String {
    let n = &g["nearest_nics"][0];
    format!(
        "{} {}",
        n["name"].as_str().unwrap(),
        n["class"].as_str().unwrap()
    )
}

fn method(g: &Value) -> &str {
    g["registration"]["method"].as_str().unwrap()
}

fn skipped(g: &Value) -> String {
    g["registration"]["skipped"].to_string()
}

#[test]
fn without_a_driver_the_cuda_plugin_says_why_and_gpus_come_in_pci_order() {
    let sysfs = fixture();
    let v = info(sysfs.path(), &[]);
    let cuda = plugin(&v, "cuda");
    assert_eq!(cuda["state"], "disabled", "{cuda:#}");
    let reason = cuda["reason"].as_str().unwrap();
    assert!(reason.contains("libcuda.so.1"), "{reason}");
    let gpus = v["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 8);
    let pcis: Vec<&str> = gpus.iter().map(|g| g["pci"].as_str().unwrap()).collect();
    let mut sorted = pcis.clone();
    sorted.sort();
    assert_eq!(pcis, sorted, "ordinals follow PCI bus order");
    let g0 = gpu(&v, "cuda:0");
    assert!(
        g0["source"].as_str().unwrap().contains("PCI bus order"),
        "{g0:#}"
    );
    assert_eq!(nearest(g0), "mlx5_0 PIX");
    assert_eq!(method(g0), "staging through pinned host memory");
    assert!(skipped(g0).contains("no GPU driver"), "{g0:#}");

    // CUDA_VISIBLE_DEVICES renumbers the guess as the driver would.
    let v = info(sysfs.path(), &[("CUDA_VISIBLE_DEVICES", "5,0")]);
    assert_eq!(v["gpus"].as_array().unwrap().len(), 2, "{v:#}");
    assert_eq!(gpu(&v, "cuda:0")["pci"], pcis[5]);
    assert_eq!(gpu(&v, "cuda:1")["pci"], pcis[0]);
}

#[test]
fn the_driver_numbers_gpus_and_its_attributes_drive_the_decision() {
    let sysfs = fixture();
    let plugins = fake_gpu_dir();
    let path = plugins.path().to_str().unwrap();
    // The driver's ordinal 0 is the GPU on NUMA node 1, not the first by PCI.
    let base = [
        ("FERRY_PLUGIN_PATH", path),
        ("FERRY_FAKEGPU_DEVICES", "2"),
        ("FERRY_FAKEGPU_PCI", "0000:c3:00.0,0000:1b:00.0"),
    ];
    let with = |extra: &[(&str, &str)]| {
        let mut e = base.to_vec();
        e.extend_from_slice(extra);
        info(sysfs.path(), &e)
    };
    let v = with(&[]);
    assert_eq!(plugin(&v, "cuda")["state"], "enabled");
    assert_eq!(v["gpus"].as_array().unwrap().len(), 2, "{v:#}");
    let g0 = gpu(&v, "cuda:0");
    assert_eq!(g0["pci"], "0000:c3:00.0");
    assert_eq!(g0["numa"], 1);
    assert_eq!(nearest(g0), "mlx5_9 PIX");
    assert_eq!(gpu(&v, "cuda:1")["pci"], "0000:1b:00.0");
    assert_eq!(nearest(gpu(&v, "cuda:1")), "mlx5_0 PIX");

    // DMA-BUF when the GPU and the rdma transport support it; without
    // libibverbs (CI) the transport says so, the GPU is staged, and the
    // reason is the transport's. Without an enabled RDMA transport (here: no
    // RDMA device), the note says today's path.
    let method_of = |v: &serde_json::Value, memory: &str| -> (bool, String) {
        let m = v["gpu_direct"]["methods"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["memory"] == memory)
            .cloned()
            .unwrap_or_else(|| panic!("no {memory} in {v:#}"));
        (
            m["available"].as_bool().unwrap(),
            m["detail"].as_str().unwrap().to_string(),
        )
    };
    let (dmabuf, dmabuf_detail) = method_of(&v, "cuda-dmabuf");
    assert!(dmabuf_detail.starts_with("rdma: "), "{dmabuf_detail}");
    let transport = v["gpu_direct"]["transport"]
        .as_str()
        .unwrap_or("")
        .to_string();
    let direct = !transport.starts_with("none");
    if dmabuf {
        assert_eq!(method(g0), "DMA-BUF", "{g0:#}");
        let note = g0["registration"]["note"].as_str().unwrap_or("");
        if !direct {
            assert!(
                note.contains("staged") && note.contains("rdma transport"),
                "{g0:#}"
            );
        }
    } else {
        assert_eq!(method(g0), "staging through pinned host memory");
        assert!(skipped(g0).contains(&dmabuf_detail), "{g0:#}");
    }

    // No DMA-BUF on the GPU: nvidia-peermem if the transport reports it,
    // else staging with both reasons.
    let v = with(&[("FERRY_FAKEGPU_DMABUF", "0")]);
    let g0 = gpu(&v, "cuda:0");
    let (peermem, peermem_detail) = method_of(&v, "cuda-peermem");
    assert!(!peermem, "{peermem_detail}");
    assert_eq!(method(g0), "staging through pinned host memory", "{g0:#}");
    let why = skipped(g0);
    assert!(why.contains("DMA-BUF"), "{why}");
    assert!(why.contains(&peermem_detail), "{why}");

    // The same with nvidia-peermem loaded: peermem, where the transport has
    // an RDMA stack to use it with (the rdma plugin reads the module from
    // FERRY_SYSFS_ROOT, the core never does).
    std::fs::create_dir_all(sysfs.path().join("module/nvidia_peermem")).unwrap();
    let v = with(&[("FERRY_FAKEGPU_DMABUF", "0")]);
    let (peermem, peermem_detail) = method_of(&v, "cuda-peermem");
    if peermem {
        assert!(
            peermem_detail.contains("nvidia_peermem"),
            "{peermem_detail}"
        );
        assert_eq!(method(gpu(&v, "cuda:0")), "nvidia-peermem");
        assert!(v["gpu_direct"]["peermem"]
            .as_str()
            .unwrap()
            .contains("nvidia_peermem"));
    } else {
        assert!(peermem_detail.contains("no RDMA"), "{peermem_detail}");
        assert!(v["gpu_direct"]["peermem"].is_null());
    }

    // An operator's "off" wins over everything, and says so.
    let v = with(&[("FERRY_GPU_DIRECT", "off")]);
    let g0 = gpu(&v, "cuda:0");
    assert_eq!(method(g0), "staging through pinned host memory");
    assert!(skipped(g0).contains("FERRY_GPU_DIRECT=off"), "{g0:#}");

    // No GPUDirect RDMA attribute: staging even with peermem loaded.
    let v = with(&[("FERRY_FAKEGPU_GDR", "0"), ("FERRY_FAKEGPU_DMABUF", "0")]);
    assert_eq!(
        method(gpu(&v, "cuda:0")),
        "staging through pinned host memory"
    );
}
