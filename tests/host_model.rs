//! `ferry info --json` and a running engine, started with the same
//! settings, agree on what started: every transport's state and every
//! GPU's GPU-direct method, on every topology fixture, with GPUs whose
//! driver supports DMA-BUF, only GPUDirect RDMA, or neither, under each
//! FERRY_GPU_DIRECT policy; and on the DGX-class fixture once more with
//! the rdma transport enabled on the verbs emulator, where the methods are
//! the direct ones. `ferry info` knows the GPUs from the plugins' probes
//! and starts no plugin itself. The engine side is
//! tests/src/bin/ferry-host-model.rs.

use ferry_tests::{build_verbs_emulator, built, fake_gpu_dir, ferry_bin, repo_root, write_fixture};
use ferry_topology_fixtures::NAMES;
use serde_json::Value;
use std::collections::BTreeSet;
use std::path::Path;
use std::process::Command;

/// Runs `program args` with a clean FERRY_* environment plus `env`; its
/// stdout as JSON.
fn json_of(program: &Path, args: &[&str], env: &[(String, String)]) -> Value {
    let mut cmd = Command::new(program);
    cmd.args(args);
    for (k, _) in std::env::vars() {
        if k.starts_with("FERRY_") || k == "CUDA_VISIBLE_DEVICES" {
            cmd.env_remove(k);
        }
    }
    cmd.env("FERRY_PLUGIN_CACHE", "off");
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("run the program");
    assert!(
        out.status.success(),
        "{} {args:?} failed under {env:?}:\n{}",
        program.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap_or_else(|e| {
        panic!(
            "{} printed no JSON ({e}):\n{}",
            program.display(),
            String::from_utf8_lossy(&out.stdout)
        )
    })
}

/// The transports `ferry info` reports enabled.
fn info_transports(info: &Value) -> BTreeSet<String> {
    info["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|p| p["kind"] == "transport" && p["state"] == "enabled")
        .map(|p| p["name"].as_str().unwrap().to_string())
        .collect()
}

/// Holds `ferry info --json` and the engine together under `env`; returns
/// the engine's GPU decisions (location -> method and reasons).
fn agree(what: &str, env: &[(String, String)]) -> Value {
    let info = json_of(&ferry_bin(), &["info", "--json"], env);
    let engine = json_of(&built("ferry-host-model"), &[], env);
    let started: BTreeSet<String> = engine["transports"]
        .as_array()
        .unwrap()
        .iter()
        .chain(engine["transport_failures"].as_array().unwrap())
        .map(|t| t.as_str().unwrap().to_string())
        .collect();
    assert_eq!(
        info_transports(&info),
        started,
        "{what}: info's enabled transports against the engine's"
    );
    assert!(
        engine["transport_failures"].as_array().unwrap().is_empty(),
        "{what}: a transport info calls enabled failed to start: {engine}"
    );
    let gpus = engine["gpus"].as_object().unwrap();
    let from_driver: Vec<&Value> = info["gpus"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|g| g["source"].as_str().unwrap().ends_with("driver"))
        .collect();
    assert_eq!(
        from_driver.len(),
        gpus.len(),
        "{what}: info's GPUs {:#} against the engine's {engine}",
        info["gpus"]
    );
    for g in from_driver {
        let name = g["name"].as_str().unwrap();
        let in_use = g["registration"]["in_use"].as_str().unwrap();
        let decided = gpus
            .get(name)
            .and_then(Value::as_str)
            .unwrap_or_else(|| panic!("{what}: the engine has no {name}: {engine}"));
        let method = decided.split(';').next().unwrap();
        assert_eq!(
            in_use, method,
            "{what}, {name}: info says {g:#}; the engine decided {decided:?}"
        );
    }
    engine
}

fn env(pairs: &[(&str, &str)]) -> Vec<(String, String)> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn info_and_the_engine_agree_on_every_fixture_gpu_kind_and_policy() {
    let plugins = fake_gpu_dir();
    let plugin_path = plugins.path().display().to_string();
    for name in NAMES {
        let dir = tempfile::tempdir().unwrap();
        write_fixture(name, dir.path());
        let sysfs = dir.path().display().to_string();
        // No GPU driver: the cuda plugin is the real one, and has no libcuda.
        agree(
            &format!("{name}, no driver"),
            &env(&[("FERRY_SYSFS_ROOT", &sysfs)]),
        );
        // The GPUs of the tree, supporting DMA-BUF, only GPUDirect RDMA, or
        // neither; every policy with the first.
        let kinds: [&[(&str, &str)]; 3] = [
            &[],
            &[("FERRY_FAKEGPU_DMABUF", "0")],
            &[("FERRY_FAKEGPU_DMABUF", "0"), ("FERRY_FAKEGPU_GDR", "0")],
        ];
        for (i, gpu) in kinds.iter().enumerate() {
            let policies: &[&str] = if i == 0 {
                &["auto", "dmabuf", "peermem", "off"]
            } else {
                &["auto"]
            };
            for policy in policies {
                let mut e = env(&[
                    ("FERRY_SYSFS_ROOT", &sysfs),
                    ("FERRY_PLUGIN_PATH", &plugin_path),
                    ("FERRY_FAKEGPU_DEVICES", "sysfs"),
                    ("FERRY_GPU_DIRECT", policy),
                ]);
                e.extend(env(gpu));
                agree(
                    &format!("{name}, GPUs {gpu:?}, FERRY_GPU_DIRECT={policy}"),
                    &e,
                );
            }
        }
    }
}

#[test]
fn with_an_rdma_transport_both_name_the_direct_method() {
    let work = tempfile::tempdir().unwrap();
    let lib = work.path().join("lib");
    std::fs::create_dir_all(&lib).unwrap();
    build_verbs_emulator(&lib);
    let plugins = fake_gpu_dir();
    let sysfs = work.path().join("dgx");
    write_fixture("dgx-h100", &sysfs);
    let peermem = work.path().join("dgx-peermem");
    write_fixture("dgx-h100", &peermem);
    std::fs::create_dir_all(peermem.join("module/nvidia_peermem")).unwrap();
    let fabric = tempfile::tempdir().unwrap();
    let conf = repo_root().join("tests/verbs-emulator/dgx-h100.conf");
    for (tree, gpu, want) in [
        (&sysfs, &[][..], "DMA-BUF"),
        (
            &peermem,
            &[("FERRY_FAKEGPU_DMABUF", "0")][..],
            "nvidia-peermem",
        ),
        (
            &sysfs,
            &[("FERRY_FAKEGPU_DMABUF", "0")][..],
            "staging through pinned host memory",
        ),
    ] {
        let mut e = env(&[
            ("LD_LIBRARY_PATH", &lib.display().to_string()),
            ("FERRY_VERBS_EMU_CONFIG", &conf.display().to_string()),
            ("FERRY_VERBS_EMU_DIR", &fabric.path().display().to_string()),
            ("FERRY_SYSFS_ROOT", &tree.display().to_string()),
            ("FERRY_PLUGIN_PATH", &plugins.path().display().to_string()),
            ("FERRY_FAKEGPU_DEVICES", "sysfs"),
        ]);
        e.extend(env(gpu));
        let what = format!(
            "dgx-h100 on the verbs emulator, GPUs {gpu:?}, {}",
            tree.display()
        );
        let engine = agree(&what, &e);
        let transports = engine["transports"].to_string();
        assert!(transports.contains("\"rdma\""), "{what}: {engine}");
        for (loc, decided) in engine["gpus"].as_object().unwrap() {
            assert!(
                decided.as_str().unwrap().starts_with(want),
                "{what}, {loc}: want {want}, the engine decided {decided}"
            );
        }
    }
}

#[test]
fn info_describes_gpus_from_the_probe_without_starting_a_plugin() {
    let plugins = fake_gpu_dir();
    let dir = tempfile::tempdir().unwrap();
    write_fixture("dgx-h100", dir.path());
    let mark = dir.path().join("init-called");
    let e = env(&[
        ("FERRY_SYSFS_ROOT", &dir.path().display().to_string()),
        ("FERRY_PLUGIN_PATH", &plugins.path().display().to_string()),
        ("FERRY_FAKEGPU_DEVICES", "sysfs"),
        ("FERRY_FAKEGPU_INIT_MARK", &mark.display().to_string()),
    ]);
    let info = json_of(&ferry_bin(), &["info", "--json"], &e);
    let gpus = info["gpus"].as_array().unwrap();
    assert_eq!(gpus.len(), 8, "{info:#}");
    for g in gpus {
        assert_eq!(g["source"], "cuda driver", "{g:#}");
        assert_eq!(g["model"], "Fake GPU", "{g:#}");
        assert!(
            g["uuid"].as_str().unwrap().starts_with("GPU-fake-"),
            "{g:#}"
        );
    }
    assert!(
        !mark.exists(),
        "ferry info started the device plugin: its GPUs must come from the probe"
    );
    // The engine does start it: the mark is how this test can tell.
    json_of(&built("ferry-host-model"), &[], &e);
    assert!(mark.exists(), "the engine did not start the device plugin");
}
