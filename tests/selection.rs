//! Selection by declared properties and measurement, on real engines with
//! C plugins compiled here (tests/plugins/c/declared.c) that declare their
//! links through ABI 1.2:
//!
//! - a 400 Gbit/s cross-host link is chosen over tcp for a peer on another
//!   host (an engine in its own IPC namespace, which makes it one);
//! - a same-host link slower than shm is not chosen over shm;
//! - a plugin that declares more than it delivers loses to a measured
//!   better one within a bounded number of batches, and the route stays.

use ferry_core::{Engine, EngineConfig, Op, Request, Scope};
use ferry_tests::{compile_shared, repo_root, TargetProcess};
use std::path::Path;
use std::process::Command;

/// Builds declared.c as `libferry_transport_<name>.so` in `dir`.
fn build(dir: &Path, name: &str, defines: &[String]) {
    let mut extra = vec![format!("-DDECL_NAME=\"{name}\""), "-lpthread".to_string()];
    extra.extend(defines.iter().cloned());
    let extra: Vec<&str> = extra.iter().map(String::as_str).collect();
    compile_shared(
        &[repo_root().join("tests/plugins/c/declared.c")],
        &dir.join(format!("libferry_transport_{name}.so")),
        &extra,
    );
}

fn engine(plugins: &Path, transports: &str) -> Engine {
    let mut config = EngineConfig::default();
    config
        .set("plugin_path", plugins.to_str().unwrap())
        .unwrap();
    config.set("transports", transports).unwrap();
    Engine::new(config).unwrap()
}

/// `unshare --ipc`, or as an unprivileged user `unshare --user
/// --map-root-user --ipc`: an engine in another IPC namespace is on
/// another host as far as Ferry can tell (identity.rs).
fn other_host_wrapper() -> Option<Vec<&'static str>> {
    [
        vec!["unshare", "--ipc"],
        vec!["unshare", "--user", "--map-root-user", "--ipc"],
    ]
    .into_iter()
    .find(|w| {
        Command::new(w[0])
            .args(&w[1..])
            .arg("true")
            .status()
            .is_ok_and(|s| s.success())
    })
}

#[test]
fn a_declared_400_gbit_link_is_chosen_over_tcp_for_a_peer_on_another_host() {
    let dir = tempfile::tempdir().unwrap();
    build(
        dir.path(),
        "fast",
        &[
            "-DDECL_SCOPES=(FERRY_SCOPE_SAME_HOST|FERRY_SCOPE_CROSS_HOST)".into(),
            "-DDECL_MBPS=400000".into(),
            "-DDECL_LATENCY_NS=2000".into(),
            "-DDECL_ANY_PEER=1".into(),
        ],
    );
    let Some(wrapper) = other_host_wrapper() else {
        panic!("this test needs `unshare --ipc` (util-linux; root or user namespaces)");
    };
    let env = [
        ("FERRY_PLUGIN_PATH", dir.path().to_str().unwrap()),
        ("FERRY_TRANSPORTS", "tcp,fast"),
    ];
    let target = TargetProcess::start(&["--buffer-size", "16M"], &env, &wrapper);
    let initiator = engine(dir.path(), "tcp,fast");
    let mut names = initiator.transports();
    names.sort();
    assert_eq!(names, vec!["fast", "tcp"]);
    let local = vec![0u8; 16 << 20];
    initiator
        .register_memory(local.as_ptr() as u64, local.len() as u64, None)
        .unwrap();
    let seg = initiator.open_segment(&target.segment).unwrap();
    let remote = initiator.descriptor_of(seg).unwrap().buffers[0].addr;
    for len in [4096u64, 16 << 20] {
        let route = initiator
            .route(seg, local.as_ptr() as u64, remote, len)
            .unwrap();
        assert_eq!(route.scope, Scope::CrossHost, "{}", route.reason);
        assert_eq!(route.transport, "fast", "{}", route.reason);
        assert!(
            route
                .reason
                .contains("declared 400 Gbit/s, 2.0 us over fast0"),
            "{}",
            route.reason
        );
        assert!(
            route.reason.contains("preferred over tcp (estimated"),
            "{}",
            route.reason
        );
        let e = route.estimate.expect("an estimate");
        assert!(e.declared);
        assert_eq!(
            (e.bandwidth_mbps, e.device.as_deref()),
            (400_000.0, Some("fast0"))
        );
    }
}

#[test]
fn a_same_host_link_slower_than_shm_is_not_chosen_over_shm() {
    let dir = tempfile::tempdir().unwrap();
    // Slower than shm in both bandwidth and latency, whatever shm declares
    // (or, declaring nothing, is assumed to do).
    build(
        dir.path(),
        "slow",
        &[
            "-DDECL_SCOPES=FERRY_SCOPE_SAME_HOST".into(),
            "-DDECL_MBPS=100".into(),
            "-DDECL_LATENCY_NS=1000000".into(),
            "-DDECL_ANY_PEER=1".into(),
        ],
    );
    let env = [
        ("FERRY_PLUGIN_PATH", dir.path().to_str().unwrap()),
        ("FERRY_TRANSPORTS", "slow,shm"),
    ];
    let target = TargetProcess::start(&["--buffer-size", "16M"], &env, &[]);
    // slow is loaded first (FERRY_PLUGIN_PATH comes first): only the
    // figures can put shm ahead.
    let initiator = engine(dir.path(), "slow,shm");
    assert_eq!(initiator.transports(), vec!["slow", "shm"]);
    let mut local = vec![7u8; 16 << 20];
    initiator
        .register_memory(local.as_mut_ptr() as u64, local.len() as u64, None)
        .unwrap();
    let seg = initiator.open_segment(&target.segment).unwrap();
    let remote = initiator.descriptor_of(seg).unwrap().buffers[0].addr;
    for len in [64u64, 4096, 1 << 20, 16 << 20] {
        let route = initiator
            .route(seg, local.as_ptr() as u64, remote, len)
            .unwrap();
        assert_eq!(route.scope, Scope::SameHost);
        assert_eq!(route.transport, "shm", "{len}: {}", route.reason);
        assert!(
            route.reason.contains("preferred over slow (estimated"),
            "{}",
            route.reason
        );
    }
    // And transfers go by shm (slow cannot move data between processes:
    // a request it carried would fail).
    for _ in 0..8 {
        initiator
            .transfer_sync(&[Request::new(
                Op::Write,
                local.as_ptr() as u64,
                seg,
                remote,
                16 << 20,
            )])
            .unwrap();
    }
}

#[test]
fn a_link_that_declares_more_than_it_delivers_loses_to_a_measured_better_one_for_good() {
    let dir = tempfile::tempdir().unwrap();
    // boast declares 400 Gbit/s but waits 100 ms per hand-over (16 MiB in
    // 100 ms: 1.3 Gbit/s at best); honest declares 20 Gbit/s and copies
    // at memory speed.
    build(
        dir.path(),
        "boast",
        &[
            "-DDECL_MBPS=400000".into(),
            "-DDECL_LATENCY_NS=1000".into(),
            "-DDECL_DELAY_US=100000".into(),
        ],
    );
    build(
        dir.path(),
        "honest",
        &["-DDECL_MBPS=20000".into(), "-DDECL_LATENCY_NS=2000".into()],
    );
    let target = engine(dir.path(), "boast,honest");
    let initiator = engine(dir.path(), "boast,honest");
    const LEN: usize = 16 << 20;
    let mut remote = vec![0u8; LEN];
    let local = ferry_tests::pattern(LEN, 3);
    target
        .register_memory(remote.as_mut_ptr() as u64, LEN as u64, None)
        .unwrap();
    initiator
        .register_memory(local.as_ptr() as u64, LEN as u64, None)
        .unwrap();
    let seg = initiator.open_segment(target.segment_name()).unwrap();
    let r = remote.as_ptr() as u64;
    let mut routes = Vec::new();
    for _ in 0..24 {
        let route = initiator
            .route(seg, local.as_ptr() as u64, r, LEN as u64)
            .unwrap();
        routes.push(route.transport);
        initiator
            .transfer_sync(&[Request::new(
                Op::Write,
                local.as_ptr() as u64,
                seg,
                r,
                LEN as u64,
            )])
            .unwrap();
    }
    assert!(remote == local);
    // boast first (by its declaration), for as many batches as it takes to
    // measure it (3 samples), then honest, and honest ever after.
    assert_eq!(routes[0], "boast", "{routes:?}");
    let switched = routes.iter().position(|t| t == "honest").expect("a switch");
    assert!(switched <= 4, "{routes:?}");
    assert!(
        routes[switched..].iter().all(|t| t == "honest"),
        "{routes:?}"
    );
    let last = initiator
        .route(seg, local.as_ptr() as u64, r, LEN as u64)
        .unwrap();
    assert!(
        last.reason.contains("which replaces the declared figure"),
        "{}",
        last.reason
    );
    let e = last.estimate.unwrap();
    assert!(e.bandwidth_samples >= 3, "{e:?}");
}
